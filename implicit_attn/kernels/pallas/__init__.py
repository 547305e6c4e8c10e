"""Pallas kernels for ``ImplicitOperator.materialize`` / ``reduce`` (``impl="pallas"``).

One tiled kernel family serves every recurrent core: ``plans.py`` maps a core to its
inputs (one plan function registered per core type), ``tiles.py`` holds the per-tile
math, ``calls.py`` the ``pallas_call``s. The pure-jnp references are the cores' own
``dense`` methods and ``operator.blocked_reduce``.

Cores with a kernel: every type registered in ``plans.PLANS`` (``StateDecayCore``,
``ScalarDecayCore``, ``DocumentMaskedCore`` (around a ``ScalarDecayCore`` the scalar plan reads the
document ids; around any other core with a kernel XLA zeroes that kernel's entries between
documents, and its reduce is the XLA blocks of those), ``Mamba2Core``,
``RwkvCore``, ``AttentionCore``, ``LaSCore``, ``ShortConvCore``, and the head-matrix cores ``DeltaRuleCore``
and ``DplrCore``, whose kernel is the chunk recurrence giving every head's ``M_h``, and
``MlstmCore``, whose ``M_h`` are the scalar tiles over its heads; channels and the channel
reduction are then XLA elementwise work on ``M_h``). A ``ParallelCore`` (Zamba, Falcon-H1) runs
each part with a kernel through it and its other parts with XLA (``ParallelCore.dense_by``,
``operator.dispatch.parallel_reduce``); a ``BidirectionalCore`` (ViM) both directions' kernels,
flipped and summed by XLA, its reduce the XLA blocks formed so. A core type without a kernel
raises ``TypeError`` naming it under ``impl="pallas"``; ``impl="auto"`` uses XLA for it.

On CPU the kernels run with ``interpret=True`` (correct, slow); on GPU/TPU compiled.
``impl="auto"`` picks a compiled kernel only for core types verified on the platform
(``plans.VERIFIED``: ``ScalarDecayCore``, ``RwkvCore`` and ``DocumentMaskedCore`` on cuda) and falls back to XLA, with one warning, if it fails.
Gradients go through the XLA reference (``operator.with_xla_backward``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...operator import (MODES, BidirectionalCore, DocumentMaskedCore, KernelBackend, ParallelCore, ScalarDecayCore,
                         blocked_reduce, block_size, default_platform, register_backend, register_core,
                         with_xla_backward)
from ...operator.dispatch import blocked_reduce_by, blocked_reduce_jit, parallel_reduce
from ...ops import full_precision
from . import calls
from .plans import PLANS, VERIFIED, make_plan

DEFAULT_TILE = 32
ACCELERATORS = ("gpu", "tpu", "cuda", "rocm")


def on_accelerator() -> bool:
    """True when the default JAX backend is a GPU or TPU (Pallas compiles there)."""
    return jax.default_backend() in ACCELERATORS


def _check_tile(tile):
    if tile is None:
        return DEFAULT_TILE
    if not isinstance(tile, (int, np.integer)) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    return int(tile)


def _kernels(target: calls.Target, tile: int):
    """``(dense, reduce)`` of one target: plan (with its tile edge) and call."""
    T = target.tile(tile)

    def planned(core, idx):
        plan = make_plan(core, idx, T)
        stats = {"softmax": calls.softmax_stats, "attention": calls.attention_stats}.get(plan.kind)
        return plan if stats is None else stats(plan, target)

    def with_matrices(core, plan):
        # Head-matrix cores: the kernel computes every head's M_h (the delta rule's and DPLR's by
        # their chunk recurrence, the mLSTM's as tiles of a plan over its heads); the channels are
        # M_h with their scalings and conv, per block of channels (O(L^2) elementwise work).
        if plan.kind == "head_matrices":
            M = calls.head_matrices(plan, target)
        else:
            M = calls.nan_safe_call(plan, lambda p: calls.materialize(p, target))
        return core.with_head_matrices(M)

    def dense(core, idx):
        plan = planned(core, idx)
        if plan.heads:
            return with_matrices(core, plan).dense(idx)
        return calls.nan_safe_call(plan, lambda p: calls.materialize(p, target))

    def reduce(core, idx, mode, qw, kw):
        plan = planned(core, idx)
        if plan.heads:
            B, n, L = qw.shape
            return blocked_reduce(with_matrices(core, plan), idx, qw, kw, mode, block_size(n, B, L, None))
        return calls.nan_safe_call(plan, lambda p: calls.reduce(p, mode, qw, kw, target))

    return dense, reduce


def _per_platform(fns: dict):
    """One function choosing among ``fns`` (platform -> function) by the platform the
    computation is lowered for (so ``jax.export(..., platforms=["tpu"])`` from a CPU
    machine gets the TPU kernel), not by the machine it is traced on."""
    def f(*args):
        return jax.lax.platform_dependent(*args, **fns)

    return f


@functools.lru_cache(maxsize=None)
def _entry_points(tile: int, interpret: bool | None):
    """Differentiable, jitted ``(dense, reduce)`` for one tile size.

    ``interpret``: True = interpret mode everywhere; False = the compiled kernel of the
    lowering platform (Triton on cuda/rocm, Mosaic on tpu); None = compiled on those,
    interpret mode elsewhere (CPU)."""
    interp = _kernels(calls.TARGETS["interpret"], tile)
    if interpret:
        d, r = interp
    else:
        triton = _kernels(calls.TARGETS["triton"], tile)
        tpu = _kernels(calls.TARGETS["mosaic_tpu"], tile)
        # Elsewhere (CPU): the interpreter, or for interpret=False the Triton kernel, whose
        # lowering there fails with Pallas's "Only interpret mode is supported on CPU".
        other = interp if interpret is None else triton
        per = [{"cuda": t, "rocm": t, "tpu": m, "default": o} for t, m, o in zip(triton, tpu, other)]
        d, r = (_per_platform(p) for p in per)
    d, r = with_xla_backward(d, r)
    return jax.jit(d), jax.jit(r)  # mode is traced: one compilation serves every reduction


@functools.lru_cache(maxsize=None)
def _part_functions(tile: int | None, interpret: bool | None):
    """``(dense, reduce)`` of a ``ParallelCore``'s part: its kernel where it has one, else XLA. One
    pair per setting, so the jitted ``repeated_reduce`` that takes ``dense`` compiles once."""
    def dense(part, idx):
        return pallas_dense(part, idx, tile, interpret) if has_kernel(part) else part.dense(idx)

    def reduce(part, local, how, qw, kw):
        if has_kernel(part):
            return pallas_reduce(part, local, how, qw, kw, tile, interpret)
        B, n, L = qw.shape
        return blocked_reduce_jit(part, jnp.asarray(local), qw, kw, how, block_size(n, B, L, None))

    return dense, reduce


def _bidirectional_problem(core) -> str | None:
    """A ``BidirectionalCore`` runs both directions' kernels: each needs one."""
    why = BACKEND.problem(core.forward) or BACKEND.problem(core.backward)
    return why and f"a direction has no kernel: {why}"


def _masks_inner_output(core) -> bool:
    """A ``DocumentMaskedCore`` whose inner core's plan takes no document ids (all but the scalar
    cores'): its inner kernel runs, then XLA zeroes the entries between documents."""
    return type(core) is DocumentMaskedCore and not isinstance(core.inner, ScalarDecayCore)


def _document_masked_problem(core) -> str | None:
    """A ``DocumentMaskedCore``: the scalar plan with document ids, or its inner core's kernel."""
    if not _masks_inner_output(core):
        return None
    why = BACKEND.problem(core.inner)
    return why and f"its inner core has no kernel: {why}"


@functools.partial(jax.jit, static_argnums=(5, 6))
def _reduce_by_parts(core, idx, mode, qw, kw, tile: int, interpret: bool | None):
    """The blocked reduce with each block formed by ``core.dense_by`` with its parts' kernels: both
    directions of a ``BidirectionalCore`` (not causal, which the fused reduce's tiles assume), the
    inner core of a document-masked one."""
    return blocked_reduce_by(core, idx, qw, kw, mode, _part_functions(tile, interpret)[0])


def _parallel_problem(core) -> str | None:
    """A ``ParallelCore`` runs its parts' kernels (the other parts XLA): it needs at least one."""
    if any(BACKEND.problem(p) is None for p in core.parts):
        return None
    return f"none of its parts has a kernel (parts: {', '.join(type(p).__name__ for p in core.parts)})"


@full_precision  # the XLA steps around the kernels (head matrices' channels, stats): no TF32
def pallas_dense(core, idx, tile: int | None = None, interpret: bool | None = None):
    """``core.dense(idx)`` computed by the tiled Pallas kernel.

    Args:
      core: an operator core with a kernel (see module docstring).
      idx: ``(n,)`` int channel indices.
      tile: tile edge ``T`` (>= conv width - 1; None: ``DEFAULT_TILE``, read at call time so
        it can be tuned); L need not be a multiple of it. Compiled kernels round it up to
        what the platform needs (Triton: a power of two >= 16; TPU: a multiple of 128).
      interpret: True: Pallas interpret mode; False: the compiled kernel of the platform
        the computation is lowered for (an error on CPU); None: compiled on GPU/TPU,
        interpret mode elsewhere, chosen per lowering platform.
    Returns:
      ``(B, n, L, L)`` float32, equal to ``core.dense(idx)`` to float32 rounding.
    """
    BACKEND.check_core(core)
    tile, interpret = _check_tile(tile), None if interpret is None else bool(interpret)
    if type(core) in (ParallelCore, BidirectionalCore) or _masks_inner_output(core):
        return core.dense_by(idx, _part_functions(tile, interpret)[0])
    dense, _ = _entry_points(tile, interpret)
    return dense(core, jnp.asarray(idx, jnp.int32))


@full_precision
def pallas_reduce(core, idx, how: str, qw, kw, tile: int | None = None, interpret: bool | None = None):
    """Fused channel reduction ``sum_c qw[b,c,i] f(H_c[b,i,j]) kw[b,c,j]`` (``(B, L, L)``).

    ``f`` is the identity (``how="mean"`` / ``"weighted"``), ``abs`` (``"abs_mean"``) or
    ``max(., 0)`` (``"pos_mean"``); the caller puts ``1/n`` into ``qw`` for the means.
    ``(B, n, L, L)`` is never written: each output tile sums its channels in the kernel.

    Args:
      core: an operator core with a kernel; idx: ``(n,)`` int channels.
      qw, kw: ``(B, n, L)`` per-channel, per-position query / key weights.
      tile, interpret: as for ``pallas_dense``.
    Returns:
      ``(B, L, L)`` float32.
    """
    BACKEND.check_core(core)
    if how not in MODES:
        raise ValueError(f"how must be one of {tuple(MODES)}, got {how!r}")
    tile, interpret = _check_tile(tile), None if interpret is None else bool(interpret)
    if type(core) is ParallelCore:
        part_dense, part_reduce = _part_functions(tile, interpret)
        if isinstance(idx, jax.core.Tracer):
            return blocked_reduce_by(core, idx, qw, kw, how, part_dense)
        return parallel_reduce(core, idx, how, jnp.asarray(qw, jnp.float32), jnp.asarray(kw, jnp.float32),
                               part_dense, part_reduce)
    if type(core) is BidirectionalCore or _masks_inner_output(core):
        return _reduce_by_parts(core, jnp.asarray(idx, jnp.int32), jnp.asarray(MODES[how], jnp.int32),
                                jnp.asarray(qw, jnp.float32), jnp.asarray(kw, jnp.float32), tile, interpret)
    _, reduce = _entry_points(tile, interpret)
    return reduce(core, jnp.asarray(idx, jnp.int32), jnp.asarray(MODES[how], jnp.int32),
                  jnp.asarray(qw, jnp.float32), jnp.asarray(kw, jnp.float32))


def trusted(core) -> bool:
    """Whether ``impl="auto"`` may use the compiled kernel for ``core`` here: its core type
    is verified on this platform (``plans.VERIFIED``); for a ``ParallelCore``, every part's
    that has a kernel; for a ``BidirectionalCore``, both directions'."""
    if type(core) is ParallelCore:
        return all(trusted(p) for p in core.parts if has_kernel(p))
    if type(core) is BidirectionalCore:
        return trusted(core.forward) and trusted(core.backward)
    if _masks_inner_output(core):
        return trusted(core.inner)
    return default_platform() in VERIFIED.get(type(core), frozenset())


def has_kernel(core) -> bool:
    """True if ``impl="pallas"`` takes ``core``."""
    return BACKEND.problem(core) is None


BACKEND = register_backend(KernelBackend(
    name="pallas", dense=lambda core, idx: pallas_dense(core, idx),
    reduce=lambda core, idx, how, qw, kw: pallas_reduce(core, idx, how, qw, kw), auto=on_accelerator,
    trusted=trusted))
for _type, (_, _check) in PLANS.items():
    register_core("pallas", _type, _check)
register_core("pallas", ParallelCore, _parallel_problem)
register_core("pallas", BidirectionalCore, _bidirectional_problem)
register_core("pallas", DocumentMaskedCore, _document_masked_problem)  # (the plans take the scalar ones)


__all__ = ["pallas_dense", "pallas_reduce", "has_kernel", "trusted", "on_accelerator",
           "DEFAULT_TILE", "BACKEND"]
