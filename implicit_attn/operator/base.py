"""What every operator core shares: the core interface, pytree dataclasses, channel
selection and the elementwise maps of the reductions.

A *core* holds the factors of a block's operator ``H`` (never the dense array) and
implements ``OperatorCore``: ``num_channels`` and ``dense(idx) -> (B, len(idx), L, L)``,
the full float32 ``H`` of the channels ``idx``. Cores with heads (channels that share one
``(L, L)`` matrix) also give ``num_heads``.
"""
from __future__ import annotations

import abc
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import any_in_batch

# Elements of one block's dense output in ``reduce`` and in blocked ``materialize``.
BLOCK_BUDGET = 1 << 24
REDUCTIONS = ("mean", "abs_mean", "pos_mean", "weighted")
# how -> the elementwise map f of a reduction: 0 identity, 1 abs, 2 positive part.
MODES = {"mean": 0, "weighted": 0, "abs_mean": 1, "pos_mean": 2}


def pytree_dataclass(cls=None, *, static=()):
    """Frozen dataclass registered as a JAX pytree; the fields named in ``static`` are
    metadata (hashed into the treedef, not traced)."""

    def wrap(c):
        c = dataclasses.dataclass(frozen=True)(c)
        names = [f.name for f in dataclasses.fields(c)]
        data = [n for n in names if n not in static]
        return jax.tree_util.register_dataclass(c, data_fields=data, meta_fields=list(static))

    return wrap if cls is None else wrap(cls)


class OperatorCore(abc.ABC):
    """The factors of one block's operator. Subclasses are ``pytree_dataclass``es.

    ``dense(idx)``: ``idx (n,)`` int channel indices (concrete or traced) ->
    ``(B, n, L, L)`` float32 ``H`` of those channels, exact zeros above the diagonal.
    """

    @property
    @abc.abstractmethod
    def num_channels(self) -> int:
        """Number of channels ``C`` of ``H``."""

    @abc.abstractmethod
    def dense(self, idx):
        """``(B, len(idx), L, L)`` float32 operators of channels ``idx``."""

    def heads_to_precompute(self, idx):
        """The heads ``precompute(heads)`` needs for a loop over blocks of the concrete channels ``idx
        (n,)`` (numpy ``(k,)``), or None: every head, or a core without per-head parts (the default)."""
        return None

    def precompute(self, heads=None) -> "OperatorCore":
        """This core with the parts every block of channels shares computed once (a blocked
        ``materialize`` / ``reduce`` calls it before its loop); by default itself. ``heads``: the
        ``heads_to_precompute`` of the loop's channels (only their parts are computed), or None."""
        return self

    def named_factors(self) -> dict:
        """The data-dependent factors a researcher looks at, by role: ``"gate"`` (the
        output gate, per channel ``(B, C, L)``) and ``"log_decay"`` (the per-step log decay;
        its shape is the core's, see the subclass). Cores without one omit the key."""
        return {}


def sparse_product(spec: str, H, v):
    """``einsum(spec, H, v)`` where an exact zero of ``H`` times a NaN of ``v`` counts as 0 (as
    in the blocks: a NaN value at ``t`` never reaches the rows whose ``H`` is 0 at ``t``, those
    before ``t`` above all); a nonzero entry on a NaN value still gives NaN.

    ``spec``: ``"bcij,bcj->bci"`` (channels) or ``"bhij,bhjd->bhid"`` (heads).
    """
    nan = jnp.isnan(v)
    out = jnp.einsum(spec, H, jnp.where(nan, 0.0, v))

    def with_reach(out):
        reach = jnp.einsum(spec, (H != 0).astype(H.dtype), nan.astype(H.dtype))
        return jnp.where(reach > 0, jnp.nan, out)

    # The reach pass reads H again (and forms H != 0): only values holding a NaN need it (under
    # vmap, any example's: the pass leaves rows without a NaN in reach as they are).
    if isinstance(nan, jax.core.Tracer):
        return jax.lax.cond(any_in_batch(nan.any()), with_reach, lambda o: o, out)
    return with_reach(out) if bool(nan.any()) else out


@functools.partial(jax.jit, static_argnames="spec")
def applied_block(spec: str, H, values, offset, sel):
    """``sparse_product(spec, H, values[:, sel]) + offset[:, sel]`` as one compiled program
    (run eagerly, each of its operations compiles apart for every new shape).

    Args:
      spec: as ``sparse_product``; H: the block's dense operator; values, offset: the
      operator's (all channels or heads on axis 1); sel: ``(n,)`` int, the block's channels.
    """
    v = jnp.take(values, sel, axis=1).astype(jnp.float32)
    return sparse_product(spec, H, v) + jnp.take(offset, sel, axis=1)


def relative_error(applied, output) -> float:
    """The exactness self-check ``max |applied - output| / max |output|`` (float64, host).

    Non-finite entries are compared, not skipped (``jnp.max`` over an array holding NaN is
    not NaN on every backend): an entry that is NaN or inf in one array but not the same in
    the other makes the error ``inf``. Entries that are NaN in both (a NaN input reaches both
    the operator and the block the same way) are left out of the maximum; if nothing finite
    remains, the result is NaN (nothing was compared).

    Args:
      applied: ``H @ values + offset``; output: the block's own output; same shape.
    """
    a = np.asarray(applied, np.float64)
    o = np.asarray(output, np.float64)
    fa, fo = np.isfinite(a), np.isfinite(o)
    same_nonfinite = ~fa & ~fo & ((np.isnan(a) & np.isnan(o)) | (a == o))
    if ((fa != fo) | (~fa & ~fo & ~same_nonfinite)).any():
        return float("inf")
    if not fa.any():
        return float("nan")
    return float(np.max(np.abs(a[fa] - o[fa])) / max(float(np.max(np.abs(o[fa]))), 1e-30))


def take(x, idx, axis=1):
    """``jnp.take`` that passes None through (optional factors)."""
    return None if x is None else jnp.take(x, idx, axis=axis)


def channel_index(channels, C: int):
    """Normalise a channel selection to an int array (or pass a tracer through).

    Args:
      channels: None (all), an int, a slice, or a 1-D sequence of ints (negatives count
        from the end).
      C: number of channels.
    Returns:
      ``(n,)`` numpy int array in ``[0, C)`` (or the tracer unchanged).
    Raises:
      ValueError naming the problem (empty, out of range, not integers).
    """
    if channels is None:
        return np.arange(C)
    if isinstance(channels, slice):
        try:
            idx = np.arange(C)[channels]
        except (TypeError, ValueError) as e:
            raise ValueError(f"channels {channels!r} is not a valid slice ({e})") from None
        if idx.size == 0:
            raise ValueError(f"channels {channels!r} selects no channel of an operator with {C} channels")
        return idx
    if isinstance(channels, (bool, np.bool_)):
        raise ValueError(f"channels must be an int, a slice or a 1-D list of ints, got {channels!r}")
    if isinstance(channels, (int, np.integer)):
        channels = [channels]
    if isinstance(channels, jax.core.Tracer):
        return channels
    try:
        idx = np.asarray(channels)
    except (TypeError, ValueError):  # ragged nesting
        idx = np.asarray(None, dtype=object)
    if idx.size == 0 and idx.ndim == 1:
        raise ValueError(f"channels is empty ({channels!r}): select at least one channel")
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"channels must be an int, a slice or a 1-D list of ints, got {channels!r}")
    if idx.min() < -C or idx.max() >= C:
        raise ValueError(f"channels out of range for an operator with {C} channels: {idx.tolist()}")
    return idx % C


def block_size(n: int, B: int, L: int, block_channels: int | None) -> int:
    """Channels per step of a blocked materialize/reduce: ``block_channels`` or as many as
    keep one block's ``(B, block, L, L)`` under ``BLOCK_BUDGET`` elements."""
    if block_channels is not None:
        if isinstance(block_channels, bool) or not isinstance(block_channels, (int, np.integer)):
            raise TypeError(f"block_channels must be an int or None, got {block_channels!r}")
        if block_channels < 1:
            raise ValueError(f"block_channels must be >= 1, got {block_channels}")
        return min(block_channels, n)
    return max(1, min(n, BLOCK_BUDGET // max(1, B * L * L)))


def channel_weights(w, name: str, B: int, C: int, L: int):
    """Broadcast ``(C,)``, ``(B, C)`` or ``(B, C, L)`` real floating or boolean weights to
    ``(B, C, L)`` float32 (the precision every reduction computes in). Integer weights are a
    ``TypeError``: float32 holds them exactly only up to 2**24, so the caller casts them."""
    dtype = w.dtype if hasattr(w, "dtype") else np.asarray(w).dtype  # as given, before jax's int64 -> int32
    if dtype != np.bool_ and not jnp.issubdtype(dtype, jnp.floating):
        hint = f" (cast them: {name}.astype(float))" if jnp.issubdtype(dtype, jnp.integer) else ""
        raise TypeError(f"{name} must be real floating or boolean, got dtype {dtype}{hint}")
    w = jnp.asarray(w, jnp.float32)
    if w.shape == (C,):
        w = w[None, :, None]
    elif w.shape == (B, C):
        w = w[:, :, None]
    elif w.shape != (B, C, L):
        raise ValueError(f"{name} must have shape (C,), (B, C) or (B, C, L) = "
                         f"({C},), ({B}, {C}) or ({B}, {C}, {L}); got {w.shape}")
    return jnp.broadcast_to(w, (B, C, L))


def apply_mode(H, mode):
    """The elementwise map of a reduction: identity (0), ``|H|`` (1) or ``max(H, 0)`` (2).
    ``mode`` may be traced, so one compiled kernel serves every reduction."""
    return jnp.where(mode == 1, jnp.abs(H), jnp.where(mode == 2, jnp.maximum(H, 0.0), H))


def diag_embed(d):
    """``(..., L) -> (..., L, L)`` diagonal matrices."""
    L = d.shape[-1]
    return d[..., :, None] * jnp.eye(L, dtype=d.dtype)


__all__ = ["OperatorCore", "pytree_dataclass", "take", "sparse_product", "applied_block", "channel_index", "block_size", "channel_weights",
           "apply_mode", "diag_embed", "BLOCK_BUDGET", "REDUCTIONS", "MODES"]
