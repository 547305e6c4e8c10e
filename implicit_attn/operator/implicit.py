"""ImplicitOperator: the per-channel linear operator ``H(x)`` a token-mixing block applies.

An operator holds the block's factors (a core, see ``cores``), never the dense
``(B, C, L, L)`` array. ``materialize`` builds dense matrices for a set of channels;
``reduce`` summarises all channels into ``(B, L, L)`` by accumulating over blocks of
channels (or in one fused kernel), so it fits at lengths where the dense array cannot.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import full_precision
from .base import REDUCTIONS, block_size, channel_index, channel_weights, pytree_dataclass, relative_error
from .cores import heads_weighted_sum
from .dispatch import (apply_in_blocks, backend, blocked_reduce_jit, channel_key, materialize_blocks,
                       materialize_jit, resolve_impl, with_fallback)
from .html import operator_html

HEAD_MATRICES = ("alpha", "mean")
# Reductions linear in H (MODES' identity): a core with heads sums them through the head matrices.
LINEAR = ("mean", "weighted")
heads_weighted_sum_jit = jax.jit(full_precision(heads_weighted_sum))


@pytree_dataclass
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
          impl: "auto" | "xla" | "pallas" | "cpu" (see ``dispatch.resolve_impl``).
          block_channels: channels computed per step (bounds intermediate memory; the
            "cpu" kernel writes the output directly and needs no blocks).
        Returns:
          ``(B, C', L, L)`` float32, ``H[b, c, i, j]`` = weight of value ``j`` in output ``i``.
        """
        requested, impl = impl, resolve_impl(impl, self.core)
        B, C, L, _ = self.shape
        idx = channel_index(channels, C)
        bc = block_size(idx.shape[0], B, L, block_channels)
        if isinstance(idx, jax.core.Tracer):
            return with_fallback(requested, impl, self.core,
                                 lambda: materialize_blocks(self.core, idx, bc, impl, B, L),
                                 lambda: materialize_blocks(self.core, idx, bc, "xla", B, L))
        key = channel_key(idx)
        return with_fallback(requested, impl, self.core,
                             lambda: materialize_jit(self.core, key, bc, impl, B, L),
                             lambda: materialize_jit(self.core, key, bc, "xla", B, L))

    def head_matrices(self, how: str = "alpha", heads=None):
        """Per-head matrices exist for operators whose channels share a head matrix
        (Mamba-2, ``Mamba2Operator``); this operator's channels each have their own ``H``."""
        raise TypeError(f"head_matrices needs a Mamba-2 operator (heads share one matrix); this operator's "
                        f"core is {type(self.core).__name__}: use materialize(channels) or reduce(how)")

    def reduce(self, how: str = "mean", weights=None, key_weights=None, channels=None,
               impl: str = "auto", block_channels: int | None = None):
        """Summarise all (or the selected) channels into one ``(B, L, L)`` map.

        ``"mean"``: mean of H over channels; ``"abs_mean"``: mean of ``|H|``;
        ``"pos_mean"``: mean of ``max(H, 0)``; ``"weighted"``:
        ``sum_c weights[b,c,i] * H[b,c,i,j] * key_weights[b,c,j]``
        (``weights`` required, ``key_weights`` optional; each ``(C',)``, ``(B, C')``
        or ``(B, C', L)`` over the selected channels, real floating or boolean: integer
        weights are a ``TypeError``, as float32 holds them exactly only up to 2**24).

        Works in blocks of channels (``lax.scan`` with rematerialisation), so memory is
        ``O(B L^2 * block)`` in the forward and backward pass. ``impl``: "xla" forms each
        block with jnp; "pallas" and "cpu" fuse the whole reduction and write only the
        output (``block_channels`` is then unused; their gradients go through the XLA
        path); "auto" picks as ``materialize`` does.
        Returns:
          ``(B, L, L)`` float32.
        """
        requested, impl = impl, resolve_impl(impl, self.core)
        if how not in REDUCTIONS:
            raise ValueError(f"how must be one of {REDUCTIONS}, got {how!r}")
        if how == "weighted" and weights is None:
            raise ValueError("how='weighted' needs weights of shape (C,), (B, C) or (B, C, L)")
        if how != "weighted" and (weights is not None or key_weights is not None):
            raise ValueError(f"weights are only used with how='weighted', not how={how!r}")
        B, C, L, _ = self.shape
        chosen = channel_index(channels, C)
        idx = jnp.asarray(chosen)
        n = idx.shape[0]
        if how == "weighted":
            qw = channel_weights(weights, "weights", B, n, L)
            kw = (jnp.ones((B, n, L), jnp.float32) if key_weights is None
                  else channel_weights(key_weights, "key_weights", B, n, L))
        else:
            qw = jnp.full((B, n, L), 1.0 / n, jnp.float32)
            kw = jnp.ones((B, n, L), jnp.float32)
        bc = block_size(n, B, L, block_channels)
        # Concrete channels: only their heads' matrices are formed before the loop (one compilation
        # per number of heads, the heads traced).
        heads = None if isinstance(chosen, jax.core.Tracer) else self.core.heads_to_precompute(chosen)
        xla = lambda: blocked_reduce_jit(self.core, idx, qw, kw, how, bc, None, heads)
        if impl == "xla":
            if how in LINEAR and not isinstance(chosen, jax.core.Tracer) and len(set(chosen.tolist())) == n:
                fused = self.linear_sum(chosen, qw, kw)
                if fused is not None:
                    return fused
            return xla()
        # One fused kernel over all selected channels: only (B, L, L) is written. Concrete channels
        # go in as numpy, so a head kernel forms only their heads' matrices.
        return with_fallback(requested, impl, self.core,
                             lambda: backend(impl).reduce(self.core, chosen, how, qw, kw), xla)

    def linear_sum(self, idx, qw, kw):
        """``sum_c qw[b,c,i] H_c[b,i,j] kw[b,c,j]`` over the distinct channels ``idx (n,)`` (numpy)
        by a route faster than blocks of channels, or None where there is none (here: none;
        ``Mamba2Operator`` sums each head's channels through the head's matrix)."""
        return None

    @full_precision
    def apply(self, channels=None):
        """``H @ values + offset`` for the selected channels: ``(B, C', L)``.

        Equals ``output`` for an exact (``variant="full"``) operator. The dense ``H`` is
        formed as ``materialize(impl="auto")`` forms it, in blocks of channels of at most
        ``APPLY_BUDGET`` elements, in one compiled program (``dispatch.apply_in_blocks``).
        """
        return apply_in_blocks("bcij,bcj->bci", self.core, self.values, self.offset,
                               channel_index(channels, self.shape[1]))

    def relative_error(self) -> float:
        """``max |apply() - output| / max |output|`` over all channels: the exactness self-check
        (``base.relative_error``: ``inf`` if either holds NaN/inf where the other does not).
        It measures the operator against the block's own computation in the model's dtype;
        for a bfloat16/float16 model that is that dtype's rounding (~1e-2), not float32's."""
        return relative_error(self.apply(), self.output)

    def _repr_html_(self) -> str:
        """Notebook view: type, core, shape, dtypes and a small log-scale heatmap of
        example 0's channel-mean ``|H|`` (``html.operator_html``; skipped for huge operators)."""
        return operator_html(self)


@pytree_dataclass
class Mamba2Operator(ImplicitOperator):
    """``ImplicitOperator`` of a core whose channels form heads sharing one matrix
    (``Mamba2Core``, ``DeltaRuleCore``), with per-head matrices (channels ``h*P .. h*P+P-1``
    form head ``h``)."""

    @full_precision
    def head_matrices(self, how: str = "alpha", heads=None):
        """Per-head ``(B, H', L, L)`` float32 matrices, computed once per head.

        ``how="alpha"``: ``alpha_h = (C B^T) * exp(A_h T_h) diag(Delta_h) + D_h I`` (the SSD
        "effective attention" of head h; for ``"s6_only"`` without D); for a delta-rule core
        the head's ``M_h``.
        ``how="mean"``: the mean of ``H_c`` over the head's channels, everything folded in
        (norm, gate, activation, conv), equal to ``materialize()`` averaged per head.
        ``heads``: None (all), an int or a list of head indices.
        """
        if how not in HEAD_MATRICES:
            raise ValueError(f"how must be one of {HEAD_MATRICES}, got {how!r}")
        core = self.core
        H = core.num_heads
        if heads is None:
            hs = jnp.arange(H)
        else:
            hl = [heads] if isinstance(heads, (int, np.integer)) else list(heads)
            if not hl or any(not isinstance(h, (int, np.integer)) or not -H <= h < H for h in hl):
                raise ValueError(f"heads must be ints in [-{H}, {H}), got {heads!r}")
            hs = jnp.asarray([int(h) % H for h in hl])
        if how == "alpha":
            return core.alpha(hs)
        return jnp.moveaxis(jax.lax.map(core.head_mean, hs), 0, 1)

    def linear_sum(self, idx, qw, kw):
        """``reduce("mean" | "weighted")`` through the heads (``cores.heads_weighted_sum``): the
        weights go to their channels' slots (zero elsewhere), then each head's channels are
        summed with one rank-``P`` matmul per conv tap against the head's matrix, computed once
        for each head holding a selected channel; no ``H_c`` is formed. ``idx (n,)`` distinct numpy
        channels, ``qw, kw (B, n, L)``."""
        B, C, L, _ = self.shape
        place = lambda w: jnp.zeros((B, C, L), jnp.float32).at[:, idx].set(w)
        heads = np.unique(np.asarray(idx) // (C // self.core.num_heads)).astype(np.int32)
        return heads_weighted_sum_jit(self.core, place(qw), place(kw), jnp.asarray(heads))


__all__ = ["ImplicitOperator", "Mamba2Operator", "HEAD_MATRICES"]
