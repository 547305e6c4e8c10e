"""Pallas kernels for ``ImplicitOperator.materialize`` / ``reduce`` (``impl="pallas"``).

One tiled kernel family serves every recurrent core (``plans.py`` maps a core to its
inputs, ``tiles.py`` holds the per-tile math, ``calls.py`` the ``pallas_call``s). The
pure-jnp references are the cores' own ``dense`` methods and ``reference.xla_reduce``.

Supported cores: ``StateDecayCore`` (Mamba-1), ``ScalarDecayCore`` (Griffin's RG-LRU and
any per-group scalar decay), ``DocumentMaskedCore`` around it (packed documents),
``Mamba2Core`` and ``RwkvCore``. ``AttentionCore`` (Griffin's local attention) has no
kernel: ``impl="pallas"`` raises ``TypeError`` naming it (``impl="auto"`` uses XLA for it).

On CPU the kernels run with ``interpret=True`` (correct, slow); on GPU/TPU compiled.
Gradients: both entry points have a ``custom_vjp`` whose backward pass is the XLA
reference (``jax.vjp`` of ``core.dense`` / ``xla_reduce``), not a Pallas kernel.

The fused C++ CPU kernels (``impl="cpu"``) live in ``kernels.cpu``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import calls
from .plans import make_plan, supported, unsupported_message
from .reference import xla_reduce
from .tiles import MODES

DEFAULT_TILE = 32
ACCELERATORS = ("gpu", "tpu", "cuda", "rocm")


def on_accelerator() -> bool:
    """True when the default JAX backend is a GPU or TPU (Pallas compiles there)."""
    return jax.default_backend() in ACCELERATORS


def default_interpret() -> bool:
    """Pallas interpret mode everywhere except GPU/TPU."""
    return not on_accelerator()


def has_kernel(core) -> bool:
    """True if ``impl="pallas"`` supports ``core``."""
    return supported(core)


def check_core(core):
    """Raise ``TypeError`` naming ``core`` if it has no Pallas kernel."""
    if not supported(core):
        raise TypeError(unsupported_message(core))


def _check_tile(tile):
    if tile is None:
        return DEFAULT_TILE
    if not isinstance(tile, (int, np.integer)) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    return int(tile)


def _dense_impl(core, idx, tile, interpret):
    plan = make_plan(core, idx, tile)
    if plan.kind == "softmax":
        plan = calls.softmax_stats(plan, interpret)
    return calls.materialize(plan, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(core, idx, tile, interpret):
    return _dense_impl(core, idx, tile, interpret)


def _dense_fwd(core, idx, tile, interpret):
    return _dense_impl(core, idx, tile, interpret), (core, idx)


def _zero_ct(x):
    return np.zeros(x.shape, jax.dtypes.float0)


def _dense_bwd(tile, interpret, res, g):
    core, idx = res
    _, vjp = jax.vjp(lambda c: c.dense(idx), core)
    return vjp(g)[0], _zero_ct(idx)


_dense.defvjp(_dense_fwd, _dense_bwd)


def pallas_dense(core, idx, tile: int | None = None, interpret: bool | None = None):
    """``core.dense(idx)`` computed by the tiled Pallas kernel.

    Args:
      core: an operator core with a kernel (see module docstring).
      idx: ``(n,)`` int channel indices.
      tile: tile edge ``T`` (>= conv width - 1; None: ``DEFAULT_TILE``, read at call time so
        it can be tuned); L need not be a multiple of it.
      interpret: Pallas interpret mode; None = on unless on GPU/TPU.
    Returns:
      ``(B, n, L, L)`` float32, equal to ``core.dense(idx)`` to float32 rounding.
    """
    check_core(core)
    tile = _check_tile(tile)
    interpret = default_interpret() if interpret is None else bool(interpret)
    return _dense_jit(core, jnp.asarray(idx, jnp.int32), int(tile), interpret)


_dense_jit = jax.jit(_dense, static_argnums=(2, 3))


def _reduce_impl(core, idx, mode, qw, kw, tile, interpret):
    plan = make_plan(core, idx, tile)
    if plan.kind == "softmax":
        plan = calls.softmax_stats(plan, interpret)
    return calls.reduce(plan, mode, qw, kw, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _reduce(core, idx, mode, qw, kw, tile, interpret):
    return _reduce_impl(core, idx, mode, qw, kw, tile, interpret)


def _reduce_fwd(core, idx, mode, qw, kw, tile, interpret):
    return _reduce_impl(core, idx, mode, qw, kw, tile, interpret), (core, idx, mode, qw, kw)


def _reduce_bwd(tile, interpret, res, g):
    core, idx, mode, qw, kw = res
    _, vjp = jax.vjp(lambda c, a, b: xla_reduce(c, idx, mode, a, b), core, qw, kw)
    dc, dq, dk = vjp(g)
    return dc, _zero_ct(idx), _zero_ct(mode), dq, dk


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


def pallas_reduce(core, idx, how: str, qw, kw, tile: int | None = None, interpret: bool | None = None):
    """Fused channel reduction ``sum_c qw[b,c,i] f(H_c[b,i,j]) kw[b,c,j]`` (``(B, L, L)``).

    ``f`` is the identity (``how="mean"`` / ``"weighted"``), ``abs`` (``"abs_mean"``) or
    ``max(., 0)`` (``"pos_mean"``); the caller puts ``1/n`` into ``qw`` for the means.
    Loops over channels inside each output tile: ``(B, n, L, L)`` is never written.

    Args:
      core: an operator core with a kernel; idx: ``(n,)`` int channels.
      qw, kw: ``(B, n, L)`` per-channel, per-position query / key weights.
    Returns:
      ``(B, L, L)`` float32.
    """
    check_core(core)
    tile = _check_tile(tile)
    if how not in MODES:
        raise ValueError(f"how must be one of {tuple(MODES)}, got {how!r}")
    interpret = default_interpret() if interpret is None else bool(interpret)
    idx = jnp.asarray(idx, jnp.int32)
    mode = jnp.asarray(MODES[how], jnp.int32)
    return _reduce_jit(core, idx, mode, jnp.asarray(qw, jnp.float32), jnp.asarray(kw, jnp.float32),
                       int(tile), interpret)


_reduce_jit = jax.jit(_reduce, static_argnums=(5, 6))


__all__ = ["pallas_dense", "pallas_reduce", "has_kernel", "check_core", "on_accelerator",
           "default_interpret", "xla_reduce", "DEFAULT_TILE"]
