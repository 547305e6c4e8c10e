"""LaS attention (Zimerman & Wolf, "Viewing Transformers Through the Lens of Long
Convolutions Layers", Eq. 4) and its ablations, as pure functions. One head ``c``:

    LaS_c(Q, K, V) = AP( SF( exp(-alpha_c D_L) * (Q K^T / sqrt(d_k)) ) ) V

* ``D_L[i, j] = i - j`` for ``j <= i`` and 0 above the diagonal ("the distance matrix
  multiplied by the causality mask"); the ELD matrix ``exp(-alpha_c D_L)`` **multiplies** the
  scaled scores elementwise (it is not an additive bias); keys ``j > i`` are then masked
  (``-inf``) before the softmax ``SF``.
* ``alpha_c`` is fixed per head (``las_alphas``); ALiBi (Press et al.) instead **adds**
  ``-m_h D_L`` to the scaled scores (``alibi_slopes``).
* ``AP``: 1-D average pooling of each row (over keys), window ``P`` (odd), stride 1, zero
  padding counted in the mean (divide by ``P``), so the shape stays ``(L, L)``. The window
  of key ``j`` is ``[j, j + P - 1]`` (``align="causal"``, the default: the ``P - 1`` padding
  zeros sit after the last key, and the pooled matrix is ``A M`` with ``M`` the causal
  moving-average matrix, so no mass moves onto future keys) or ``[j - r, j + r]``,
  ``r = P // 2`` (``align="centered"``, PyTorch's ``AvgPool1d(P, 1, P // 2)``), after which the
  entries above the diagonal are set to 0. Either way the result is masked to ``j <= i`` and
  to the query's block.
* ``chunk``: LaS-chunk, attention within fixed blocks ``[m * chunk, (m + 1) * chunk)``;
  softmax and pooling never cross a block boundary.

Everything is float32, masked with exact zeros, and the row max is shifted out by the
softmax (no overflow).
"""
from __future__ import annotations

import functools

import math

import jax
import jax.numpy as jnp
import numpy as np

f32 = jnp.float32
POOL_ALIGNS = ("causal", "centered")


def las_alphas(num_heads: int, B: float) -> np.ndarray:
    """The per-head decay rates ``alpha_c`` set by the hyper-parameter ``B`` (float64).

    The paper (Sec. 4.1, "Initialization of alpha_c"): "we set alpha_0 = 0 in the first
    attention head ... which results in a vanilla attention head", "a sequence of evenly
    spaced alpha_c values in exponential space", "alpha_c exponential-uniformly in [0, B]
    (namely, enforce that exp(-alpha_c) is uniformly distributed ...), where B is a
    hyper-parameter in the interval (0, 1)". Read together: ``alpha_c in [0, B]`` with
    ``exp(-alpha_c)`` evenly spaced from ``exp(-0) = 1`` down to ``exp(-B)``:

        exp(-alpha_c) = 1 - c / (n - 1) * (1 - exp(-B)),   c = 0 .. n-1
        alpha_c = -log1p(-c / (n - 1) * (1 - exp(-B)))   (alpha_0 = 0, alpha_{n-1} = B)

    and ``alpha_0 = 0`` for a single head.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if isinstance(B, bool) or not isinstance(B, (int, float, np.floating, np.integer)) or not 0.0 < float(B) < 1.0:
        raise ValueError(f"B must be a number in the open interval (0, 1) (the paper's range; it sets "
                         f"alpha_c in [0, B]), got {B!r}")
    n = int(num_heads)
    if n == 1:
        return np.zeros(1)
    c = np.arange(n, dtype=np.float64)
    return -np.log1p(-c / (n - 1) * -np.expm1(-float(B)))


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's head slopes ``m_h`` (float64): for ``n`` a power of two the geometric sequence
    ``2^(-8/n), 2^(-16/n), ..., 2^(-8)`` (Press et al. 2021, Sec. 3); otherwise the slopes of
    the largest power of two ``n' < n`` followed by every other slope of ``2 n'`` (the ALiBi
    authors' rule for other head counts), ``n - n'`` of them."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")

    def geometric(n):
        return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)

    n = int(num_heads)
    p = 2 ** int(math.floor(math.log2(n)))
    if p == n:
        return geometric(n)
    return np.concatenate([geometric(p), geometric(2 * p)[0::2][:n - p]])


def check_pool(pool: int, align: str = "causal") -> int:
    """``pool`` (the window ``P``) as an int: odd and >= 1 (1: no pooling); ``align`` one of
    ``POOL_ALIGNS``. ``ValueError`` naming the problem otherwise."""
    if isinstance(pool, bool) or not isinstance(pool, (int, np.integer)) or pool < 1 or pool % 2 == 0:
        raise ValueError(f"pool (the average-pooling window P) must be an odd integer >= 1 (1: no pooling; "
                         f"the paper uses 3 and 5), got {pool!r}")
    if align not in POOL_ALIGNS:
        raise ValueError(f"pool_align must be one of {POOL_ALIGNS}, got {align!r}")
    return int(pool)


def check_chunk(chunk) -> int | None:
    """``chunk`` (LaS-chunk block length) as an int >= 1, or None (no blocks)."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk (the LaS-chunk block length) must be an integer >= 1 or None, got {chunk!r}")
    return int(chunk)


def causal_distance(L: int):
    """``D_L (L, L)`` float32: ``i - j`` on and below the diagonal, 0 above (the paper's Eq. 1)."""
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    return jnp.maximum(i - j, 0).astype(f32)


def block_start(L: int, chunk: int | None):
    """``(L,)`` int: the first position of each position's block (0 without blocks)."""
    pos = jnp.arange(L)
    return jnp.zeros_like(pos) if chunk is None else (pos // chunk) * chunk


def visible(L: int, chunk: int | None):
    """``(L, L)`` bool: key ``j`` is visible to query ``i`` iff ``j <= i`` and ``j`` lies in
    ``i``'s block."""
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    return (j <= i) & (j >= block_start(L, chunk)[:, None])


def pool_window(pool: int, align: str) -> tuple[int, int]:
    """Offsets ``(lo, hi)``: the pooled entry at key ``j`` averages keys ``j + lo .. j + hi``."""
    r = pool // 2
    return (0, pool - 1) if align == "causal" else (-r, r)


def pool_rows(A, pool: int, align: str = "causal"):
    """Average pooling of every row of ``A (..., L, L)`` along the key axis, window ``pool``,
    stride 1, zero padding counted (divide by ``pool``): ``out[..., i, j] = sum_{k=lo..hi}
    A[..., i, j + k] / pool`` (``pool_window``), entries outside ``[0, L)`` read as 0."""
    pool = check_pool(pool, align)
    if pool == 1:
        return A
    lo, hi = pool_window(pool, align)
    L = A.shape[-1]
    pad = [(0, 0)] * (A.ndim - 1) + [(-lo, hi)]
    Ap = jnp.pad(A, pad)
    out = sum(Ap[..., k - lo:k - lo + L] for k in range(lo, hi + 1))
    return out / jnp.asarray(pool, A.dtype)


def pool_values(v, pool: int, chunk: int | None = None):
    """The causal moving average the ``"causal"`` pooling puts on the values:
    ``out[..., j, :] = sum_{k=0..P-1} v[..., j - k, :] / P`` over ``j - k`` in ``j``'s block
    (zero padding before it). ``v (..., L, d)``. ``AP(A) v = A pool_values(v)`` for a causal,
    block-diagonal ``A``."""
    pool = check_pool(pool)
    if pool == 1:
        return v
    L = v.shape[-2]
    start = block_start(L, chunk)
    vp = jnp.pad(v, [(0, 0)] * (v.ndim - 2) + [(pool - 1, 0), (0, 0)])
    out = jnp.zeros_like(v)
    for k in range(pool):
        ok = (jnp.arange(L) - k >= start)[:, None]
        out = out + jnp.where(ok, vp[..., pool - 1 - k:pool - 1 - k + L, :], jnp.zeros((), v.dtype))
    return out / jnp.asarray(pool, v.dtype)


@functools.partial(jax.jit, static_argnames=("pool", "chunk", "align"))  # one compile when eager
def pooled_apply(S, v, pool: int, chunk: int | None = None, align: str = "causal"):
    """``AP(S) v`` masked to the visible keys, without forming the pooled matrix: ``S (..., L, L)``
    a causal, block-diagonal matrix (``las_softmax``), ``v (..., L, d)``. With window offsets
    ``lo .. hi`` (``pool_window``),

        sum_{j visible} AP(S)[i, j] v_j = 1/P sum_k sum_{j'} S[i, j'] v_{j' - k} [s_i <= j' - k <= i]

    ``"causal"``: ``k >= 0``, so ``j' - k <= i`` always holds and the sum over ``k`` is one
    product with the averaged values, ``S @ pool_values(v)``. ``"centered"``: one product per
    offset, ``S`` restricted to keys ``j' <= i + k`` times the values shifted by ``k`` (zero
    outside the block)."""
    pool = check_pool(pool, align)
    if align == "causal" or pool == 1:
        return jnp.einsum("...ij,...jd->...id", S, pool_values(v, pool, chunk))
    lo, hi = pool_window(pool, align)
    L = S.shape[-1]
    start = block_start(L, chunk)
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    vp = jnp.pad(v, [(0, 0)] * (v.ndim - 2) + [(hi, -lo), (0, 0)])   # vp[m] = v[m - hi]
    out = jnp.zeros(S.shape[:-1] + v.shape[-1:], jnp.result_type(S, v))
    for k in range(lo, hi + 1):
        src = jnp.arange(L) - k
        vk = jnp.where((src >= start)[:, None], vp[..., hi - k:hi - k + L, :], jnp.zeros((), v.dtype))
        out = out + jnp.einsum("...ij,...jd->...id", jnp.where(j - k <= i, S, 0.0), vk)
    return out / jnp.asarray(pool, out.dtype)


def _per_head(x, H: int, name: str):
    if x is None:
        return None
    x = jnp.asarray(x, f32)
    if x.shape != (H,):
        raise ValueError(f"{name} must have one value per head, shape ({H},), got {x.shape}")
    return x


@functools.partial(jax.jit, static_argnames=("chunk",))  # one compile when eager
def las_scores(q, k, alpha=None, slope=None, chunk: int | None = None):
    """Masked attention logits ``(B, h, L, L)`` float32 before the softmax.

    Args:
      q: ``(B, h, L, d)`` queries already scaled by ``d ** -0.5``; k: ``(B, h, L, d)`` keys.
      alpha: ``(h,)`` ELD rates (None: no ELD): the scores are multiplied by ``exp(-alpha D_L)``.
      slope: ``(h,)`` ALiBi slopes (None: no ALiBi): ``-slope D_L`` is added.
      chunk: LaS-chunk block length (None: full causal attention).
    Returns:
      logits with ``-inf`` where a key is not visible (``visible``).
    """
    H, L = q.shape[1], q.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape (B, heads, L, d), got {q.shape} and {k.shape}")
    alpha, slope = _per_head(alpha, H, "alpha"), _per_head(slope, H, "slope")
    chunk = check_chunk(chunk)
    s = jnp.einsum("bhid,bhjd->bhij", q.astype(f32), k.astype(f32))
    D = causal_distance(L)
    if alpha is not None:
        s = jnp.exp(-alpha[:, None, None] * D) * s
    if slope is not None:
        s = s - slope[:, None, None] * D
    return jnp.where(visible(L, chunk), s, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("chunk",))  # one compile when eager
def las_softmax(q, k, alpha=None, slope=None, chunk: int | None = None):
    """``SF(...)``: the softmax probabilities before pooling, ``(B, h, L, L)`` float32, rows
    summing to 1, exact zeros where a key is not visible (see ``las_scores``)."""
    # The diagonal is always visible, so no row is all -inf.
    return jax.nn.softmax(las_scores(q, k, alpha, slope, chunk), axis=-1)


@functools.partial(jax.jit, static_argnames=("pool", "chunk", "align"))  # one compile when eager
def las_probs(q, k, alpha=None, slope=None, pool: int = 1, chunk: int | None = None, align: str = "causal"):
    """The LaS attention matrix ``AP(SF(...))`` ``(B, h, L, L)`` float32 (the operator ``H``):
    ``las_softmax`` pooled along keys (``pool_rows``), then masked to the visible keys (``j <= i``,
    same block). Flags: ``alpha`` (ELD), ``slope`` (ALiBi), ``pool`` (AP; 1 = none), ``chunk``.

    Row sums: without pooling 1. With ``align="causal"`` the mass ``A[i, j']`` of key ``j'``
    keeps the fraction ``min(j' - s_i + 1, P) / P`` (``s_i`` the start of ``i``'s block), so a
    row sums to ``1 - sum_{j' < s_i + P - 1} A[i, j'] (s_i + P - 1 - j') / P``; with
    ``"centered"`` key ``j'`` keeps ``|[j' - r, j' + r] cap [s_i, i]| / P``.
    """
    pool = check_pool(pool, align)
    chunk = check_chunk(chunk)
    A = pool_rows(las_softmax(q, k, alpha, slope, chunk), pool, align)
    return jnp.where(visible(q.shape[2], chunk), A, 0.0)


__all__ = ["POOL_ALIGNS", "las_alphas", "alibi_slopes", "check_pool", "check_chunk", "causal_distance",
           "block_start", "visible", "pool_window", "pool_rows", "pool_values", "pooled_apply", "las_scores", "las_softmax",
           "las_probs"]
