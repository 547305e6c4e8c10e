"""Float64 references of Jamba's mixers (for tests): the Mamba formula of ``mamba.naive``
(with the weighted dt/B/C norms) and the softmax attention formula of ``griffin.naive``
(full window, no RoPE), dispatched per layer as for Bamba."""
from __future__ import annotations

from ..bamba.naive import hybrid_naive_operator
from ..mamba.naive import naive_operator as mamba_operator


def naive_operator(p: dict, x, cfg, layer: int = 0):
    """Float64 ``H`` of layer ``layer``'s mixer (``variant="full"``) for its params ``p`` and
    input ``x (B, L, d_model)``: ``(B, C, L, L)`` (Mamba) or ``(B, heads, L, L)`` (attention)."""
    return hybrid_naive_operator(p, x, cfg, layer, mamba_operator)


__all__ = ["naive_operator"]
