"""Every operator core: the factors of a block's ``H``, with ``dense(idx)`` (see
``OperatorCore``). Families build these; kernels register fast paths per core type.

* ``StateDecayCore``: per-(channel, state) decay contracted over the state (Mamba-1's S6).
* ``ScalarDecayCore``: one log decay per group times an optional low-rank ``q k^T``
  (Griffin's RG-LRU; any per-channel or per-head scalar decay).
* ``DocumentMaskedCore``: another core with entries between packed documents zeroed.
* ``Mamba2Core``: per-head SSD matrices shared by the head's channels (Mamba-2).
* ``DeltaRuleCore``: per-head gated delta-rule matrices shared by the head's channels (Gated
  DeltaNet).
* ``MlstmCore``: per-head mLSTM matrices (xLSTM: decayed, stabilised and normalised ``q k^T``)
  shared by the head's channels.
* ``RwkvCore``: a gated, decayed row softmax (RWKV-4).
* ``ShortConvCore``: a banded causal convolution between two gates (LFM2's gated short conv).
* ``AttentionCore``: the softmax probabilities of a (grouped-query) local attention.
* ``LaSCore``: the LaS attention matrix (ELD / ALiBi, softmax, average pooling, chunks).
* ``BidirectionalCore``: a forward and a backward core on one sequence, ``scale (H_f + J H_b J)``
  (Vision Mamba's two scans; not causal).
* ``ParallelCore``: cores side by side, a part's channels possibly repeated (a layer that
  mixes tokens through two paths at once, Falcon-H1's Mamba-2 and attention; Zamba's Mamba
  heads, each with its own ``B`` and ``C``).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import (attention_probs, causal_mask, conv_matrix, conv_right, decay_matrix, delta_rule_matrix, dplr_matrix,
                   full_precision, keep_causal, las_probs, mlstm_matrix, scalar_decay_kernel, softmax_decay_rows,
                   state_decay_kernel)
from .base import OperatorCore, diag_embed, pytree_dataclass, take

f32 = jnp.float32


def _present(**factors) -> dict:
    """The factors that are not None."""
    return {k: v for k, v in factors.items() if v is not None}


def _sandwich(K, left, right, diag, conv_w):
    """``(diag(left) K diag(right) + diag(diag)) M`` for a block of channels."""
    H = K
    if left is not None:
        H = left[..., :, None] * H
    if right is not None:
        H = H * right[..., None, :]
    if diag is not None:
        H = H + diag_embed(diag)
    H = keep_causal(H)  # before the conv: it reads entries above the diagonal
    if conv_w is not None:
        H = conv_right(H, conv_w)
    return H


@pytree_dataclass(static=("chunk",))
class StateDecayCore(OperatorCore):
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

    def named_factors(self) -> dict:
        """``gate = left (B, C, L)``, ``log_decay = dt A (B, C, L, N)`` per state."""
        return _present(gate=self.left, log_decay=self.dt[..., None] * self.A[None, :, None, :])

    def dense(self, idx):
        H = state_decay_kernel(self.q, self.k, self.A[idx], take(self.dt, idx), self.chunk,
                               take(self.left, idx), take(self.right, idx), take(self.diag, idx))
        return H if self.conv_w is None else conv_right(H, take(self.conv_w, idx, 0))


@pytree_dataclass
class ScalarDecayCore(OperatorCore):
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

    def named_factors(self) -> dict:
        """``gate = left (B, C, L)``, ``log_decay = log_a (B, G, L)`` per group."""
        return _present(gate=self.left, log_decay=self.log_a)

    def dense(self, idx):
        g = self.group[idx]
        K = scalar_decay_kernel(take(self.log_a, g), take(self.q, g), take(self.k, g))
        return _sandwich(K, take(self.left, idx), take(self.right, idx),
                         take(self.diag, idx), take(self.conv_w, idx, 0))


@pytree_dataclass
class DocumentMaskedCore(OperatorCore):
    """``H = inner.dense(idx)`` with entries between different documents set to 0.

    The conv is the only part of the recurrent operator that could reach across a
    document start (the decay is exactly 0 there already). Shapes: ``seg (B, L)``.
    """

    inner: Any
    seg: Any

    @property
    def num_channels(self) -> int:
        return self.inner.num_channels

    def named_factors(self) -> dict:
        """The inner core's."""
        return self.inner.named_factors()

    def dense(self, idx):
        return self.dense_by(idx, lambda inner, i: inner.dense(i))

    def dense_by(self, idx, inner_dense):
        """``dense(idx)`` with the inner core's matrices from ``inner_dense(inner, idx)`` (a kernel's,
        where it has one): ``(B, len(idx), L, L)``."""
        same = self.seg[:, None, :, None] == self.seg[:, None, None, :]
        return jnp.where(same, inner_dense(self.inner, idx), 0.0)


def channel_heads(core, idx):
    """The head of each channel in ``idx (n,)`` of a core whose head ``h`` holds the channels ``h P ...
    (h + 1) P - 1`` (``P = C / H``; ``Mamba2Core``, the ``HeadMatrixCore``s): ``idx // P`` as numpy when
    ``idx`` is concrete, even where the core's arrays are traced (a jitted ``materialize`` of a few
    channels then forms only their heads' matrices, not all ``H``); ``head[idx]`` when ``idx`` is traced."""
    if isinstance(idx, jax.core.Tracer):
        return jnp.take(core.head, idx)
    return np.asarray(idx) // (core.num_channels // core.num_heads)


def span_heads(heads, P: int, H: int):
    """The distinct heads of traced ``heads (n,)`` whose channels span a contiguous range (a block of
    ``reduce``'s or ``apply``'s), with static size: such channels touch at most ``k = (n - 2) // P + 2``
    heads (``P`` channels per head, ``H`` heads). Returns ``(k, uniq (k,), inv (n,), found)``: the
    sorted distinct heads padded with the largest, each channel's place in ``uniq``, and a traced bool,
    False where the channels touch more than ``k`` heads (a scattered selection: use every head then).
    Where ``k >= min(n, H)`` only ``k`` is meaningful: the others are None."""
    n = heads.shape[0]
    k = min(n, H, (n - 2) // P + 2)
    if k >= min(n, H):
        return k, None, None, None
    # Padding with the largest head keeps ``uniq`` sorted for ``searchsorted``.
    uniq = jnp.unique(heads, size=k, fill_value=jnp.max(heads))
    inv = jnp.minimum(jnp.searchsorted(uniq, heads, method="compare_all"), k - 1)
    return k, uniq, inv, jnp.all(uniq[inv] == heads)


def head_weighted_sum(core, h, qw=None, kw=None):
    """``sum_c qw[b,c,i] H_c[b,i,j] kw[b,c,j]`` over head ``h``'s channels (``h P ... (h + 1) P - 1``)
    of ``H_c = diag(l_c) alpha_h diag(r_c) Conv_c``, for a core with ``alpha(heads)``, ``left``,
    ``right``, ``conv_w`` (each may be None) and ``num_channels`` / ``num_heads``, without forming
    any ``H_c``: ``(B, L, L)``.

    ``sum_c qw_c[i] H_c[i, j] kw_c[j] = sum_s alpha[i, j+s] X_s[i, j]`` with ``X_s[i, j] = sum_c
    (qw_c l_c)[i] (r_c[j+s] w_c[K-1-s] kw_c[j])``: one rank-``P`` matmul per conv tap instead of
    ``P`` dense matrices.

    Args:
      h: an int or a traced int32 scalar.
      qw, kw: ``(B, P, L)`` float32 weights of the head's channels; None: ``1/P`` (``qw``), 1 (``kw``).
    """
    P = core.num_channels // core.num_heads
    sl = lambda a: jax.lax.dynamic_slice_in_dim(a, h * P, P, axis=1)
    alpha = core.alpha(jnp.reshape(h, (1,)))[:, 0]
    ones = jnp.ones((alpha.shape[0], P, alpha.shape[-1]), f32)
    qw = ones / P if qw is None else qw
    kw = ones if kw is None else kw
    a = qw if core.left is None else qw * sl(core.left)
    right = ones if core.right is None else sl(core.right)
    w = (jnp.ones((P, 1), f32) if core.conv_w is None
         else jax.lax.dynamic_slice_in_dim(core.conv_w, h * P, P, axis=0))
    Kc, L = w.shape[1], alpha.shape[-1]
    d = core.diagonal() if isinstance(core, HeadMatrixCore) else None
    if d is not None and core.conv_w is not None:
        raise NotImplementedError("a diagonal term and a conv together are not supported in head sums")
    out = jnp.zeros_like(alpha) if d is None else diag_embed(jnp.sum(qw * sl(d) * kw, axis=1))
    for s in range(Kc):
        shift = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, s)))[..., s:]  # x[..., j + s], 0 past L
        X = jnp.einsum("bpi,bpj->bij", a, shift(right) * w[None, :, Kc - 1 - s, None] * kw)
        # terms with j + s > i are 0 in H; a NaN in X there must not reach row i (0 * NaN)
        out = out + jnp.where(causal_mask(L, L + s)[:, s:], shift(alpha) * X, 0.0)
    return out


def heads_weighted_sum(core, qw, kw, heads):
    """``sum_c qw[b,c,i] H_c[b,i,j] kw[b,c,j]`` over the channels of ``heads`` of a core with heads
    (``head_weighted_sum`` per head, accumulated one head at a time).

    Args:
      qw, kw: ``(B, C, L)`` float32 weights of all channels (zero for channels left out).
      heads: ``(k,)`` int32 heads holding every channel with a nonzero weight.
    Returns:
      ``(B, L, L)`` float32.
    """
    B, C, L = qw.shape
    P = C // core.num_heads

    def body(i, acc):
        h = heads[i]
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, h * P, P, axis=1)
        return acc + head_weighted_sum(core, h, sl(qw), sl(kw))

    return jax.lax.fori_loop(0, heads.shape[0], body, jnp.zeros((B, L, L), f32))


@pytree_dataclass(static=("heads_per_group",))
class Mamba2Core(OperatorCore):
    """``H_c = (diag(left_c) alpha_h diag(right_c)) M_c`` for channel ``c`` of head ``h = head[c]``,
    ``alpha_h = K_h diag(dt_h) + D_h I``, ``K_h[i, j] = (q_g[i] . k_g[j]) exp(sum_{t=j+1..i} log_a_h[t])``
    with ``g = h // heads_per_group``.

    ``q k^T`` is computed per group of B/C (once per ``dense`` call), never per channel.
    Shapes: ``log_a, dt (B, H, L)``, ``D (H,)``, ``q, k (B, G, L, N)``, ``head (C,)`` int,
    ``left, right (B, C, L)`` or None (ones), ``conv_w (C, K)`` or None (no conv).
    """

    log_a: Any
    dt: Any
    D: Any
    q: Any
    k: Any
    head: Any
    left: Any = None
    right: Any = None
    conv_w: Any = None
    heads_per_group: int = 1

    @property
    def num_channels(self) -> int:
        return self.head.shape[0]

    @property
    def num_heads(self) -> int:
        return self.log_a.shape[1]

    def _qk(self, groups):
        """``(B, len(groups), L, L)`` of ``q_g k_g^T``, computed for the fewest groups."""
        G = self.q.shape[1]
        n = groups.shape[0]
        if G == 1:
            qk = jnp.einsum("bin,bjn->bij", self.q[:, 0], self.k[:, 0])[:, None]
            return jnp.broadcast_to(qk, (qk.shape[0], n) + qk.shape[2:])
        if n >= G:
            qk = jnp.einsum("bgin,bgjn->bgij", self.q, self.k)
            return jnp.take(qk, groups, axis=1)
        return jnp.einsum("bgin,bgjn->bgij", jnp.take(self.q, groups, 1), jnp.take(self.k, groups, 1))

    def alpha(self, heads):
        """``(B, len(heads), L, L)`` float32 matrices ``alpha_h`` (dt and D folded in) of the
        heads ``heads (k,)`` int array. Jitted at module level: one compile per shape when eager."""
        return _alpha(self, heads)

    def _alpha_each(self, heads):
        """``alpha`` of each head in ``heads (k,)``, one head per loop step: ``(B, k, L, L)``.

        The loop materialises the k matrices; a plain ``take(alpha(heads), ...)`` lets XLA
        fuse the elementwise ``alpha`` into the gather and recompute it for every channel.
        Jitted at module level, so eager calls reuse one compilation per shape.
        """
        return _alpha_each(self, heads)

    def block_alpha(self, idx):
        """``alpha_{head[c]}`` for the channels ``c`` of ``idx``: ``(B, len(idx), L, L)``,
        computed once per distinct head and gathered (the ``P`` channels of a head share it).

        Concrete ``idx``: the distinct heads are found exactly (``np.unique``). Traced ``idx``
        (inside ``jit``/``scan``, e.g. ``reduce``'s contiguous channel blocks): ``n`` channels
        spanning a contiguous range touch at most ``k = (n - 2) // P + 2`` heads, so the
        distinct heads are found with a static-size ``jnp.unique`` of size ``k``; if a block
        touches more (an arbitrary, scattered ``idx``), a ``lax.cond`` falls back to one
        ``alpha`` per channel. Same numbers either way.
        """
        heads = channel_heads(self, idx)
        n, H = heads.shape[0], self.num_heads
        if not isinstance(heads, jax.core.Tracer):
            uniq, inv = np.unique(np.asarray(heads), return_inverse=True)
            if uniq.shape[0] == n:
                return self.alpha(heads)
            return jnp.take(self._alpha_each(jnp.asarray(uniq)), jnp.asarray(inv.reshape(-1)), axis=1)
        k, uniq, inv, found = span_heads(heads, max(1, self.num_channels // H), H)
        if k >= n:
            return self.alpha(heads)
        if k >= H:  # every head fits: always exact
            return jnp.take(self._alpha_each(jnp.arange(H)), heads, axis=1)
        return jax.lax.cond(found, lambda: jnp.take(self._alpha_each(uniq), inv, axis=1),
                            lambda: self.alpha(heads))

    def named_factors(self) -> dict:
        """``gate = left (B, C, L)``, ``log_decay = log_a (B, H, L)`` per head."""
        return _present(gate=self.left, log_decay=self.log_a)

    def dense(self, idx):
        return _sandwich(self.block_alpha(idx), take(self.left, idx), take(self.right, idx), None,
                         take(self.conv_w, idx, 0))

    def head_mean(self, h):
        """Mean of ``H_c`` over the channels ``c`` of head ``h`` (an int or a traced scalar)
        without forming any ``H_c``: ``(B, L, L)`` (``head_weighted_sum``)."""
        return head_weighted_sum(self, h)


@jax.jit
def _alpha(core: Mamba2Core, heads):
    K = decay_matrix(jnp.take(core.log_a, heads, axis=1), chunk=64)
    K = K * core._qk(heads // core.heads_per_group) * jnp.take(core.dt, heads, axis=1)[..., None, :]
    L = K.shape[-1]
    return K + core.D[heads][:, None, None] * jnp.eye(L, dtype=f32)


@jax.jit
@full_precision
def _alpha_each(core: Mamba2Core, heads):
    return jnp.moveaxis(jax.lax.map(lambda h: core.alpha(h[None])[:, 0], heads), 0, 1)


class HeadMatrixCore(OperatorCore):
    """A core whose channels share one matrix per head: ``H_c = diag(left_c) M_h diag(right_c) Conv_c``
    for channel ``c`` of head ``h = head[c]`` (a head's channels are ``h P ... (h + 1) P - 1``).

    Subclasses are ``pytree_dataclass``es with the fields ``q (B, ., L, .)``, ``head (C,)`` int,
    ``left, right (B, C, L)`` or None (ones), ``conv_w (C, K)`` or None (no conv), ``matrices
    (B, k, L, L)`` (the ``M_h`` already computed, else None) and ``matrix_heads (k,)`` int (the
    heads ``matrices`` holds, ascending; None: all ``H``, ``k = H``), and define ``num_heads`` and
    ``compute_head_matrix(heads)``.
    """

    @property
    @abc.abstractmethod
    def num_heads(self) -> int:
        """Number of heads ``H``."""

    @abc.abstractmethod
    def compute_head_matrix(self, heads):
        """``(B, len(heads), L, L)`` float32 ``M_h`` of ``heads``, computed from the factors."""

    @property
    def num_channels(self) -> int:
        return self.head.shape[0]

    def with_head_matrices(self, M) -> "HeadMatrixCore":
        """This core with every ``M_h`` given: ``M (B, H, L, L)`` float32 (e.g. from the Pallas
        kernel); ``dense``, ``alpha`` and ``head_mean`` then read it."""
        B, L = self.q.shape[0], self.q.shape[2]
        if M.shape != (B, self.num_heads, L, L):
            raise ValueError(f"head matrices must have shape {(B, self.num_heads, L, L)}, got {M.shape}")
        return dataclasses.replace(self, matrices=M, matrix_heads=None)

    def heads_to_precompute(self, idx):
        """The distinct heads of the concrete channels ``idx (n,)``, ascending (numpy ``(k,)``): a loop
        over blocks of these channels needs only their ``M_h`` (``precompute(heads)``); None where
        that is every head."""
        heads = np.unique(channel_heads(self, idx))
        return None if heads.size == self.num_heads else heads

    def precompute(self, heads=None) -> "HeadMatrixCore":
        """The ``M_h`` of ``heads`` (``(k,)`` int, ascending, may be traced; None: every head)
        computed once (``(B, k, L, L)``), for loops over blocks of channels. The result's ``dense``
        then serves only channels of those heads (a traced channel of another head reads a wrong
        matrix; a concrete one raises)."""
        if self.matrices is not None:
            return self
        if heads is None:
            return self.with_head_matrices(self.head_matrix(jnp.arange(self.num_heads)))
        heads = jnp.asarray(heads, jnp.int32)
        return dataclasses.replace(self, matrices=self.compute_head_matrix(heads), matrix_heads=heads)

    def head_matrix(self, heads):
        """``(B, len(heads), L, L)`` float32 ``M_h`` of the heads ``heads``."""
        if self.matrices is None:
            return self.compute_head_matrix(heads)
        if self.matrix_heads is None:
            return jnp.take(self.matrices, heads, axis=1)
        if isinstance(heads, jax.core.Tracer) or isinstance(self.matrix_heads, jax.core.Tracer):
            return jnp.take(self.matrices, jnp.searchsorted(self.matrix_heads, heads, method="compare_all"), axis=1)
        held = np.asarray(self.matrix_heads)
        missing = np.setdiff1d(np.asarray(heads), held)
        if missing.size:
            raise ValueError(f"heads {missing.tolist()} were not precomputed (this core holds the matrices "
                             f"of heads {held.tolist()})")
        return jnp.take(self.matrices, np.searchsorted(held, np.asarray(heads)), axis=1)

    def alpha(self, heads):
        """``M_h`` of ``heads`` (``Mamba2Operator.head_matrices(how="alpha")``): ``(B, k, L, L)``."""
        return self.head_matrix(heads)

    def head_mean(self, h):
        """Mean of ``H_c`` over the channels of head ``h`` (an int or a traced scalar), ``M_h``
        computed once and no ``H_c`` formed (``head_weighted_sum``): ``(B, L, L)``."""
        return head_weighted_sum(self, h)

    def diagonal(self):
        """``(B, C, L)`` a per-channel term added on the diagonal after the sandwich (RWKV-7's bonus
        read outside the group norm), or None (the default)."""
        return None

    def sandwich(self, M, idx):
        """``(diag(left_c) M_c diag(right_c) + diag(d_c)) Conv_c`` for the channels ``idx`` of ``M (B,
        len(idx), L, L)`` (``d = diagonal()``, absent when None)."""
        return _sandwich(M, take(self.left, idx), take(self.right, idx), take(self.diagonal(), idx),
                         take(self.conv_w, idx, 0))

    def dense(self, idx):
        heads = channel_heads(self, idx)
        if isinstance(heads, jax.core.Tracer):
            # Without precomputed matrices each distinct head is formed once, then gathered per channel.
            M = (self.head_matrix(heads) if self.matrices is not None
                 else jnp.take(self.head_matrix(jnp.arange(self.num_heads)), heads, axis=1))
        else:
            uniq, inv = np.unique(np.asarray(heads), return_inverse=True)
            M = jnp.take(self.head_matrix(jnp.asarray(uniq)), jnp.asarray(inv.reshape(-1)), axis=1)
        return self.sandwich(M, idx)


@pytree_dataclass(static=("heads_per_group", "delta", "chunk"))
class DeltaRuleCore(HeadMatrixCore):
    """``H_c = diag(left_c) M_h diag(right_c) Conv_c`` (``HeadMatrixCore``) with ``M_h`` the gated
    delta rule's matrix (``ops.delta_rule_matrix``) of key head ``h // heads_per_group``'s queries
    and keys with value head ``h``'s decays and write strengths. With ``delta=False``, ``M_h =
    tril(q k^T * Gamma) diag(b)`` (per-dimension decays: inside the key sum): the state's ``(I - b k
    k^T)`` erasure left out (the approximation others report; not exact).

    Shapes: ``q, k (B, G, L, d_k)``, ``log_a (B, H, L)`` (one decay per head) or ``(B, H, L, d_k)``
    (per key dimension, Kimi Delta Attention), ``beta (B, H, L)``, ``head (C,)`` int, ``left, right
    (B, C, L)`` or None (ones), ``conv_w (C, K)`` or None (no conv), ``matrices (B, H, L, L)`` every
    ``M_h`` when already computed (``precompute``, the Pallas kernel), else None (``matrix_heads``:
    ``HeadMatrixCore``).
    """

    q: Any
    k: Any
    log_a: Any
    beta: Any
    head: Any
    left: Any = None
    right: Any = None
    conv_w: Any = None
    heads_per_group: int = 1
    delta: bool = True
    chunk: int = 64
    matrices: Any = None
    matrix_heads: Any = None

    @property
    def num_heads(self) -> int:
        return self.log_a.shape[1]

    def compute_head_matrix(self, heads):
        groups = heads // self.heads_per_group
        q, k = jnp.take(self.q, groups, axis=1), jnp.take(self.k, groups, axis=1)
        log_a, beta = jnp.take(self.log_a, heads, axis=1), jnp.take(self.beta, heads, axis=1)
        return delta_rule_matrix(q, k, log_a, beta, self.chunk, erase=self.delta)

    def named_factors(self) -> dict:
        """``gate = left (B, C, L)``, ``log_decay = log_a (B, H, L[, d_k])`` per value head."""
        return _present(gate=self.left, log_decay=self.log_a)


@pytree_dataclass(static=("after", "chunk", "decay_floor"))
class DplrCore(HeadMatrixCore):
    """``H_c = diag(left_c) M_h diag(right_c) Conv_c`` (``HeadMatrixCore``) with ``M_h`` the matrix of
    head ``h``'s diagonal-plus-low-rank recurrence (``ops.dplr_matrix``): ``S_t = S_{t-1} (Diag(w_t)
    + a_t b_t^T) + v_t k_t^T`` read as ``S_t q_t`` (``after``, RWKV-7) or ``S_{t-1} q_t`` plus
    ``bonus_t v_t`` (RWKV-5/6).

    Shapes: ``q, k, log_w (B, H, L, d_k)``, ``a, b (B, H, L, d_k)`` or None (a diagonal
    transition), ``bonus (B, H, L)`` or None, ``head (C,)`` int, ``left, right (B, C, L)`` or None,
    ``conv_w (C, K)`` or None, ``matrices (B, H, L, L)`` or None, ``diag (B, C, L)`` or None;
    ``decay_floor`` a static lower bound of ``log_w`` or None (``ops.dplr_parts``: a faster chunk
    form where the decays cannot underflow).
    """

    q: Any
    k: Any
    log_w: Any
    head: Any
    a: Any = None
    b: Any = None
    bonus: Any = None
    left: Any = None
    right: Any = None
    conv_w: Any = None
    after: bool = True
    chunk: int = 16  # RWKV-5/6 at L = 512: 16 the fastest (sub-blocked pairs; 8 and 32 slower by 6% and 19%)
    matrices: Any = None
    matrix_heads: Any = None
    diag: Any = None
    decay_floor: Any = None

    @property
    def num_heads(self) -> int:
        return self.log_w.shape[1]

    def diagonal(self):
        return self.diag

    def compute_head_matrix(self, heads):
        pick = lambda x: None if x is None else jnp.take(x, heads, axis=1)
        return dplr_matrix(pick(self.q), pick(self.k), pick(self.log_w), pick(self.a), pick(self.b),
                           pick(self.bonus), self.chunk, self.after, self.decay_floor)

    def named_factors(self) -> dict:
        """``gate = left (B, C, L)``, ``log_decay = log_w (B, H, L, d_k)``."""
        return _present(gate=self.left, log_decay=self.log_w)


@pytree_dataclass
class MlstmCore(HeadMatrixCore):
    """``H_c = diag(left_c) M_h diag(right_c) Conv_c`` (``HeadMatrixCore``) with ``M_h`` head ``h``'s
    mLSTM matrix (``ops.mlstm_matrix``): the decayed ``q k^T`` weighted by the input gates relative
    to the stabiliser ``m``, divided row by row by the normaliser ``max(|n . q|, e^{-m}) + eps``
    (a per-row diagonal, the block's own).

    Shapes: ``q, k (B, H, L, d_k)`` (``q`` scaled), ``log_f, log_i, m, norm (B, H, L)`` log forget
    gates, log input gates, the model's stabiliser and normaliser, ``head (C,)`` int, ``left, right
    (B, C, L)`` or None, ``conv_w (C, K)`` or None, ``matrices (B, H, L, L)`` or None.
    """

    q: Any
    k: Any
    log_f: Any
    log_i: Any
    m: Any
    norm: Any
    head: Any
    left: Any = None
    right: Any = None
    conv_w: Any = None
    matrices: Any = None
    matrix_heads: Any = None

    @property
    def num_heads(self) -> int:
        return self.log_f.shape[1]

    def compute_head_matrix(self, heads):
        pick = lambda x: jnp.take(x, heads, axis=1)
        return mlstm_matrix(pick(self.q), pick(self.k), pick(self.log_f), pick(self.log_i), pick(self.m),
                            norm=pick(self.norm))

    def named_factors(self) -> dict:
        """``gate = left (B, C, L)``, ``log_decay = log_f (B, H, L)`` per head."""
        return _present(gate=self.left, log_decay=self.log_f)


@pytree_dataclass
class RwkvCore(OperatorCore):
    """``H_c = diag(gate_c) softmax_rows(l_c)`` (see ``softmax_decay_rows``).

    Shapes: ``k (B, A, L)``, ``w, u (A,)`` float32, ``gate (B, A, L)`` or None.
    """

    k: Any
    w: Any
    u: Any
    gate: Any = None

    @property
    def num_channels(self) -> int:
        return self.w.shape[0]

    def named_factors(self) -> dict:
        """``gate = sigmoid(r) (B, A, L)``, ``log_decay = w (A,)`` (constant per channel)."""
        return _present(gate=self.gate, log_decay=self.w)

    def dense(self, idx):
        """``(B, len(idx), L, L)`` float32 operators of channels ``idx``."""
        P = softmax_decay_rows(jnp.take(self.k, idx, axis=1), self.w[idx], self.u[idx])
        if self.gate is not None:
            P = keep_causal(jnp.take(self.gate, idx, axis=1)[..., :, None] * P)  # a NaN gate: zeros stay above
        return P


@pytree_dataclass
class ShortConvCore(OperatorCore):
    """``H_c = diag(left_c) M_c diag(right_c)`` with ``M_c`` the banded causal conv matrix of
    filter ``conv_w[c]`` (``ops.conv_matrix``): nonzero only ``K - 1`` steps below the diagonal.

    Shapes: ``conv_w (C, K)``, ``left (B, C, L)``, ``right (B, C, L)`` or None, float32.
    """

    conv_w: Any
    left: Any
    right: Any = None

    @property
    def num_channels(self) -> int:
        return self.conv_w.shape[0]

    def named_factors(self) -> dict:
        """``gate = left (B, C, L)`` (the output gate)."""
        return {"gate": self.left}

    def dense(self, idx):
        """``(B, len(idx), L, L)`` float32 operators of channels ``idx``."""
        L, K = self.left.shape[-1], self.conv_w.shape[-1]
        H = conv_matrix(self.conv_w[idx].astype(f32), L)[None]
        H = jnp.take(self.left, idx, axis=1)[..., :, None] * H
        if self.right is not None:
            H = H * jnp.take(self.right, idx, axis=1)[..., None, :]
        d = jnp.arange(L)[:, None] - jnp.arange(L)[None, :]
        return jnp.where((d >= 0) & (d < K), H, 0.0)  # exact zeros off the band, a NaN gate included


@pytree_dataclass(static=("window",))
class AttentionCore(OperatorCore):
    """Factors of a (multi-query / grouped) local attention map.

    Shapes: ``q (B, H, L, d)`` float32 scaled queries, ``k (B, KV, L, d)`` float32 keys
    (query head ``h`` reads key head ``h // (H // KV)``), ``seg (B, L)`` int document ids.
    """

    q: Any
    k: Any
    seg: Any
    window: int

    @property
    def num_channels(self) -> int:
        return self.q.shape[1]

    def dense(self, idx):
        """``(B, len(idx), L, L)`` softmax probabilities of heads ``idx``."""
        groups = self.q.shape[1] // self.k.shape[1]
        q = jnp.take(self.q, idx, axis=1)
        k = jnp.take(self.k, idx // groups, axis=1)
        return attention_probs(q, k, self.seg, self.window)


@pytree_dataclass(static=("pool", "chunk", "align"))
class LaSCore(OperatorCore):
    """Factors of a LaS attention map (``ops.las_probs``): ``H_h = mask(AP(SF(...)))`` per head,
    pooling and every mask included, so ``H v`` is the block's per-head output.

    Shapes: ``q, k (B, H, L, d)`` float32 (``q`` scaled by ``d ** -0.5``); ``alpha``, ``slope``
    ``(H,)`` float32 or None (no ELD / no ALiBi); ``pool`` the window ``P`` (1: none),
    ``chunk`` the block length or None, ``align`` ``"causal"`` or ``"centered"``.
    """

    q: Any
    k: Any
    alpha: Any = None
    slope: Any = None
    pool: int = 1
    chunk: Any = None
    align: str = "causal"

    @property
    def num_channels(self) -> int:
        return self.q.shape[1]

    def dense(self, idx):
        """``(B, len(idx), L, L)`` LaS attention matrices of heads ``idx``."""
        sel = lambda a: None if a is None else a[idx]
        return las_probs(jnp.take(self.q, idx, axis=1), jnp.take(self.k, idx, axis=1), sel(self.alpha),
                         sel(self.slope), self.pool, self.chunk, self.align)


@pytree_dataclass(static=("repeats",))
class ParallelCore(OperatorCore):
    """Cores side by side: the channels of ``parts[0]``, then of ``parts[1]``, ..., each
    channel of part ``k`` repeated ``repeats[k]`` times (an attention head read by each of its
    ``head_dim`` value features). Falcon-H1: a Mamba-2 and an attention core (repeats ``(1,
    head_dim)``); Zamba: one Mamba core per head, each with its own ``B`` and ``C``.

    ``dense`` of a concrete selection computes each part only for its own channels; a traced
    one computes every part and selects.
    """

    parts: tuple
    repeats: tuple

    @property
    def starts(self) -> np.ndarray:
        """The first channel of each part, and the total: ``(len(parts) + 1,)``."""
        return np.cumsum([0] + [p.num_channels * r for p, r in zip(self.parts, self.repeats)])

    @property
    def num_channels(self) -> int:
        return int(self.starts[-1])

    def named_factors(self) -> dict:
        """``gate (B, C, L)``: each part's (repeated), 1 on a part without one (attention);
        ``log_decay``: those of the parts that have one, concatenated on axis 1 (per channel
        where every part's is, as Zamba's heads'; the Mamba path's alone in Falcon-H1)."""
        fs = [p.named_factors() for p in self.parts]
        out = {}
        if any("gate" in f for f in fs):
            ref = next(f["gate"] for f in fs if "gate" in f)
            B, L = ref.shape[0], ref.shape[2]
            out["gate"] = jnp.concatenate(
                [jnp.repeat(f["gate"], r, axis=1) if "gate" in f else jnp.ones((B, p.num_channels * r, L), ref.dtype)
                 for f, p, r in zip(fs, self.parts, self.repeats)], axis=1)
        decays = [f["log_decay"] for f in fs if "log_decay" in f]
        if decays:
            out["log_decay"] = decays[0] if len(decays) == 1 else jnp.concatenate(decays, axis=1)
        return out

    def dense(self, idx):
        """``(B, len(idx), L, L)`` float32 operators of channels ``idx``."""
        return self.dense_by(idx, lambda part, i: part.dense(i))

    def dense_by(self, idx, part_dense):
        """``dense(idx)`` with each part's matrices from ``part_dense(part, local_idx)`` (a
        kernel's, where the part has one): ``(B, len(idx), L, L)`` float32."""
        starts = self.starts
        local = lambda k, i: (i - starts[k]) // self.repeats[k]
        if not isinstance(idx, jax.core.Tracer):
            idx = np.asarray(idx)
            if idx.size == 0:
                return part_dense(self.parts[0], jnp.asarray(idx))
            part = np.searchsorted(starts, idx, side="right") - 1
            blocks, order = [], []
            for k, p in enumerate(self.parts):
                sel = np.flatnonzero(part == k)
                if sel.size:
                    blocks.append(part_dense(p, jnp.asarray(local(k, idx[sel]))))
                    order.append(sel)
            if len(blocks) == 1:
                return blocks[0]
            parts = jnp.concatenate(blocks, axis=1)
            return jnp.take(parts, jnp.asarray(np.argsort(np.concatenate(order))), axis=1)
        out = None
        for k, p in enumerate(self.parts):
            d = part_dense(p, jnp.clip(local(k, idx), 0, p.num_channels - 1))
            out = d if out is None else jnp.where((idx >= starts[k])[None, :, None, None], d, out)
        return out


@pytree_dataclass(static=("scale",))
class BidirectionalCore(OperatorCore):
    """``H = scale * (H_f + J H_b J)``: ``forward`` runs on the sequence, ``backward`` on the
    reversed sequence (``J`` reverses positions), both with the same channels. The result is
    dense, not causal (Vision Mamba's bidirectional block: ``scale`` 1/2 with
    ``if_devide_out``).

    Shapes: ``forward``, ``backward`` cores of ``C`` channels over ``(B, L)``; ``scale`` a float.
    """

    forward: Any
    backward: Any
    scale: float = 1.0

    @property
    def num_channels(self) -> int:
        return self.forward.num_channels

    def heads_to_precompute(self, idx):
        return self.forward.heads_to_precompute(idx)

    def precompute(self, heads=None) -> "BidirectionalCore":
        return dataclasses.replace(self, forward=self.forward.precompute(heads),
                                   backward=self.backward.precompute(heads))

    def dense(self, idx):
        """``(B, len(idx), L, L)`` float32: ``scale (H_f + flip(H_b))`` with both position axes flipped."""
        return self.dense_by(idx, lambda part, i: part.dense(i))

    def dense_by(self, idx, part_dense):
        """``dense(idx)`` with both directions' matrices from ``part_dense(part, idx)`` (a kernel's):
        ``(B, len(idx), L, L)`` float32."""
        Hb = jnp.flip(part_dense(self.backward, idx), axis=(-2, -1))
        return jnp.asarray(self.scale, f32) * (part_dense(self.forward, idx) + Hb)


__all__ = ["BidirectionalCore", "channel_heads", "span_heads", "head_weighted_sum", "heads_weighted_sum",
           "StateDecayCore", "ScalarDecayCore", "DocumentMaskedCore", "Mamba2Core", "HeadMatrixCore", "DplrCore",
           "DeltaRuleCore", "RwkvCore", "ShortConvCore", "AttentionCore", "LaSCore", "ParallelCore"]
