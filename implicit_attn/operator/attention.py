"""AttentionOperator: the explicit softmax attention of an attention layer inside a hybrid
model (RecurrentGemma's local multi-query attention), with the interface of
``ImplicitOperator`` so that both kinds of layer can be analysed the same way.

Channels are heads. ``H[b, h, i, j]`` is the softmax probability with which query ``i``
of head ``h`` reads the value vector at ``j``; ``values`` and ``output`` are per-head
vectors ``(B, heads, L, head_dim)``:

    output[b, h, i] = sum_j H[b, h, i, j] * values[b, h, j] + offset[b, h, i]

``offset`` is zero (the value bias, if any, is already inside ``values``).
"""
from __future__ import annotations

from typing import Any


from ..ops import full_precision
from .base import channel_index, pytree_dataclass, relative_error
from .dispatch import apply_in_blocks
from .html import operator_html
from .implicit import ImplicitOperator


@pytree_dataclass
class AttentionOperator:
    """The operator an attention layer applies, per head.

    ``output == einsum("bhij,bhjd->bhid", materialize(), values) + offset``.

    Attributes:
      values: ``(B, H, L, head_dim)`` the value vectors each head reads.
      offset: ``(B, H, L, head_dim)`` zeros.
      output: ``(B, H, L, head_dim)`` the layer's own per-head attention output (before
        ``o_proj``) from its forward pass.
      core: an ``AttentionCore``.
    """

    values: Any
    offset: Any
    output: Any
    core: Any

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, L, L)`` of the dense probabilities (never allocated by this call)."""
        B, H, L, _ = self.values.shape
        return (B, H, L, L)

    def materialize(self, channels=None, impl: str = "auto", block_channels: int | None = None):
        """Softmax probabilities ``(B, H', L, L)`` float32 of the selected heads
        (None: all, an int, a slice or a list). ``impl`` as for ``ImplicitOperator``."""
        return ImplicitOperator.materialize(self, channels, impl, block_channels)

    def reduce(self, how: str = "mean", weights=None, key_weights=None, channels=None,
               impl: str = "auto", block_channels: int | None = None):
        """Summarise heads into ``(B, L, L)``; same reductions and weight shapes as
        ``ImplicitOperator.reduce`` (weights per head: ``(H',)``, ``(B, H')``, ``(B, H', L)``)."""
        return ImplicitOperator.reduce(self, how, weights, key_weights, channels, impl, block_channels)

    linear_sum = ImplicitOperator.linear_sum  # none: heads are summed in blocks

    @full_precision
    def apply(self, channels=None):
        """``H @ values + offset`` for the selected heads: ``(B, H', L, head_dim)`` (the
        probabilities formed in blocks of heads, as ``ImplicitOperator.apply``)."""
        return apply_in_blocks("bhij,bhjd->bhid", self.core, self.values, self.offset,
                               channel_index(channels, self.values.shape[1]))

    def relative_error(self) -> float:
        """``max |apply() - output| / max |output|`` over all heads: the exactness self-check
        (``base.relative_error``: ``inf`` if either holds NaN/inf where the other does not).
        It measures the operator against the block's own computation in the model's dtype;
        for a bfloat16/float16 model that is that dtype's rounding (~1e-2), not float32's."""
        return relative_error(self.apply(), self.output)

    def _repr_html_(self) -> str:
        """Notebook view: type, core, shape, dtypes and a small log-scale heatmap of
        example 0's head-mean probabilities (``html.operator_html``)."""
        return operator_html(self)


__all__ = ["AttentionOperator"]
