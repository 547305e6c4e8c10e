"""The Pallas kernels: tiled materialize, fused channel reductions, softmax row statistics.

One kernel family for every block: a tile of ``H_c`` is the plan's pre-conv tile
(``tiles.py``), then the banded conv (two ``(T, T)`` matmuls: the conv reaches at most
``K - 1 <= T`` columns into the next tile), then the optional document mask.
Tiles above the diagonal are written as zeros without computing anything.

Grids: materialize ``(B, n, nt, nt)`` with one ``(T, T)`` output tile per step;
reduce ``(B, nt, nt)`` with a loop over channels inside the kernel, so only
``(B, L, L)`` is ever written; softmax statistics ``(B, n, nt)``. Every grid axis is
independent (no revisited outputs), as the GPU backends require.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...operator import apply_mode
from . import tiles
from .plans import Plan

f32 = jnp.float32


class _Refs:
    """Named access to the kernel's input refs for channel ``c`` (local to the block)."""

    def __init__(self, names, refs, T):
        self.r = dict(zip(names, refs))
        self.T = T

    def has(self, name):
        return name in self.r

    def row(self, name, c, tile):
        """``(T,)`` entries of tile ``tile`` of a per-channel row."""
        return self.r[name][0, c, pl.ds(tile * self.T, self.T)]

    def full(self, name, c):
        return self.r[name][0, c, :]

    def small(self, name, c):
        return self.r[name][c, :]

    def time_tile(self, name, tile, g=None):
        """Tile ``tile`` of a shared per-example array (``(B, Lin, N)`` or ``(B, G, Lin, N)``)."""
        ref = self.r[name]
        sl = pl.ds(tile * self.T, self.T)
        return ref[0, sl, :] if g is None else ref[0, g, sl, :]


def _pre_tile(kind: str, R: _Refs, c, I, J):
    """Tile ``(I, J)`` (``J <= I``) of ``H_c`` before the conv: ``(T, T)`` float32."""
    T = R.T
    if kind == "softmax":
        wu = R.small("wu", c)
        lg = tiles.decay_rows_logits(R.row("k", c, J), wu[0], wu[1], I * T, J * T, T)
        P = jnp.exp(lg - R.row("m", c, I)[:, None]) / R.row("z", c, I)[:, None]
        return R.row("gate", c, I)[:, None] * P if R.has("gate") else P
    tI, tJ = R.row("t", c, I), R.row("t", c, J)
    mid = tiles.between(R.full("tot", c), I, J)
    if kind == "scalar":
        H = tiles.scalar_decay_tile(tI, tJ, mid, I == J)
        if R.has("q"):
            g = R.small("gidx", c)[0]
            H = H * tiles.dot_t(R.time_tile("q", I, g), R.time_tile("k", J, g))
        if R.has("left"):
            H = R.row("left", c, I)[:, None] * H
        if R.has("right"):
            H = H * R.row("right", c, J)[None, :]
    else:  # state: the scalings are folded into the (T, N) factors
        qI, kJ = R.time_tile("q", I), R.time_tile("k", J)
        if R.has("left"):
            qI = qI * R.row("left", c, I)[:, None]
        if R.has("right"):
            kJ = kJ * R.row("right", c, J)[:, None]
        H = tiles.state_decay_tile(qI, kJ, R.small("A", c), tI, tJ, mid, I == J)
    if R.has("diag"):
        a, b = tiles.iota2(T)
        H = H + jnp.where((a == b) & (I == J), R.row("diag", c, I)[:, None], 0.0)
    return H


def _tile(kind: str, R: _Refs, c, I, J):
    """Tile ``(I, J)`` (``J <= I``) of the full ``H_c``: conv and document mask applied."""
    T = R.T
    if not R.has("conv_w"):
        H = _pre_tile(kind, R, c, I, J)
    else:
        M0, M1 = tiles.conv_bands(R.small("conv_w", c), T)
        # Column tile J+1 (if not above the diagonal) in a loop, so the tile math is traced once.
        def step(s, acc):
            return acc + tiles.dot(_pre_tile(kind, R, c, I, J + s), jnp.where(s == 0, M0, M1))

        H = jax.lax.fori_loop(0, 1 + (J + 1 <= I).astype(jnp.int32), step, jnp.zeros((T, T), f32))
    if R.has("seg"):
        sl = lambda t: R.r["seg"][0, pl.ds(t * T, T)]
        H = jnp.where(sl(I)[:, None] == sl(J)[None, :], H, 0.0)
    return H


def _specs(plan: Plan, chan_block, chan_index, small_block, small_index, shared_index):
    """Input arrays and BlockSpecs in a fixed order (names returned alongside)."""
    names, arrays, specs = [], [], []
    for name, x in sorted(plan.chan.items()):
        names.append(name)
        arrays.append(x)
        specs.append(pl.BlockSpec(chan_block(x), chan_index))
    for name, x in sorted(plan.small.items()):
        names.append(name)
        arrays.append(x)
        specs.append(pl.BlockSpec(small_block(x), small_index))
    for name, x in sorted(plan.shared.items()):
        names.append(name)
        arrays.append(x)
        rest = x.shape[1:]
        specs.append(pl.BlockSpec((1,) + rest, shared_index(len(rest))))
    return names, arrays, specs


def materialize(plan: Plan, interpret: bool):
    """Dense ``(B, n, L, L)`` float32 of the plan's channels."""
    B, n = _batch_channels(plan)
    T, Lp = plan.T, plan.Lp
    nt = Lp // T
    names, arrays, specs = _specs(
        plan,
        chan_block=lambda x: (1, 1, x.shape[-1]), chan_index=lambda b, c, I, J: (b, c, 0),
        small_block=lambda x: (1, x.shape[-1]), small_index=lambda b, c, I, J: (c, 0),
        shared_index=lambda r: (lambda b, c, I, J: (b,) + (0,) * r))

    def kernel(*refs):
        R = _Refs(names, refs[:-1], T)
        o = refs[-1]
        I, J = pl.program_id(2), pl.program_id(3)

        @pl.when(J > I)
        def _():
            o[...] = jnp.zeros(o.shape, f32)

        @pl.when(J <= I)
        def _():
            o[0, 0] = _tile(plan.kind, R, 0, I, J)

    out = pl.pallas_call(
        kernel, grid=(B, n, nt, nt), in_specs=specs,
        out_specs=pl.BlockSpec((1, 1, T, T), lambda b, c, I, J: (b, c, I, J)),
        out_shape=jax.ShapeDtypeStruct((B, n, Lp, Lp), f32), interpret=interpret)(*arrays)
    L = plan.L
    return out if Lp == L else out[:, :, :L, :L]


def reduce(plan: Plan, mode, qw, kw, interpret: bool):
    """``sum_c qw[b,c,i] f(H_c[i, j]) kw[b,c,j]`` -> ``(B, L, L)``; ``f`` is the identity,
    ``abs`` or ``max(., 0)`` for ``mode`` (int32 scalar array) 0, 1, 2 (``operator.MODES``).
    ``qw, kw (B, n, L)`` float32. Only ``(B, L, L)`` is written."""
    B, n = _batch_channels(plan)
    T, Lp, L = plan.T, plan.Lp, plan.L
    nt = Lp // T
    Lin = next(iter(plan.chan.values())).shape[-1]
    pad = lambda w: jnp.pad(w.astype(f32), ((0, 0), (0, 0), (0, Lin - L)))
    small = dict(plan.small, mode=jnp.broadcast_to(jnp.asarray(mode, jnp.int32), (n, 1)))
    plan = Plan(plan.kind, L, Lp, T, dict(plan.chan, qw=pad(qw), kw=pad(kw)), small, plan.shared)
    names, arrays, specs = _specs(
        plan,
        chan_block=lambda x: (1,) + x.shape[1:], chan_index=lambda b, I, J: (b, 0, 0),
        small_block=lambda x: x.shape, small_index=lambda b, I, J: (0, 0),
        shared_index=lambda r: (lambda b, I, J: (b,) + (0,) * r))

    def kernel(*refs):
        R = _Refs(names, refs[:-1], T)
        o = refs[-1]
        I, J = pl.program_id(1), pl.program_id(2)

        @pl.when(J > I)
        def _():
            o[...] = jnp.zeros(o.shape, f32)

        @pl.when(J <= I)
        def _():
            def body(c, acc):
                H = apply_mode(_tile(plan.kind, R, c, I, J), R.small("mode", c)[0])
                return acc + R.row("qw", c, I)[:, None] * H * R.row("kw", c, J)[None, :]

            o[0] = jax.lax.fori_loop(0, n, body, jnp.zeros((T, T), f32))

    out = pl.pallas_call(
        kernel, grid=(B, nt, nt), in_specs=specs,
        out_specs=pl.BlockSpec((1, T, T), lambda b, I, J: (b, I, J)),
        out_shape=jax.ShapeDtypeStruct((B, Lp, Lp), f32), interpret=interpret)(*arrays)
    return out if Lp == L else out[:, :L, :L]


def softmax_stats(plan: Plan, interpret: bool) -> Plan:
    """Row max ``m`` and normaliser ``z = sum_j exp(l[i, j] - m[i])`` of every RWKV row
    (online over the column tiles ``J <= I``, as flash attention does); returns the plan
    with ``m, z (B, n, Lin)`` added."""
    B, n = _batch_channels(plan)
    T, Lp = plan.T, plan.Lp
    nt = Lp // T
    Lin = plan.chan["k"].shape[-1]

    def kernel(k_ref, wu_ref, m_ref, z_ref):
        I = pl.program_id(2)
        wu = wu_ref[0, :]

        def body(J, mz):
            m, z = mz
            lg = tiles.decay_rows_logits(k_ref[0, 0, pl.ds(J * T, T)], wu[0], wu[1], I * T, J * T, T)
            m_new = jnp.maximum(m, jnp.max(lg, axis=1))
            z = z * jnp.exp(m - m_new) + jnp.sum(jnp.exp(lg - m_new[:, None]), axis=1)
            return m_new, z

        m0 = jnp.full((T,), -jnp.inf, f32)
        m, z = jax.lax.fori_loop(0, I + 1, body, (m0, jnp.zeros((T,), f32)))
        m_ref[0, 0] = m
        z_ref[0, 0] = z

    m, z = pl.pallas_call(
        kernel, grid=(B, n, nt),
        in_specs=[pl.BlockSpec((1, 1, Lin), lambda b, c, I: (b, c, 0)),
                  pl.BlockSpec((1, 2), lambda b, c, I: (c, 0))],
        out_specs=[pl.BlockSpec((1, 1, T), lambda b, c, I: (b, c, I))] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, n, Lp), f32)] * 2,
        interpret=interpret)(plan.chan["k"], plan.small["wu"])
    padl = lambda x, v: jnp.pad(x, ((0, 0), (0, 0), (0, Lin - Lp)), constant_values=v)
    chan = dict(plan.chan, m=padl(m, 0.0), z=padl(z, 1.0))
    return Plan(plan.kind, plan.L, Lp, T, chan, plan.small, plan.shared)


def _batch_channels(plan: Plan):
    x = next(iter(plan.chan.values()))
    return x.shape[0], x.shape[1]
