"""Custom ``jax.vmap`` rules: branch predicates that stay one branch, and token-wise functions
whose mapped axis becomes more tokens.

A ``lax.cond`` whose predicate is batched becomes a select that computes both sides for every
example. Where the cheap side is only a shortcut (it gives the same numbers when it applies),
one predicate for the whole batch keeps the branch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import custom_batching


@custom_batching.custom_vmap
def any_in_batch(flag):
    """``flag`` (a traced bool scalar) as it is; under ``jax.vmap`` the OR over the mapped axis,
    unbatched, so a ``lax.cond`` on it stays a branch (the side for "true" runs for the whole
    batch when any example needs it). Differentiable functions may branch on it."""
    return flag


@any_in_batch.def_vmap
def _any_in_batch_vmap(axis_size, in_batched, flag):
    return (jnp.any(flag) if in_batched[0] else flag), False


@custom_batching.custom_vmap
def most_in_batch(value):
    """``value`` (a traced int scalar) as it is; under ``jax.vmap`` the maximum over the mapped
    axis, unbatched, so a ``lax.switch`` on it stays a switch (the branch for the largest value
    runs for the whole batch; a batched index makes the switch a select of every branch, whose
    operands' ``stop_gradient`` reverse mode cannot transpose where they are tangents). For
    switches where a larger index gives the same numbers."""
    return value


@most_in_batch.def_vmap
def _most_in_batch_vmap(axis_size, in_batched, value):
    return (jnp.max(value, axis=0) if in_batched[0] else value), False


@custom_batching.custom_vmap
def zero_mapped_with(*values):
    """A float32 scalar ``0``; under ``jax.vmap`` one ``0`` per example, mapped, where any of
    ``values`` is mapped. Adding it maps an unmapped operand with the others, for primitives that
    jax batches only with every operand mapped (``ragged_dot``). The values should carry no
    tangents (``stop_gradient``, or integers): the rule cannot be differentiated."""
    return jnp.zeros((), jnp.float32)


@zero_mapped_with.def_vmap
def _zero_mapped_with_vmap(axis_size, in_batched, *values):
    mapped = any(in_batched)
    return jnp.zeros((axis_size,) if mapped else (), jnp.float32), mapped


def batched_as_tokens(f, n_tokens: int):
    """``f`` with a ``jax.vmap`` rule that folds the mapped axis into the tokens.

    ``f(*token_args, *shared_args)`` takes ``n_tokens`` arrays of ``(T, ...)`` tokens first and
    returns ``(T, ...)``, row ``t`` a function of the token arguments' rows ``t`` and the shared
    arguments only (the experts' layer: tokens, routing weights and expert indices; the experts'
    weights). Under ``jax.vmap`` with the shared arguments unmapped, the ``(B, T, ...)`` token
    arguments run as one call on ``B T`` tokens (unmapped ones broadcast first), which gives each
    example's rows; with a shared argument mapped, the examples run one after another
    (``lax.map``). Use it where ``f``'s own batching fails or is slow: ``jax.lax.ragged_dot``
    batches only with every operand mapped.

    Derivatives are ``f``'s (``jax.jvp`` of ``f``: forward and reverse mode). Under ``jax.vmap``
    jax batches ``f``'s derivatives with ``f``'s own rules: it cannot transpose a custom batching
    rule, so derivatives under ``vmap`` fail where ``f``'s batching does.
    """
    mapped_alone = custom_batching.custom_vmap(f)

    @mapped_alone.def_vmap
    def _fold(axis_size, in_batched, *args):
        if any(in_batched[n_tokens:]):
            shared = [a for a, b in zip(args, in_batched) if not b]

            def one(mapped):
                m, s = iter(mapped), iter(shared)
                return g(*[next(m) if b else next(s) for b in in_batched])

            return jax.lax.map(one, [a for a, b in zip(args, in_batched) if b]), True
        tokens = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                  for a, b in zip(args[:n_tokens], in_batched)]
        T = tokens[0].shape[1]
        out = g(*[a.reshape((axis_size * T,) + a.shape[2:]) for a in tokens], *args[n_tokens:])
        return out.reshape((axis_size, T) + out.shape[1:]), True

    g = jax.custom_jvp(mapped_alone)
    g.defjvp(lambda primals, tangents: jax.jvp(f, primals, tangents))
    return g


__all__ = ["any_in_batch", "most_in_batch", "zero_mapped_with", "batched_as_tokens"]
