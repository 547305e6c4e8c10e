"""The gated delta rule's token-mixing matrix, chunk by chunk.

Per head, ``S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T`` and ``o_t = S_t q_t`` give
``o_i = sum_{j <= i} M[i, j] v_j`` with one scalar ``M[i, j]`` shared by every value channel.
With ``u_t = b_t (v_t - a_t S_{t-1} k_t)`` the state is ``S_t = a_t S_{t-1} + u_t k_t^T``, so
``U = T^{-1} diag(b) V`` with ``T = I + diag(b) tril(K K^T * Gamma, -1)`` and ``O = tril(Q K^T *
Gamma) U``, ``Gamma[i, j] = prod_{t=j+1..i} a_t`` (the WY / UT form). ``M`` is ``O`` for the
identity as values: the recurrence runs over chunks of ``chunk`` positions with a state of
one row per source position (``transfer_matrix``), each chunk's unit-triangular ``T`` inverted
by blocks (``unit_lower_inverse``: matmuls only), every decay a product of factors in ``(0, 1]``
(no ``exp(S_i - S_j)`` of a large positive number).

Kimi Delta Attention decays each key dimension separately (``a_t`` a vector, the state times
``Diag(a_t)``); the same steps hold with ``Gamma`` moved inside the key sums: ``(K K^T * Gamma)[i,
j] = sum_d k_id k_jd prod_{t=j+1..i} a_td``, formed per chunk from the pairwise differences of
the cumulative log decays (``(C, C, d_k)`` per head; each factor again in ``(0, 1]``).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

f32 = jnp.float32

# Scans of ``transfer_matrix``: its wasted work above the diagonal is ~1 / SEGMENTS of the causal part,
# and each segment is compiled separately. 8 against 32 (2-core CPU, d_k 64): a third less compile
# time and 1.3-1.6x faster at L = 2048, but at L = 512 (32 chunks, each its own static step with 32)
# RWKV-6's reduce is ~15% slower.
SEGMENTS = 8
# Positions per group of chunks in ``delta_rule_matrix`` and ``dplr_matrix`` (``grouped_transfer_matrix``).
GROUP = 64


def masked_exp(x, mask):
    """``exp(x)`` where ``mask``, exactly 0 elsewhere (no ``exp`` of an unmasked large value)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def two_sum(a, b):
    """``(s, e)`` with ``s = fl(a + b)`` and ``s + e = a + b`` exactly (Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def double_float_add(x, y):
    """The sum of two double-float numbers ``(hi, lo)`` (values ``hi + lo``), renormalised."""
    hi, lo = two_sum(x[0], y[0])
    return two_sum(hi, lo + x[1] + y[1])


def segment_sums(g):
    """Pairwise sums of log decays within a chunk: ``D[t, s] = sum_{s < u <= t} g_u`` for ``t >= s``
    (meaningless above the diagonal), from ``g (B, H, C)`` or ``(B, H, C, d_k)``: ``(B, H, C, C[,
    d_k])``.

    ``G_t - G_s`` of a float32 running sum loses ``|G| * 2^-24``: with decays near ``e^-80`` a step,
    ``G`` reaches thousands within a chunk while a pair of neighbours after the strong step needs
    ``D`` to a few ulps of its own size. So the running sum is kept as a double float (``hi + lo``,
    an associative scan of TwoSum additions) and the difference taken with TwoSum: the error is
    a few ulps of ``|D[t, s]|``, at the cost of the plain difference.
    """
    hi, lo = jax.lax.associative_scan(double_float_add, (g, jnp.zeros_like(g)), axis=2)
    col = lambda x: jnp.expand_dims(x, 3)  # [t, .]
    row = lambda x: jnp.expand_dims(x, 2)  # [., s]
    d, e = two_sum(col(hi), -row(hi))
    return d + (e + (col(lo) - row(lo)))


@jax.jit  # one compile when eager
def unit_lower_inverse(T):
    """``T^{-1}`` of unit lower-triangular ``T (..., C, C)`` (the part above the diagonal and the
    diagonal itself are not read): ``(..., C, C)``, exactly 0 above the diagonal.

    Recursive block inversion, ``[[A, 0], [X, B]]^{-1} = [[A^-1, 0], [-B^-1 X A^-1, B^-1]]``,
    bottom-up over blocks of 1, 2, 4, ... (``T`` padded with the identity to a power of two), each
    level one batched matmul: XLA's CPU triangular solve of many small systems takes ~400x longer
    on two threads than on one, while matmuls parallelise.
    """
    C = T.shape[-1]
    Cp = 1 << max(C - 1, 0).bit_length()
    lead = T.shape[:-2]
    eye = jnp.eye(Cp, dtype=f32)
    T = jnp.where(jnp.tril(jnp.ones((Cp, Cp), bool), -1), jnp.pad(T.astype(f32), ((0, 0),) * len(lead) + ((0, Cp - C),) * 2), eye)
    X = jnp.ones(lead + (Cp, 1, 1), f32)  # the inverses of the diagonal blocks of size s
    s = 1
    while s < Cp:
        nb = Cp // (2 * s)
        blocks = T.reshape(lead + (nb, 2 * s, nb, 2 * s))
        low = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)[..., s:, :s]  # (.., nb, s, s)
        A, B = X[..., 0::2, :, :], X[..., 1::2, :, :]
        top = jnp.concatenate([A, jnp.zeros_like(A)], axis=-1)
        bottom = jnp.concatenate([-(B @ (low @ A)), B], axis=-1)
        X = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return X[..., 0, :C, :C]


class DeltaChunks(NamedTuple):
    """The per-chunk factors of the gated delta rule (``chunk_factors``); ``n`` chunks of ``C``
    positions, chunk-major (the order the recurrence visits them), decays broadcast to one per
    key dimension.

    Attributes:
      q_in: ``(n, B, H, C, d_k)`` ``q_i * a_{start..i}``: queries decayed from the chunk start.
      k_in: ``(n, B, H, C, d_k)`` ``k_i * a_{start..i}``.
      k_out: ``(n, B, H, C, d_k)`` ``k_t * a_{t+1..end}``: keys decayed to the chunk end.
      decay: ``(n, B, H, d_k)`` ``a_{start..end}``: the state's decay over the chunk.
      qk: ``(n, B, H, C, C)`` ``tril(Q K^T * Gamma)`` within the chunk (diagonal included).
      system: ``(n, B, H, C, C)`` ``T = I + diag(b) tril(K K^T * Gamma, -1)``, unit lower
        triangular (the identity without the erasure): the chunk's writes are ``U = T^{-1}
        diag(b) W``.
      beta: ``(n, B, H, C)`` the write strengths ``b``.
    """

    q_in: jax.Array
    k_in: jax.Array
    k_out: jax.Array
    decay: jax.Array
    qk: jax.Array
    system: jax.Array
    beta: jax.Array

    def solved(self):
        """``T^{-1} diag(b)`` of every chunk, ``(n, B, H, C, C)`` (``unit_lower_inverse``)."""
        return unit_lower_inverse(self.system) * self.beta[..., None, :]


def chunk_parts(qc, kc, gc, bc, erase: bool = True) -> DeltaChunks:
    """The factors of one chunk of every head (``DeltaChunks`` without the chunk axis).

    Args:
      qc, kc: ``(B, H, C, d_k)``; gc: ``(B, H, C)`` or ``(B, H, C, d_k)`` log decays; bc: ``(B, H, C)``
        write strengths; erase: as ``delta_rule``.
    """
    B, H, C, dk = kc.shape
    G = jnp.cumsum(gc, axis=2)  # (B, H, C[, d_k]): log prod of a from the chunk start
    diff = segment_sums(gc)  # (B, H, C, C[, d_k])
    if gc.ndim == 4:
        pair = lambda x, y, m: jnp.einsum("bhid,bhjd,bhijd->bhij", x, y, masked_exp(diff, m[..., None]))
        eG, to_end, decay = jnp.exp(G), jnp.exp(diff[:, :, -1]), jnp.exp(G[:, :, -1])
    else:
        pair = lambda x, y, m: jnp.einsum("bhid,bhjd->bhij", x, y) * masked_exp(diff, m)
        eG, to_end = jnp.exp(G)[..., None], jnp.exp(diff[:, :, -1])[..., None]
        decay = jnp.broadcast_to(jnp.exp(G[..., -1])[..., None], (B, H, dk))
    eye = jnp.eye(C, dtype=f32)
    if erase:
        T = eye + bc[..., :, None] * pair(kc, kc, jnp.tril(jnp.ones((C, C), bool), -1))
    else:
        T = jnp.broadcast_to(eye, (B, H, C, C))
    return DeltaChunks(qc * eG, kc * eG, kc * to_end, decay, pair(qc, kc, jnp.tril(jnp.ones((C, C), bool))), T, bc)


def pad_positions(x, Lp: int):
    """``x (B, H, L, ...)`` as float32, zero-padded along positions to ``Lp >= L`` (zeros: no
    decay, no write); None passes through."""
    if x is None:
        return None
    return jnp.pad(x.astype(f32), ((0, 0), (0, 0), (0, Lp - x.shape[2])) + ((0, 0),) * (x.ndim - 3))


def split_chunks(x, C: int):
    """``(B, H, L, ...)`` float32 -> ``(L / C, B, H, C, ...)`` (``L`` a multiple of ``C``)."""
    x = x.astype(f32)
    return jnp.moveaxis(x.reshape(x.shape[:2] + (x.shape[2] // C, C) + x.shape[3:]), 2, 0)


@functools.partial(jax.jit, static_argnames=("chunk", "erase"))  # one compile when eager
def chunk_factors(q, k, log_a, beta, chunk: int, erase: bool = True) -> DeltaChunks:
    """Everything of the chunked delta rule that lives inside one chunk (``O(L C)`` per head),
    for every chunk: what the Pallas kernel of ``delta_rule_matrix`` takes, leaving it the
    chunk recurrence (matrix products only).

    Args: as ``delta_rule`` (no ``v``), with ``L`` a multiple of ``chunk`` (pad with zero ``q, k,
      log_a, beta``: no decay, no write).
    Returns:
      ``DeltaChunks`` float32, ``n = L // chunk`` chunks.
    """
    xs = tuple(split_chunks(x, chunk) for x in (q, k, log_a, beta))
    # Per-dimension decays form a (C, C, d_k) product per chunk: one chunk at a time bounds
    # that; scalar decays need only (C, C), so all chunks at once.
    one = lambda x: chunk_parts(*x, erase=erase)
    return jax.lax.map(one, xs) if log_a.ndim == 4 else jax.vmap(one)(xs)


@functools.partial(jax.jit, static_argnames=("chunk", "erase"))  # one compile when eager
def delta_rule(q, k, v, log_a, beta, chunk: int | None = None, erase: bool = True):
    """The gated delta rule's outputs ``o_t = S_t q_t``, chunk by chunk (float32).

    Args:
      q, k: ``(B, H, L, d_k)`` queries and keys as the recurrence uses them (normalised and
        scaled as the model does).
      v: ``(B, H, L, d_v)`` values.
      log_a: ``(B, H, L)`` log decays, one per head (Gated DeltaNet), or ``(B, H, L, d_k)``, one
        per key dimension (Kimi Delta Attention: the state decays by ``Diag(a_t)`` before the
        erasure, ``S_t = (S_{t-1} Diag(a_t)) (I - b_t k_t k_t^T) + b_t v_t k_t^T``); ``<= 0``.
      beta: ``(B, H, L)`` write strengths ``b_t`` (in ``[0, 2]`` for a contracting step).
      chunk: positions per chunk (a performance knob; the numbers do not depend on it beyond
        float32 rounding). None: 16 for scalar decays, 8 for per-dimension ones (their pairwise
        decays are ``(C, C, d_k)`` per chunk, work growing with ``C``; the fastest on CPU at L = 512).
      erase: False leaves the erasure ``(I - b_t k_t k_t^T)`` out: gated linear attention,
        ``S_t = S_{t-1} Diag(a_t) + b_t v_t k_t^T``.
    Returns:
      ``(B, H, L, d_v)`` float32.
    """
    B, H, L, dk = k.shape
    dv = v.shape[-1]
    if chunk is None:
        chunk = 8 if log_a.ndim == 4 else 16
    C = max(1, min(chunk, L))
    Lp = -(-L // C) * C
    pad = lambda x: pad_positions(x, Lp)

    def step(S, xs):
        """``S (B, H, d_v, d_k)``: the state entering the chunk."""
        *parts, vc = xs
        f = chunk_parts(*parts, erase=erase)
        W = vc - jnp.einsum("bhid,bhvd->bhiv", f.k_in, S) if erase else vc  # (B, H, C, d_v)
        U = f.solved() @ W  # not jax's triangular solve: see dplr_step
        O = jnp.einsum("bhid,bhvd->bhiv", f.q_in, S) + f.qk @ U
        S = f.decay[:, :, None, :] * S + jnp.einsum("bhtv,bhtd->bhvd", U, f.k_out)
        return S, O

    S0 = jnp.zeros((B, H, dv, dk), f32)
    _, O = jax.lax.scan(step, S0, tuple(split_chunks(pad(x), C) for x in (q, k, log_a, beta, v)))
    return jnp.moveaxis(O, 0, 2).reshape(B, H, Lp, dv)[:, :, :L]


@jax.jit  # one executable per shape when called eagerly (it unrolls into up to SEGMENTS pieces)
def transfer_matrix(R, P, J, D):
    """``M (B, H, n C, n C)`` of a recurrence given by its chunk transfers: with ``Z_c (d_k, n C)``
    the state's columns for every source position entering chunk ``c`` (``Z_0 = 0``), chunk ``c``'s
    rows are ``R_c Z_c`` plus ``D_c`` on its own columns, and ``Z_{c+1} = P_c Z_c`` with ``J_c`` on
    chunk ``c``'s columns (zero in ``Z_c``: nothing reaches ahead).

    Identity values make every state a ``(d_k, L)`` matrix, of which chunk ``c`` touches only the
    ``c C`` columns before it: ``c C^2 d_k`` (+ ``c C d_k^2`` for a dense ``P``) once the chunk's own
    solves are folded into ``R, P, J, D`` (``(C, d_k)`` and ``(d_k, d_k)`` products batched over
    chunks, outside the recurrence).

    Args:
      R: ``(n, B, H, C, d_k)`` what a chunk's rows read of the state entering it.
      P: ``(n, B, H, d_k, d_k)`` the chunk's state transition, or ``(n, B, H, d_k)`` a diagonal one.
      J: ``(n, B, H, d_k, C)`` the state's columns for the chunk's own positions after it.
      D: ``(n, B, H, C, C)`` the chunk's diagonal block.
    Returns:
      ``(B, H, n C, n C)`` float32 (entries above the diagonal blocks exactly 0).
    """
    n, B, H, C, dk = R.shape
    L = n * C
    widen = lambda x, w: jnp.pad(x, ((0, 0),) * 3 + ((0, w - x.shape[3]),))
    carry = lambda Pc, Z: Pc[..., None] * Z if Pc.ndim == 3 else Pc @ Z  # P_c Z, P_c dense or diagonal

    def step(Z, xs):
        c, Rc, Pc, Jc, Dc = xs
        O = jax.lax.dynamic_update_slice_in_dim(Rc @ Z, Dc, c * C, axis=3)  # Z is 0 on these columns
        return jax.lax.dynamic_update_slice_in_dim(carry(Pc, Z), Jc, c * C, axis=3), O

    # Segments of chunks: a lone chunk is one static step over exactly the columns before it, a
    # longer run a scan over a state as wide as its last chunk's end; the work above the diagonal
    # is ~1 / SEGMENTS of the causal part, with at most SEGMENTS pieces to compile.
    ends = np.linspace(0, n, min(n, SEGMENTS) + 1).round().astype(int)
    rows, Z = [], jnp.zeros((B, H, dk, 0), f32)  # Z: the state's columns of the positions so far
    for a, b in zip(ends[:-1], ends[1:]):
        if b - a == 1:  # a scan of one step costs more than the step
            rows.append(jnp.concatenate([R[a] @ Z, D[a], jnp.zeros((B, H, C, L - b * C), f32)], axis=3))
            if b < n:
                Z = jnp.concatenate([carry(P[a], Z), J[a]], axis=3)
        else:
            Z, O = jax.lax.scan(step, widen(Z, b * C), (jnp.arange(a, b), R[a:b], P[a:b], J[a:b], D[a:b]))
            rows.append(widen(jnp.moveaxis(O, 0, 2).reshape(B, H, (b - a) * C, b * C), L))
    return jnp.concatenate(rows, axis=2)


def _decayed_pairs(R, P, J):
    """Block ``(I, K)`` of ``R_I Diag(P_{K+1} ... P_{I-1}) J_K`` for every pair of chunks (meaningful
    where ``K < I``): ``(..., n, C, n, C')`` from ``R (..., n, C, d)``, ``P (..., n, d)``, ``J (..., n, d,
    C')``; the decay between two chunks a product of the factors between them, folded into ``R``."""
    n = P.shape[-2]
    U = jnp.arange(n)
    f = jnp.where((U[None, :] < U[:, None])[:, :, None], P[..., None, :, :], 1.0)  # [I, U]: P_U for U < I
    upto = jnp.flip(jnp.cumprod(jnp.flip(f, -2), axis=-2), -2)  # [I, K]: the product over U >= K
    between = jnp.concatenate([upto[..., 1:, :], jnp.ones_like(upto[..., :1, :])], axis=-2)  # over U > K
    return jnp.einsum("...ikcd,...kde->...icke", R[..., :, None, :, :] * between[..., :, :, None, :], J)


@functools.partial(jax.jit, static_argnames=("group",))  # one compile when eager
def grouped_transfer_matrix(R, P, J, D, group: int = 4):
    """``transfer_matrix`` over groups of ``group`` chunks: the recurrence runs over the groups, each
    reading (rows carried from the group's start) and writing (columns carried to its end) ``group``
    times as many positions per matmul, and passing the state on by one transition per group (a
    dense ``P``: ``group`` times fewer ``(d_k, d_k)`` products with the state). Inside a group the
    blocks between its chunks are batched products ``R_I Diag(P_{K+1} ... P_{I-1}) J_K`` (a diagonal
    ``P``) or ``transfer_matrix`` of the group alone (a dense one). The carried factors are products
    of the chunks' own transitions: for a diagonal ``P`` decays in ``[0, 1]`` (no overflow).

    Args: as ``transfer_matrix``; group: chunks per group (a performance knob).
    Returns:
      ``(B, H, n C, n C)`` float32 (entries above the diagonal blocks exactly 0).
    """
    n, B, H, C, dk = R.shape
    g = max(1, min(group, n))
    if g == 1:
        return transfer_matrix(R, P, J, D)
    nS = -(-n // g)
    diagonal = P.ndim == 4
    identity = jnp.ones((dk,), f32) if diagonal else jnp.eye(dk, dtype=f32)
    pad = lambda x, v: (jnp.concatenate([x, jnp.broadcast_to(v, (nS * g - n,) + x.shape[1:]).astype(f32)])
                        if nS * g > n else x)
    R, P, J, D = pad(R, 0.0), pad(P, identity), pad(J, 0.0), pad(D, 0.0)  # padded chunks: no transition, no reads
    grouped = lambda x: x.reshape((nS, g) + x.shape[1:])
    Rg, Pg, Jg, Dg = grouped(R), grouped(P), grouped(J), grouped(D)  # (nS, g, B, H, ...)
    to_group = lambda x: jnp.moveaxis(x, 1, 3)  # (nS, g, B, H, ...) -> (nS, B, H, g, ...)
    if diagonal:  # the decays from the group's start to each chunk's start, from each chunk's end to its end
        ones = jnp.broadcast_to(identity, Pg[:, :1].shape)
        before = jnp.cumprod(jnp.concatenate([ones, Pg[:, :-1]], axis=1), axis=1)
        after = jnp.flip(jnp.cumprod(jnp.concatenate([ones, jnp.flip(Pg, 1)[:, :-1]], axis=1), axis=1), 1)
        Rs, Js = Rg * before[..., None, :], Jg * after[..., :, None]
        total = before[:, -1] * Pg[:, -1]
        inner = _decayed_pairs(to_group(Rg), to_group(Pg), to_group(Jg))  # (nS, B, H, g, C, g, C)
        u = jnp.arange(g)
        pairs = lambda m: m[:, None, :, None]  # (U, V) -> (U, i, V, j)
        own = jnp.where(pairs(u[:, None] == u[None, :]), to_group(Dg)[..., None, :], 0.0)
        Ds = jnp.where(pairs(u[:, None] > u[None, :]), inner, own).reshape(nS, B, H, g * C, g * C)
    else:  # each chunk's rows and columns carried one transition at a time: (C, d_k) products, not (d_k, d_k)
        Rs, Js = [Rg[:, 0]], [Jg[:, g - 1]]
        for u in range(1, g):
            Y, W = Rg[:, u], Jg[:, g - 1 - u]
            for v in range(u - 1, -1, -1):
                Y = Y @ Pg[:, v]
            for v in range(g - u, g):
                W = Pg[:, v] @ W
            Rs.append(Y)
            Js.insert(0, W)
        Rs, Js = jnp.stack(Rs, 1), jnp.stack(Js, 1)
        total = Pg[:, 0]
        for v in range(1, g):
            total = Pg[:, v] @ total
        folded = lambda x: jnp.moveaxis(x, 0, 1).reshape((g, nS * B) + x.shape[3:])  # groups into the batch
        Ds = transfer_matrix(folded(Rg), folded(Pg), folded(Jg), folded(Dg)).reshape(nS, B, H, g * C, g * C)
    Rs = to_group(Rs).reshape(nS, B, H, g * C, dk)
    Js = jnp.moveaxis(to_group(Js), 3, 4).reshape(nS, B, H, dk, g * C)
    return transfer_matrix(Rs, total, Js, Ds)[:, :, :n * C, :n * C]


@functools.partial(jax.jit, static_argnames=("chunk", "erase"))  # one compile, not op by op, when eager
def delta_rule_matrix(q, k, log_a, beta, chunk: int = 64, erase: bool = True):
    """``M (B, H, L, L)`` float32 of the gated delta rule of each head: ``delta_rule`` with the
    identity as values (value channel ``j`` is position ``j``'s indicator), so row ``i`` is
    ``o_i``'s weights on ``v_0 ... v_{L-1}``.

    Formed by ``transfer_matrix``: for values of earlier chunks a chunk's writes are ``U = -T^{-1}
    diag(b) K_in S^T``, so it reads ``R = Q_in - tril(Q K^T Gamma) T^{-1} diag(b) K_in`` of the state
    and passes on ``P = Diag(decay) - K_out^T T^{-1} diag(b) K_in`` (without the erasure ``R = Q_in``,
    ``P = Diag(decay)``); its own values give ``D = tril(Q K^T Gamma) T^{-1} diag(b)`` and ``J =
    K_out^T T^{-1} diag(b)``.

    Args: as ``delta_rule`` (no ``v``).
    Returns:
      ``(B, H, L, L)``: ``M[i, j] = b_j k_j^T A_{j+1} A_{j+2} ... A_i q_i`` with ``A_t = Diag(a_t) (I -
      b_t k_t k_t^T)`` (``a_t`` a scalar or per key dimension; without the erasure: ``Diag(a_t)``)
      for ``j <= i``, exactly 0 above the diagonal.
    """
    B, H, L, _ = k.shape
    C = max(1, min(chunk, L))
    Lp = -(-L // C) * C
    pad = lambda x: pad_positions(x, Lp)
    f = chunk_factors(*(pad(x) for x in (q, k, log_a, beta)), C, erase=erase)
    Ts = f.solved()  # T^{-1} diag(b)
    kT = lambda x: jnp.swapaxes(f.k_out, -1, -2) @ x
    if erase:
        Tk = Ts @ f.k_in
        R, P = f.q_in - f.qk @ Tk, f.decay[..., :, None] * jnp.eye(f.decay.shape[-1], dtype=f32) - kT(Tk)
    else:  # earlier values write nothing: the state only decays
        R, P = f.q_in, f.decay
    M = grouped_transfer_matrix(R, P, kT(Ts), f.qk @ Ts, -(-GROUP // C))[:, :, :L, :L]
    return jnp.where(jnp.tril(jnp.ones((L, L), bool)), M, 0.0)


__all__ = ["unit_lower_inverse", "pad_positions", "two_sum", "double_float_add", "segment_sums", "masked_exp", "DeltaChunks", "chunk_parts", "split_chunks", "chunk_factors",
           "delta_rule", "transfer_matrix", "grouped_transfer_matrix", "delta_rule_matrix"]
