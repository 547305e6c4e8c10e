"""The diagonal-plus-low-rank (DPLR) linear recurrence and its token-mixing matrix, chunk by chunk.

Per head, with the state ``S`` of shape ``(d_v, d_k)``::

    S_t = S_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T

read out as ``o_t = S_t q_t`` (RWKV-7's generalised delta rule: ``a = -kk``, ``b = kk * iclr``)
or as ``o_t = S_{t-1} q_t`` (RWKV-5/6, ``a = b = 0``, whose bonus term for the current token is
added by the caller). Either way ``o_i = sum_j M[i, j] v_j`` with one scalar ``M[i, j]`` per head.

Within a chunk of ``C`` positions entering with state ``S_0``, let ``G_t`` be the cumulative log
decay from the chunk start through ``t`` (one per key dimension) and ``E_t = G_t - log w_t``
(through ``t - 1``). With ``x_t = S_{t-1} a_t`` (what the low-rank term reads),

* ``X = (I - A_ab)^{-1} ((a * exp(E)) S_0^T + A_ak V)`` (a unit-triangular solve, rows ``x_t``),
* ``O = (q * exp(G or E)) S_0^T + A_qb X + A_qk V``,
* ``S_C = S_0 Diag(exp(G_C)) + X^T (b * exp(G_C - G)) + V^T (k * exp(G_C - G))``,

where ``A_xy[t, s] = sum_d x_td y_sd exp(R_td - G_sd)`` over ``s < t`` (``A_ak``, ``A_ab``, ``R = E``)
or ``s <= t`` (``A_qk``, ``A_qb`` for the read after the update, ``R = G``; ``s < t`` and ``R = E``
for the read before it). Every exponent is a sum of log decays over a forward range, so every
factor is in ``(0, 1]``: strong decays underflow to 0, never overflow.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .delta import GROUP, grouped_transfer_matrix, masked_exp, pad_positions, split_chunks, unit_lower_inverse

f32 = jnp.float32


class DplrChunks(NamedTuple):
    """The factors of one chunk of the DPLR recurrence (``dplr_parts``), every head; ``C``
    positions, decays per key dimension.

    Attributes:
      q_in: ``(B, H, C, d_k)`` queries decayed from the chunk start (through ``t``, or ``t - 1``
        for the read before the update).
      a_in: ``(B, H, C, d_k)`` ``a_t`` decayed from the chunk start through ``t - 1``, or None.
      k_out, b_out: ``(B, H, C, d_k)`` ``k_t``, ``b_t`` decayed to the chunk end (``b_out`` None
        without the low-rank term).
      decay: ``(B, H, d_k)`` the state's decay over the chunk.
      qk, qb: ``(B, H, C, C)`` ``A_qk`` (the bonus, if any, on its diagonal) and ``A_qb`` (None).
      ak: ``(B, H, C, C)`` ``A_ak``, or None.
      system: ``(B, H, C, C)`` ``I - A_ab``, unit lower triangular, or None.
    """

    q_in: jax.Array
    a_in: jax.Array | None
    k_out: jax.Array
    b_out: jax.Array | None
    decay: jax.Array
    qk: jax.Array
    qb: jax.Array | None
    ak: jax.Array | None
    system: jax.Array | None

    def solved(self):
        """``(I - A_ab)^{-1}`` of every chunk, ``(..., C, C)`` (``ops.unit_lower_inverse``)."""
        return unit_lower_inverse(self.system)


# Largest |cumulative log decay| within a chunk for which the pair sums are taken as matmuls of
# (x e^{R_t}) and (y e^{-G_s}): every factor in [e^-24, e^24], far inside float32's range.
FACTOR_LIMIT = 24.0


def factorizable(decay_floor, C: int) -> bool:
    """Whether chunks of ``C`` positions whose log decays are all ``>= decay_floor`` (a static
    bound, e.g. RWKV-7's ``-e^-1/2``; None: unbounded) can use the factorized pair sums."""
    return decay_floor is not None and -decay_floor * C <= FACTOR_LIMIT


# Positions per sub-block in ``blocked_pairs``: exponentials per chunk of C positions ~ C^2 / SUB
# + (C / SUB)^2 instead of C^2 (RWKV-6's head matrices at L = 512: 4 was the fastest of 2, 4, 8).
SUB = 4


def blocked_pairs(x, y, g, after: bool, sub: int = SUB):
    """``A[t, s] = sum_d x_td y_sd exp(sum_{s < u <= t} g_ud)`` for ``s <= t`` (``after``; else the
    sum through ``t - 1`` for ``s < t``), exactly 0 elsewhere, for decays without a lower bound.

    In sub-blocks of ``sub`` positions: for ``t`` in sub-block ``a`` and ``s`` in an earlier ``b``
    the exponent is ``prefix_t + between_ab + suffix_s`` (as ``ops.chunk_sums``: short sums of
    same-signed terms, never a difference), taken as three factors each ``<= 1`` (no overflow; one
    underflows only where the pair's weight does), the first and last folded into ``x`` and ``y``
    and the middle into ``y`` per row sub-block, so the pairs are matmuls over the blocks below the
    diagonal only. Just the ``sub x sub`` blocks on the diagonal take each pair's exponent on its
    own: ``C sub d`` exponentials instead of ``C^2 d``.

    Args:
      x, y: ``(B, H, C, d)``; g: ``(B, H, C, d)`` log decays (``<= 0``, ``-inf`` allowed);
      after: as above; sub: the sub-block length (a performance knob; ``C`` a multiple of it,
        else one block).
    Returns:
      ``(B, H, C, C)`` float32.
    """
    B, H, C, d = x.shape
    c = sub if 0 < sub < C and C % sub == 0 else C
    n = C // c
    blocks = lambda z: z.reshape(B, H, n, c, d)
    gb = blocks(g)
    i = jnp.arange(c)
    # [t, s]: the sum over s < u <= t, a short masked cumsum of same-signed terms (never a difference)
    rows, run = [], jnp.zeros_like(gb)  # a loop of sub steps: XLA's cumsum costs its window per element
    for t in range(c):
        run = run + jnp.where((t > i)[:, None], gb[:, :, :, t:t + 1], 0.0)
        rows.append(run)
    inside = jnp.stack(rows, axis=3)  # (B, H, n, t, s, d)
    prefix = inside[:, :, :, :, 0] + gb[:, :, :, :1]  # from the sub-block's start through t
    suffix = inside[:, :, :, -1]  # after s to the sub-block's end
    if not after:  # through t - 1
        shift = lambda z: jnp.concatenate([jnp.zeros_like(z[:, :, :, :1]), z[:, :, :, :-1]], axis=3)
        inside, prefix = shift(inside), shift(prefix)
    xs, ys = blocks(x) * jnp.exp(prefix), blocks(y) * jnp.exp(suffix)
    mask = jnp.tril(jnp.ones((c, c), bool), 0 if after else -1)
    own = jnp.einsum("zhatd,zhasd,zhatsd->zhats", blocks(x), blocks(y), masked_exp(inside, mask[..., None]))
    own = jnp.where(mask, own, 0.0)  # selected: a later position's NaN times a weight of 0 stays out
    total = jnp.sum(gb, axis=3)  # (B, H, n, d): each sub-block's log decay
    rows = []
    for a in range(n):  # only the blocks on and below the diagonal are formed
        mids, run = [], jnp.zeros_like(total[:, :, 0])
        for b in range(a - 1, -1, -1):  # the decay over the sub-blocks strictly between b and a
            mids.insert(0, run)
            run = run + total[:, :, b]
        row = [own[:, :, a], jnp.zeros((B, H, c, (n - 1 - a) * c), f32)]
        if a:
            Y = (ys[:, :, :a] * jnp.exp(jnp.stack(mids, axis=2))[:, :, :, None]).reshape(B, H, a * c, d)
            row.insert(0, jnp.einsum("zhtd,zhsd->zhts", xs[:, :, a], Y))
        rows.append(jnp.concatenate(row, axis=3))
    return jnp.concatenate(rows, axis=2)


def dplr_parts(qc, kc, gc, ac=None, bc=None, bonus=None, after: bool = True, decay_floor=None) -> DplrChunks:
    """The factors of one chunk of every head (see the module docstring).

    Args:
      qc, kc: ``(B, H, C, d_k)``; gc: ``(B, H, C, d_k)`` log decays; ac, bc: ``(B, H, C, d_k)`` the
        low-rank vectors, or None; bonus: ``(B, H, C)`` an extra weight of each position's own
        value (RWKV-5/6's ``u`` term), or None; after: read ``S_t`` (else ``S_{t-1}``);
        decay_floor: a static lower bound of every log decay, or None. Where the chunk's decays
        cannot underflow (``factorizable``), ``A_xy = tril((x e^R) (y e^-G)^T)`` is a matmul;
        otherwise ``blocked_pairs`` (every factor ``<= 1``) so strong decays underflow to 0 and
        nothing overflows.
    """
    C = kc.shape[2]
    G = jnp.cumsum(gc, axis=2)
    E = jnp.concatenate([jnp.zeros_like(G[:, :, :1]), G[:, :, :-1]], axis=2)  # through t - 1
    R = G if after else E
    if factorizable(decay_floor, C):
        inv = jnp.exp(-G)

        def pair(x, y, read):
            """``sum_d x_td y_sd exp(R_td - G_sd)`` over ``s <= t`` (a read after the update) or
            ``exp(E_td - G_sd)`` over ``s < t``: ``(B, H, C, C)``."""
            mask = jnp.tril(jnp.ones((C, C), bool), 0 if read and after else -1)
            return jnp.where(mask, jnp.einsum("bhtd,bhsd->bhts", x * jnp.exp(R if read else E), y * inv), 0.0)

        to_end = jnp.exp(G[:, :, -1:]) * inv
    else:
        pair = lambda x, y, read: blocked_pairs(x, y, gc, after=read and after)
        rev = jnp.flip(jnp.cumsum(jnp.flip(gc, 2), 2), 2)
        to_end = jnp.exp(jnp.concatenate([rev[:, :, 1:], jnp.zeros_like(rev[:, :, :1])], axis=2))  # over u > t
    qk = pair(qc, kc, True)
    if bonus is not None:
        qk = qk + bonus[..., :, None] * jnp.eye(C, dtype=f32)
    parts = dict(q_in=qc * jnp.exp(R), a_in=None, k_out=kc * to_end, b_out=None, decay=jnp.exp(G[:, :, -1]),
                 qk=qk, qb=None, ak=None, system=None)
    if ac is not None:
        parts.update(a_in=ac * jnp.exp(E), b_out=bc * to_end, qb=pair(qc, bc, True), ak=pair(ac, kc, False),
                     system=jnp.eye(C, dtype=f32) - pair(ac, bc, False))
    return DplrChunks(**parts)


def dplr_step(f: DplrChunks, S, vc):
    """The chunk's outputs ``(B, H, C, d_v)`` and the state after it, from its factors ``f``, the
    state ``S (B, H, d_v, d_k)`` entering it and its values ``vc (B, H, C, d_v)``."""
    O = jnp.einsum("bhtd,bhvd->bhtv", f.q_in, S) + f.qk @ vc
    S_next = f.decay[:, :, None, :] * S + jnp.einsum("bhtv,bhtd->bhvd", vc, f.k_out)
    if f.system is not None:
        rhs = jnp.einsum("bhtd,bhvd->bhtv", f.a_in, S) + f.ak @ vc
        # rows x_t; by matmuls, not jax's triangular solve: on CPU its LAPACK call waits on XLA's pool
        # inside a pool thread, and two at once on a two-thread pool never finish
        X = f.solved() @ rhs
        O = O + f.qb @ X
        S_next = S_next + jnp.einsum("bhtv,bhtd->bhvd", X, f.b_out)
    return O, S_next


@functools.partial(jax.jit, static_argnames=("chunk", "after", "decay_floor"))  # one compile when eager
def dplr_rule(q, k, v, log_w, a=None, b=None, bonus=None, chunk: int = 32, after: bool = True, decay_floor=None):
    """Outputs of the DPLR recurrence (float32, chunk by chunk; see the module docstring).

    Args:
      q, k: ``(B, H, L, d_k)`` queries (RWKV's receptance) and keys.
      v: ``(B, H, L, d_v)`` values.
      log_w: ``(B, H, L, d_k)`` log decays (``<= 0``).
      a, b: ``(B, H, L, d_k)`` the transition's low-rank vectors (``Diag(w_t) + a_t b_t^T``), or
        None for a diagonal transition.
      bonus: ``(B, H, L)``: ``o_t += bonus_t v_t`` (RWKV-5/6: ``sum_d q_td u_d k_td``), or None.
      chunk: positions per chunk (a performance knob: the numbers do not depend on it beyond
        float32 rounding).
      after: read ``o_t = S_t q_t`` (True) or ``S_{t-1} q_t`` (False).
      decay_floor: a static lower bound of ``log_w`` (RWKV-7: ``-e^-1/2``), or None: see
        ``dplr_parts`` (a speed knob; a bound the decays break gives wrong numbers, not an error).
    Returns:
      ``(B, H, L, d_v)`` float32.
    """
    if (a is None) != (b is None):
        raise ValueError("give both low-rank vectors a and b, or neither")
    B, H, L, dk = k.shape
    dv = v.shape[-1]
    C = max(1, min(chunk, L))
    Lp = -(-L // C) * C
    pad = lambda x: split_chunks(pad_positions(x, Lp), C)
    present = {name: x for name, x in dict(ac=a, bc=b, bonus=bonus).items() if x is not None}

    def step(S, xs):
        qc, kc, vc, gc, extra = xs
        O, S = dplr_step(dplr_parts(qc, kc, gc, **extra, after=after, decay_floor=decay_floor), S, vc)
        return S, O

    xs = tuple(pad(x) for x in (q, k, v, log_w)) + ({n: pad(x) for n, x in present.items()},)
    _, O = jax.lax.scan(step, jnp.zeros((B, H, dv, dk), f32), xs)
    return jnp.moveaxis(O, 0, 2).reshape(B, H, Lp, dv)[:, :, :L]


@functools.partial(jax.jit, static_argnames=("chunk", "after", "decay_floor"))  # one compile when eager
def dplr_factors(q, k, log_w, a=None, b=None, bonus=None, chunk: int = 32, after: bool = True,
                 decay_floor=None) -> DplrChunks:
    """``dplr_parts`` of every chunk, chunk-major (``(n, B, H, ...)``), for a kernel that runs the
    chunk recurrence; ``L`` a multiple of ``chunk`` (pad with zeros: no decay, no write)."""
    present = {name: split_chunks(x, chunk) for name, x in dict(ac=a, bc=b, bonus=bonus).items() if x is not None}
    xs = tuple(split_chunks(x, chunk) for x in (q, k, log_w))
    if a is None:  # every chunk at once (2x faster than mapped over chunks for RWKV-6 at L = 512)
        n = xs[0].shape[0]
        merged = lambda x: x.reshape((-1,) + x.shape[2:])
        f = dplr_parts(*map(merged, xs), **{name: merged(x) for name, x in present.items()}, after=after,
                       decay_floor=decay_floor)
        return jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), f)
    return jax.lax.map(lambda x: dplr_parts(*x[0], **x[1], after=after, decay_floor=decay_floor), (xs, present))


@functools.partial(jax.jit, static_argnames=("chunk", "after", "decay_floor"))  # one compile when eager
def dplr_matrix(q, k, log_w, a=None, b=None, bonus=None, chunk: int = 32, after: bool = True, decay_floor=None):
    """``M (B, H, L, L)`` float32 of the DPLR recurrence of each head: ``dplr_rule`` with the
    identity as values, so row ``i`` holds ``o_i``'s weights on ``v_0 ... v_{L-1}``.

    Formed by ``ops.grouped_transfer_matrix`` (``ops.transfer_matrix`` over groups of ``GROUP``
    positions): for values of earlier chunks ``X = (I - A_ab)^{-1} A_in S^T``,
    so a chunk reads ``R = Q_in + A_qb (I - A_ab)^{-1} A_in`` of the state and passes on ``P =
    Diag(decay) + B_out^T (I - A_ab)^{-1} A_in``; its own values give ``D = A_qk + A_qb (I -
    A_ab)^{-1} A_ak`` and ``J = K_out^T + B_out^T (I - A_ab)^{-1} A_ak`` (without ``a, b``: ``R =
    Q_in``, ``P = Diag(decay)``, ``D = A_qk``, ``J = K_out^T``).

    Args: as ``dplr_rule`` (no ``v``).
    Returns:
      ``(B, H, L, L)``: ``M[i, j] = k_j^T P_{j+1} ... P_i q_i`` with ``P_t = Diag(w_t) + b_t a_t^T``
      acting on key vectors (``after``; else ``... P_{i-1} q_i`` for ``j < i`` and ``bonus_i`` or 0
      on the diagonal), exactly 0 above the diagonal.
    """
    if (a is None) != (b is None):
        raise ValueError("give both low-rank vectors a and b, or neither")
    B, H, L, _ = k.shape
    C = max(1, min(chunk, L))
    Lp = -(-L // C) * C
    pad = lambda x: pad_positions(x, Lp)
    f = dplr_factors(*(pad(x) for x in (q, k, log_w, a, b, bonus)), chunk=C, after=after, decay_floor=decay_floor)
    T = lambda x: jnp.swapaxes(x, -1, -2)
    R, P, J, D = f.q_in, f.decay, T(f.k_out), f.qk
    if f.system is not None:
        inv = f.solved()
        Xa, Xk = inv @ f.a_in, inv @ f.ak  # the low-rank reads per unit of state / own value
        R, D = R + f.qb @ Xa, D + f.qb @ Xk
        P = P[..., :, None] * jnp.eye(P.shape[-1], dtype=f32) + T(f.b_out) @ Xa
        J = J + T(f.b_out) @ Xk
    M = grouped_transfer_matrix(R, P, J, D, -(-GROUP // C))[:, :, :L, :L]
    return jnp.where(jnp.tril(jnp.ones((L, L), bool), 0 if after or bonus is not None else -1), M, 0.0)


__all__ = ["FACTOR_LIMIT", "factorizable", "SUB", "blocked_pairs", "DplrChunks", "dplr_parts", "dplr_step", "dplr_rule", "dplr_factors", "dplr_matrix"]
