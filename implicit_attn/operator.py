"""ImplicitOperator: the per-channel linear operator ``H(x)`` a token-mixing block applies.

An operator holds the block's factors (a *core*), never the dense ``(B, C, L, L)``
array. ``materialize`` builds dense matrices for a set of channels; ``reduce``
summarises all channels into ``(B, L, L)`` by accumulating over blocks of channels,
so it fits at lengths where the dense array cannot exist.

A core is any pytree with ``num_channels`` and ``dense(idx) -> (B, len(idx), L, L)``
(the full ``H`` of the channels ``idx``, float32). The generic cores below cover the
recurrent families; a family with a different shape (RWKV's row softmax) adds its own.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .ops import conv_right, scalar_decay_kernel, state_decay_kernel

# Elements of one block's dense output in ``reduce`` and in blocked ``materialize``.
_BLOCK_BUDGET = 1 << 24
_IMPLS = ("auto", "xla", "pallas", "cpu")
_REDUCTIONS = ("mean", "abs_mean", "pos_mean", "weighted")


def _dataclass_pytree(cls=None, *, static=()):
    """Frozen dataclass registered as a pytree; ``static`` names are metadata."""

    def wrap(c):
        c = dataclasses.dataclass(frozen=True)(c)
        names = [f.name for f in dataclasses.fields(c)]
        data = [n for n in names if n not in static]
        return jax.tree_util.register_dataclass(c, data_fields=data, meta_fields=list(static))

    return wrap if cls is None else wrap(cls)


def _take(x, idx, axis=1):
    return None if x is None else jnp.take(x, idx, axis=axis)


def _diag_embed(d):
    """``(..., L) -> (..., L, L)`` diagonal matrices."""
    L = d.shape[-1]
    return d[..., :, None] * jnp.eye(L, dtype=d.dtype)


def _sandwich(K, left, right, diag, conv_w):
    """``(diag(left) K diag(right) + diag(diag)) M`` for a block of channels."""
    H = K
    if left is not None:
        H = left[..., :, None] * H
    if right is not None:
        H = H * right[..., None, :]
    if diag is not None:
        H = H + _diag_embed(diag)
    if conv_w is not None:
        H = conv_right(H, conv_w)
    return H


@_dataclass_pytree(static=("chunk",))
class StateDecayCore:
    """``H_c = (diag(left_c) K_c diag(right_c) + diag(diag_c)) M_c`` with
    ``K_c = state_decay_kernel(q, k, A_c, dt_c)`` (Mamba-1's S6 with its wrappers).

    Shapes: ``q, k (B, L, N)``, ``A (C, N)``, ``dt, left, right, diag (B, C, L)``
    (each of ``left, right, diag`` may be None), ``conv_w (C, K)`` or None.
    """

    q: Any
    k: Any
    A: Any
    dt: Any
    left: Any = None
    right: Any = None
    diag: Any = None
    conv_w: Any = None
    chunk: int = 16

    @property
    def num_channels(self) -> int:
        return self.A.shape[0]

    def dense(self, idx):
        H = state_decay_kernel(self.q, self.k, self.A[idx], _take(self.dt, idx), self.chunk,
                               _take(self.left, idx), _take(self.right, idx), _take(self.diag, idx))
        return H if self.conv_w is None else conv_right(H, _take(self.conv_w, idx, 0))


@_dataclass_pytree
class ScalarDecayCore:
    """``H_c = (diag(left_c) K_g(c) diag(right_c) + diag(diag_c)) M_c`` with one decay
    per group ``g`` (a Mamba-2 head; a Griffin channel is its own group) and
    ``K_g = scalar_decay_kernel(log_a_g, q_g, k_g)``.

    Shapes: ``log_a (B, G, L)``, ``q, k (B, G, L, N)`` or None (rank one),
    ``group (C,)`` int channel -> group, ``left, right, diag (B, C, L)`` or None,
    ``conv_w (C, K)`` or None.
    """

    log_a: Any
    group: Any
    q: Any = None
    k: Any = None
    left: Any = None
    right: Any = None
    diag: Any = None
    conv_w: Any = None

    @property
    def num_channels(self) -> int:
        return self.group.shape[0]

    def dense(self, idx):
        g = self.group[idx]
        K = scalar_decay_kernel(_take(self.log_a, g), _take(self.q, g), _take(self.k, g))
        return _sandwich(K, _take(self.left, idx), _take(self.right, idx),
                         _take(self.diag, idx), _take(self.conv_w, idx, 0))


def _check_impl(impl: str, core=None) -> str:
    """Resolve ``impl``.

    "auto" is "pallas" on GPU/TPU for cores with a Pallas kernel, "cpu" on the CPU
    backend for cores with a fused CPU kernel (when it builds here), else "xla".
    "pallas" / "cpu" for a core without that kernel raise ``TypeError`` naming the core;
    "cpu" where the kernel cannot be built raises ``CpuKernelUnavailable``."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "xla":
        return "xla"
    from . import kernels  # lazily: kernels import the family cores, which import this module
    from .kernels import cpu

    if impl == "pallas":
        if core is not None:
            kernels.check_core(core)
        return "pallas"
    if impl == "cpu":
        if jax.default_backend() != "cpu":
            raise ValueError(f"impl='cpu' runs on JAX's CPU backend; the default backend is "
                             f"{jax.default_backend()!r} (use 'auto' or 'pallas' there)")
        if core is not None:
            cpu.check_core(core)
        cpu.load()
        return "cpu"
    if core is None:
        return "xla"
    if kernels.on_accelerator():
        return "pallas" if kernels.has_kernel(core) else "xla"
    if jax.default_backend() == "cpu" and cpu.has_kernel(core) and cpu.available():
        return "cpu"
    return "xla"


def _dense_fn(core, impl: str):
    """``idx -> (B, len(idx), L, L)`` for the resolved ``impl``."""
    if impl == "pallas":
        from . import kernels

        return lambda idx: kernels.pallas_dense(core, idx)
    if impl == "cpu":
        from .kernels.cpu import cpu_dense

        return lambda idx: cpu_dense(core, idx)
    return core.dense


def _channel_index(channels, C: int):
    if channels is None:
        return np.arange(C)
    if isinstance(channels, slice):
        return np.arange(C)[channels]
    if isinstance(channels, (int, np.integer)):
        channels = [channels]
    if isinstance(channels, jax.core.Tracer):
        return channels
    idx = np.asarray(channels)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"channels must be an int, a slice or a 1-D list of ints, got {channels!r}")
    if idx.size == 0:
        raise ValueError("channels is empty")
    if idx.min() < -C or idx.max() >= C:
        raise ValueError(f"channels out of range for an operator with {C} channels: {idx.tolist()}")
    return idx % C


def _block_size(n: int, B: int, L: int, block_channels: int | None) -> int:
    if block_channels is not None:
        if block_channels < 1:
            raise ValueError(f"block_channels must be >= 1, got {block_channels}")
        return min(block_channels, n)
    return max(1, min(n, _BLOCK_BUDGET // max(1, B * L * L)))


def _channel_weights(w, name: str, B: int, C: int, L: int):
    """Broadcast ``(C,)``, ``(B, C)`` or ``(B, C, L)`` weights to ``(B, C, L)``."""
    w = jnp.asarray(w, jnp.float32)
    if w.shape == (C,):
        w = w[None, :, None]
    elif w.shape == (B, C):
        w = w[:, :, None]
    elif w.shape != (B, C, L):
        raise ValueError(f"{name} must have shape (C,), (B, C) or (B, C, L) = "
                         f"({C},), ({B}, {C}) or ({B}, {C}, {L}); got {w.shape}")
    return jnp.broadcast_to(w, (B, C, L))


def _materialize_blocks(core, idx, bc: int, impl: str, B: int, L: int):
    """``(B, n, L, L)`` for channels ``idx (n,)``, ``bc`` channels per step."""
    dense = _dense_fn(core, impl)
    n = idx.shape[0]
    idx = jnp.asarray(idx)
    if bc >= n or impl == "cpu":  # the CPU kernel's scratch is O(L N) per thread
        return dense(idx)
    nb = -(-n // bc)
    # The last block is shifted back to end at n (it recomputes a few channels)
    # so every block is full and is written in place.
    starts = jnp.minimum(jnp.arange(nb) * bc, n - bc)

    def body(k, out):
        s = starts[k]
        block = dense(jax.lax.dynamic_slice_in_dim(idx, s, bc))
        return jax.lax.dynamic_update_slice_in_dim(out, block, s, axis=1)

    return jax.lax.fori_loop(0, nb, body, jnp.zeros((B, n, L, L), jnp.float32))


# Compiled once per (core structure, channels, block size, impl): eager calls reuse it.
_materialize_jit = jax.jit(
    lambda core, idx, bc, impl, B, L: _materialize_blocks(core, np.asarray(idx), bc, impl, B, L),
    static_argnums=(1, 2, 3, 4, 5))


def _reduce_blocks(core, idx, qw, kw, how: str, bc: int):
    """``sum_c qw[b,c,i] f(H[b,c,i,j]) kw[b,c,j]`` over ``idx`` in blocks of ``bc`` channels."""
    B, n, L = qw.shape
    nb = -(-n // bc)
    pad = nb * bc - n
    # Padded channels carry zero weight, so they add nothing.
    idx_b = jnp.pad(idx, (0, pad)).reshape(nb, bc)
    qw_b = jnp.moveaxis(jnp.pad(qw, ((0, 0), (0, pad), (0, 0))).reshape(B, nb, bc, L), 1, 0)
    kw_b = jnp.moveaxis(jnp.pad(kw, ((0, 0), (0, pad), (0, 0))).reshape(B, nb, bc, L), 1, 0)

    def body(acc, xs):
        ib, qb, kb = xs
        H = core.dense(ib)
        if how == "abs_mean":
            H = jnp.abs(H)
        elif how == "pos_mean":
            H = jnp.maximum(H, 0.0)
        # A fused multiply-and-sum: the 3-operand einsum lowers to a transposing
        # dot_general that costs ~10x more CPU here.
        return acc + jnp.sum(H * qb[..., :, None] * kb[..., None, :], axis=1), None

    acc0 = jnp.zeros((B, L, L), jnp.float32)
    out, _ = jax.lax.scan(jax.checkpoint(body), acc0, (idx_b, qw_b, kw_b))
    return out


_reduce_jit = jax.jit(_reduce_blocks, static_argnums=(4, 5))


@_dataclass_pytree
class ImplicitOperator:
    """The operator a token-mixing block applies, per channel.

    ``output == einsum("bcij,bcj->bci", materialize(), values) + offset`` (for the
    block's ``variant="full"``).

    Attributes:
      values: ``(B, C, L)`` the vectors ``H`` acts on.
      offset: ``(B, C, L)`` the affine part (conv bias through the block), zeros if none.
      output: ``(B, C, L)`` the block's own token-mixing output from its scan forward.
      core: the factors of ``H`` (see module docstring).
    """

    values: Any
    offset: Any
    output: Any
    core: Any

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, C, L, L)`` of the dense operator (never allocated by this call)."""
        B, C, L = self.values.shape
        return (B, C, L, L)

    def materialize(self, channels=None, impl: str = "auto", block_channels: int | None = None):
        """Dense operator matrices.

        Args:
          channels: None (all), an int, a slice or a list of channel indices.
          impl: "auto" | "xla" | "pallas" | "cpu" (see ``_check_impl``).
          block_channels: channels computed per step (bounds intermediate memory; the
            "cpu" kernel writes the output directly and needs no blocks).
        Returns:
          ``(B, C', L, L)`` float32, ``H[b, c, i, j]`` = weight of value ``j`` in output ``i``.
        """
        impl = _check_impl(impl, self.core)
        B, C, L, _ = self.shape
        idx = _channel_index(channels, C)
        bc = _block_size(idx.shape[0], B, L, block_channels)
        if isinstance(idx, jax.core.Tracer):
            return _materialize_blocks(self.core, idx, bc, impl, B, L)
        return _materialize_jit(self.core, tuple(int(i) for i in idx), bc, impl, B, L)

    def reduce(self, how: str = "mean", weights=None, key_weights=None, channels=None,
               impl: str = "auto", block_channels: int | None = None):
        """Summarise all (or the selected) channels into one ``(B, L, L)`` map.

        ``"mean"``: mean of H over channels; ``"abs_mean"``: mean of ``|H|``;
        ``"pos_mean"``: mean of ``max(H, 0)``; ``"weighted"``:
        ``sum_c weights[b,c,i] * H[b,c,i,j] * key_weights[b,c,j]``
        (``weights`` required, ``key_weights`` optional; each ``(C',)``, ``(B, C')``
        or ``(B, C', L)`` over the selected channels).

        Works in blocks of channels (``lax.scan`` with rematerialisation), so memory is
        ``O(B L^2 * block)`` in the forward and backward pass. ``impl``: "xla" forms each
        block with jnp; "pallas" and "cpu" fuse the whole reduction and write only the
        output (``block_channels`` is then unused; their gradients go through the XLA
        path); "auto" picks as ``materialize`` does.
        Returns:
          ``(B, L, L)`` float32.
        """
        impl = _check_impl(impl, self.core)
        if how not in _REDUCTIONS:
            raise ValueError(f"how must be one of {_REDUCTIONS}, got {how!r}")
        if how == "weighted" and weights is None:
            raise ValueError("how='weighted' needs weights of shape (C,), (B, C) or (B, C, L)")
        if how != "weighted" and (weights is not None or key_weights is not None):
            raise ValueError(f"weights are only used with how='weighted', not how={how!r}")
        B, C, L, _ = self.shape
        idx = jnp.asarray(_channel_index(channels, C))
        n = idx.shape[0]
        if how == "weighted":
            qw = _channel_weights(weights, "weights", B, n, L)
            kw = (jnp.ones((B, n, L), jnp.float32) if key_weights is None
                  else _channel_weights(key_weights, "key_weights", B, n, L))
        else:
            qw = jnp.full((B, n, L), 1.0 / n, jnp.float32)
            kw = jnp.ones((B, n, L), jnp.float32)
        if impl == "pallas":
            from . import kernels

            # One fused kernel over all selected channels: only (B, L, L) is written.
            return kernels.pallas_reduce(self.core, idx, how, qw, kw)
        if impl == "cpu":
            from .kernels.cpu import cpu_reduce

            return cpu_reduce(self.core, idx, how, qw, kw)
        return _reduce_jit(self.core, idx, qw, kw, how, _block_size(n, B, L, block_channels))

    def apply(self, channels=None):
        """``H @ values + offset`` for the selected channels: ``(B, C', L)``.

        Equals ``output`` for an exact (``variant="full"``) operator.
        """
        idx = _channel_index(channels, self.values.shape[1])
        H = self.materialize(idx)
        v = jnp.take(self.values, jnp.asarray(idx), axis=1).astype(jnp.float32)
        return jnp.einsum("bcij,bcj->bci", H, v) + jnp.take(self.offset, jnp.asarray(idx), axis=1)

    def relative_error(self) -> float:
        """``max |apply() - output| / max |output|`` over all channels (a self-check)."""
        err = jnp.max(jnp.abs(self.apply() - self.output))
        return float(err / jnp.maximum(jnp.max(jnp.abs(self.output)), 1e-30))


__all__ = ["ImplicitOperator", "StateDecayCore", "ScalarDecayCore"]
