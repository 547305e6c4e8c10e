"""Causal depthwise convolution: as an op, as its banded matrix, and applied on
the right of an operator without forming the matrix.

Weights follow PyTorch's ``Conv1d(groups=C, padding=K-1)`` truncated to L:
``out[t, c] = sum_k w[c, k] * x[t - (K-1) + k, c] + b[c]``.
"""
from __future__ import annotations

import jax.numpy as jnp


def causal_conv(x, w, b=None):
    """Causal depthwise conv.

    Args:
      x: ``(B, L, C)`` inputs.
      w: ``(C, K)`` filters (``conv1d.weight[:, 0, :]`` of PyTorch).
      b: optional ``(C,)`` bias.
    Returns:
      ``(B, L, C)``, same dtype promotion as ``x * w``.
    """
    K = w.shape[-1]
    L = x.shape[1]
    xp = jnp.pad(x, ((0, 0), (K - 1, 0), (0, 0)))
    out = sum(xp[:, k:k + L, :] * w[:, k] for k in range(K))
    if b is not None:
        out = out + b
    return out


def conv_matrix(w, L: int):
    """Banded causal conv matrices.

    Args:
      w: ``(C, K)`` filters.
      L: sequence length.
    Returns:
      ``(C, L, L)`` with ``M[c, i, j] = w[c, K-1-(i-j)]`` for ``0 <= i-j <= K-1``,
      else 0, so that ``causal_conv(x, w)[:, :, c] == M[c] @ x[:, :, c]``.
    """
    K = w.shape[-1]
    d = jnp.arange(L)[:, None] - jnp.arange(L)[None, :]  # i - j
    inband = (d >= 0) & (d <= K - 1)
    idx = jnp.clip(K - 1 - d, 0, K - 1)
    return jnp.where(inband, w[:, idx], 0.0)


def conv_right(H, w):
    """Right-multiply operators by their channel's conv matrix: ``H @ M``.

    ``(H M)[i, j] = sum_{s=0..K-1} H[i, j+s] * w[K-1-s]`` (terms with
    ``j+s >= L`` vanish), so no ``(L, L)`` conv matrix is formed.

    Args:
      H: ``(B, C, L, L)``.
      w: ``(C, K)``.
    Returns:
      ``(B, C, L, L)``.
    """
    K = w.shape[-1]
    L = H.shape[-1]
    Hp = jnp.pad(H, [(0, 0)] * (H.ndim - 1) + [(0, K - 1)])
    wk = w[None, :, None, :]  # (1, C, 1, K)
    return sum(Hp[..., s:s + L] * wk[..., K - 1 - s:K - s] for s in range(K))
