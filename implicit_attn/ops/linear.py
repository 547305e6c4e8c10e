"""Dense layers in PyTorch's weight layout."""
from __future__ import annotations


def linear(x, w, b=None):
    """``x @ w.T + b`` with PyTorch ``nn.Linear`` weights ``w (out, in)`` and optional ``b (out,)``.
    ``(..., in) -> (..., out)``."""
    y = x @ w.T
    return y if b is None else y + b


__all__ = ["linear"]
