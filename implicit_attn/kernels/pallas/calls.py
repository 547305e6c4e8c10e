"""The Pallas kernels: tiled materialize, fused channel reduction, softmax row statistics
(RWKV-4's and attention's).

One kernel family for every block: a tile of ``H_c`` is the plan's pre-conv tile, then
the banded conv (two ``(T, T)`` matmuls: the conv reaches at most ``K - 1 <= T`` columns
into the next column tile), then the optional document mask. Tiles above the diagonal
are written as zeros without computing anything.

Every input reaches the kernel through a ``BlockSpec`` whose index map follows the grid
``(B, nt, nt, channel blocks)``: per-position rows arrive as the ``(T, 1)`` column of the
row tile ``I`` or the ``(1, T)`` row of the column tile ``J`` (and ``J + 1`` for the
conv); nothing is sliced inside the kernel. The output has its exact shape; the ragged
last tile is a partial block (inputs are zero-padded to whole tiles).

The same kernels are built for three targets (``TARGETS``): interpret mode (CPU, tests),
Triton (GPU) and Mosaic (TPU). They differ only in the smallest tile and in how ``reduce``
visits channels: a loop inside the kernel over all channels (Triton runs grid steps in
parallel, so an output tile cannot be revisited), or a sequential last grid axis of one
channel per step that accumulates into the output tile (Mosaic keeps VMEM at one
channel's inputs).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from ...operator import apply_mode
from ...ops import any_in_batch
from . import tiles
from .plans import HeadMatrixPlan, Plan, next_pow2

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Target:
    """How the kernels are built for one lowering platform.

    Attributes:
      name: ``"interpret"``, ``"triton"`` or ``"mosaic_tpu"``.
      channel_grid: ``reduce`` visits channels as a sequential grid axis (else a loop).
    """

    name: str
    channel_grid: bool

    def tile(self, tile: int) -> int:
        """The tile edge used for a requested ``tile``: Triton needs a power of two >= 16
        (its smallest dot), Mosaic TPU a multiple of 128 (the lane width)."""
        if self.name == "triton":
            return max(16, next_pow2(tile))
        if self.name == "mosaic_tpu":
            return -(-tile // 128) * 128
        return tile

    def call(self, kernel, *, grid, in_specs, out_specs, out_shape, sequential_last: bool = False,
             scratch_shapes=()):
        """``pl.pallas_call`` for this target."""
        kw = {"scratch_shapes": scratch_shapes} if scratch_shapes else {}
        if self.name == "triton":
            kw["compiler_params"] = pltriton.CompilerParams(num_warps=4, num_stages=1)
        elif self.name == "mosaic_tpu":
            sem = ("parallel",) * (len(grid) - 1) + ("arbitrary" if sequential_last else "parallel",)
            kw["compiler_params"] = pltpu.CompilerParams(dimension_semantics=sem)
        return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                              interpret=self.name == "interpret", **kw)

    def store(self, ref, value, rows: int, cols: int):
        """``ref[...] = value`` for a ``(T, T)`` output tile of which only the first ``rows``
        rows and ``cols`` columns lie inside the array (the ragged last tiles). Triton does
        not mask a partial block itself (the rest would land in the next rows), so the
        store is masked there; interpret mode and Mosaic drop out-of-bounds entries."""
        if self.name == "triton":
            inside = (tiles.iota2(value.shape, 0) < rows) & (tiles.iota2(value.shape, 1) < cols)
            pltriton.store(ref, value, mask=inside)
        else:
            ref[...] = value


TARGETS = {"interpret": Target("interpret", channel_grid=False),
           "triton": Target("triton", channel_grid=False),
           "mosaic_tpu": Target("mosaic_tpu", channel_grid=True)}


class _Inputs:
    """Kernel inputs with their BlockSpecs, on the grid ``(b, I, J, c)`` with ``Cb``
    channels per block. Keys are ``(name, side)``; ``side`` is ``"i"`` (row tile),
    ``"j0"`` / ``"j1"`` (column tile ``J`` / ``J + 1``) or None."""

    def __init__(self, nt: int, Cb: int):
        self.nt, self.Cb = nt, Cb
        self.keys, self.arrays, self.specs = [], [], []

    def _tile(self, side, I, J):
        return {"i": I, "j0": J, "j1": jnp.minimum(J + 1, self.nt - 1)}[side]

    def add(self, key, array, block, index):
        self.keys.append(key)
        self.arrays.append(array)
        self.specs.append(pl.BlockSpec(block, index))

    def col(self, name, x, side, T):
        """``(B, n, Lp)`` -> ``(T, 1)`` per channel, of tile ``side``."""
        self.add((name, side), x[..., None], (1, self.Cb, T, 1),
                 lambda b, I, J, c: (b, c, self._tile(side, I, J), 0))

    def row(self, name, x, side, T):
        """``(B, n, Lp)`` -> ``(1, T)`` per channel, of tile ``side``."""
        self.add((name, side), x[:, :, None, :], (1, self.Cb, 1, T),
                 lambda b, I, J, c: (b, c, 0, self._tile(side, I, J)))

    def per_channel(self, name, x, side, T):
        """``(B, n, Lp, X)`` -> ``(T, X)`` per channel, of tile ``side``."""
        self.add((name, side), x, (1, self.Cb, T, x.shape[-1]),
                 lambda b, I, J, c: (b, c, self._tile(side, I, J), 0))

    def param(self, name, p):
        """``(n, X)`` -> ``(1, X)`` per channel."""
        self.add((name, None), p[:, None, :], (self.Cb, 1, p.shape[-1]), lambda b, I, J, c: (c, 0, 0))

    def time_tile(self, name, x, side, T, axis: int):
        """A per-example array with time on ``axis`` (full along every other axis)."""
        block = tuple(T if a == axis else (1 if a == 0 else s) for a, s in enumerate(x.shape))

        def index(b, I, J, c):
            return tuple(b if a == 0 else (self._tile(side, I, J) if a == axis else 0) for a in range(x.ndim))

        self.add((name, side), x, block, index)


class _Tile:
    """The tile math's view of the kernel's refs for local channel ``cl``.

    ``qk``: side -> the ``G`` tiles ``(T, T)`` of ``q_g k_g^T`` when computed once for all
    the channels of a kernel step (``reduce``), else None (computed per channel)."""

    def __init__(self, plan: Plan, refs: dict, cl, qk: dict | None = None):
        self.plan, self.refs, self.cl, self.qk_cache = plan, refs, cl, qk

    def has(self, name, side="i"):
        return (name, side) in self.refs

    def col(self, name, side="i"):
        return self.refs[(name, side)][0, self.cl]

    row = col  # same indexing: the BlockSpec fixed the layout, (T, 1) or (1, T)

    def param(self, name):
        return self.refs[(name, None)][self.cl]

    def mid(self, Jx):
        return tiles.pick(self.refs[("mid", "i")][0, self.cl, 0], Jx, 1)

    def shared(self, name, side):
        return self.refs[(name, side)][0]

    def select_group(self, per_group: list):
        """The entry of ``per_group`` (one array per group) for this channel's group: a
        select over the ``G`` groups (no scalar read, no gather)."""
        if len(per_group) == 1:
            return per_group[0]
        g = self.param("group")  # (1, 1)
        return sum(jnp.where(g == gi, x, 0.0) for gi, x in enumerate(per_group))

    def qk(self, side):
        """``(T, T)`` tile of ``q_g k_g^T`` (rows: tile I; columns: tile ``side``)."""
        if self.qk_cache is not None:
            return self.select_group(self.qk_cache[side])
        q, k = self.refs[("q", "i")], self.refs[("k", side)]
        if self.plan.heads:
            return tiles.dot_t(q[0, self.cl], k[0, self.cl])
        return tiles.dot_t(self.select_group([q[0, g] for g in range(q.shape[1])]),
                           self.select_group([k[0, g] for g in range(k.shape[1])]))


def group_products(refs: dict, sides) -> dict | None:
    """side -> ``[q_g k_g^T]`` tiles of every group, for a kernel step that reuses them
    across its channels (None if the plan has no per-group ``q, k``)."""
    if ("q", "i") not in refs or ("k", "j0") not in refs or refs[("q", "i")].ndim != 4:
        return None
    q = refs[("q", "i")]
    return {s: [tiles.dot_t(q[0, g], refs[("k", s)][0, g]) for g in range(q.shape[1])] for s in sides}


def _pre_tile(R: _Tile, I, Jx, side):
    """Tile ``(I, Jx)`` (``Jx <= I``) of ``H_c`` before the conv: ``(T, T)`` float32."""
    plan, T = R.plan, R.plan.T
    is_diag = Jx == I
    if plan.kind == "attention":
        alpha, slope = (R.param(name) if R.has(name, None) else None for name in ("alpha", "slope"))

        def probs(m):
            """The probabilities at the keys ``m`` columns right of the tile's (LaS's pooling)."""
            tag = f"{m:+d}" if m else ""
            lg, vis = tiles.attention_logits(R.col("q"), R.col("k" + tag, side), R.shared("seg_col", "i"),
                                             R.shared(f"seg{tag}_row", side), I * T, Jx * T + m, plan.window,
                                             alpha, slope)
            # where(): a NaN row (a NaN logit, as in XLA's softmax) keeps exact zeros where masked
            return jnp.where(vis, jnp.exp(lg - R.col("m")) / R.col("z"), 0.0), vis

        H, visible = probs(0)
        if plan.pool > 1:  # LaS: the mean over the window's keys, summed in ops.pool_rows' order
            pooled = None
            for m in range(plan.pool_lo, plan.pool_lo + plan.pool):
                Hm = H if m == 0 else probs(m)[0]
                pooled = Hm if pooled is None else pooled + Hm
            H = jnp.where(visible, pooled / plan.pool, 0.0)
    elif plan.kind == "softmax":
        lg = tiles.decay_rows_logits(R.row("k", side), R.param("w"), R.param("u"), I * T, Jx * T, T)
        H = jnp.exp(lg - R.col("m")) / R.col("z")
        if R.has("gate"):
            H = R.col("gate") * H
    elif plan.kind == "scalar":
        offset = R.col("row_log") + R.row("col_log", side) if R.has("row_log") else None
        H = tiles.scalar_decay(R.col("t"), R.col("P"), R.mid(Jx), R.row("S", side), is_diag, plan.nan_safe, offset)
        if R.has("q"):
            H = H * R.qk(side)
        if R.has("left"):
            H = R.col("left") * H
        if R.has("right", side):
            H = H * R.row("right", side)
    else:  # state: the scalings are folded into the (T, N) factors
        q, k, kT = R.shared("q", "i"), R.shared("k", side), R.shared("kT", side)
        if R.has("left"):
            q = q * R.col("left")
        if R.has("right", side):
            k = k * R.col("right_col", side)
            kT = kT * R.row("right", side)
        H = tiles.state_decay(q, k, kT, R.param("A"), R.col("t"), R.col("P"), R.mid(Jx),
                              R.col("S_col", side), is_diag, plan.nan_safe)
    if R.has("diag"):
        H = tiles.add_diagonal(H, R.col("diag"), is_diag)
    return tiles.keep_lower(H, is_diag)  # before the conv, which reads entries above the diagonal


def _tile(R: _Tile, I, J):
    """Tile ``(I, J)`` (``J <= I``) of the full ``H_c``: conv and document mask applied."""
    plan, T = R.plan, R.plan.T
    if plan.kind == "band":  # the conv matrix itself, scaled on both sides
        right = R.row("right", "j0") if R.has("right", "j0") else None
        return tiles.band(R.param("conv_w"), plan.conv, I, J, R.col("left"), right)
    if not plan.conv:
        H = _pre_tile(R, I, J, "j0")
    else:
        M0, M1 = tiles.conv_bands(R.param("conv_w"), plan.conv, T)
        B0, B1 = tiles.conv_reach(plan.conv, T)

        def band(H, M, reach):  # nan_safe: a NaN of H reaches only the columns the conv reads it into
            return tiles.nan_matmul(H, M, reach, 0) if plan.nan_safe else tiles.dot(H, M)

        H = band(_pre_tile(R, I, J, "j0"), M0, B0)
        H = H + jax.lax.cond(J + 1 <= I, lambda: band(_pre_tile(R, I, J + 1, "j1"), M1, B1),
                             lambda: jnp.zeros((T, T), f32))
        # an inf of H (overflow of huge finite inputs: not NaN, so the plain band matmul) times
        # the band's zeros is NaN in every column of its row, above the diagonal too
        H = tiles.keep_lower(H, J == I)
    if R.has("seg_col"):
        H = jnp.where(R.shared("seg_col", "i") == R.shared("seg_row", "j0"), H, 0.0)
    return H


def has_nan(plan: Plan):
    """Traced bool: whether any float input of the plan's tiles holds a NaN (then the kernels
    take the NaN-safe tiles, ``Plan.nan_safe``)."""
    arrays = [*plan.vec.values(), plan.mid, *plan.param.values(), *plan.shared.values()]
    flags = [jnp.isnan(x).any() for x in arrays if x is not None and jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.any(jnp.stack(flags)) if flags else jnp.asarray(False)


def nan_safe_call(plan: Plan, call):
    """``call(plan)`` with the NaN-safe tiles where the plan's inputs hold a NaN, the plain ones
    (fewer matmuls) elsewhere: the two kernels under one ``lax.cond``; under ``jax.vmap`` the
    NaN-safe tiles for the whole batch if any example holds a NaN (``ops.any_in_batch``: a batched
    predicate would run both kernels). Tiles without a matmul that could spread a NaN (no
    in-tile segment sums, no conv matmul: RWKV-4's, attention's, the band's) are one kernel."""
    if plan.kind in ("attention", "band") or (plan.kind == "softmax" and not plan.conv):
        return call(plan)
    return jax.lax.cond(any_in_batch(has_nan(plan)), lambda: call(dataclasses.replace(plan, nan_safe=True)),
                        lambda: call(plan))


def _plan_inputs(plan: Plan, Cb: int) -> _Inputs:
    """Every input the tiles of ``plan`` read, laid out for their BlockSpecs."""
    T, nt = plan.T, plan.nt
    inp = _Inputs(nt, Cb)
    sides = ("j0", "j1") if plan.conv else ("j0",)
    v = plan.vec
    if plan.kind == "softmax":
        for name in ("m", "z", "gate"):
            if name in v:
                inp.col(name, v[name], "i", T)
        for s in sides:
            inp.row("k", v["k"], s, T)
        inp.param("w", plan.param["w"])
        inp.param("u", plan.param["u"])
    elif plan.kind == "band":
        inp.col("left", v["left"], "i", T)
        if "right" in v:
            inp.row("right", v["right"], "j0", T)
    elif plan.kind == "attention":
        for name in ("m", "z"):
            inp.col(name, v[name], "i", T)
        inp.per_channel("q", plan.shared["q"], "i", T)
        inp.per_channel("k", plan.shared["k"], "j0", T)
        for name in ("alpha", "slope"):
            if name in plan.param:
                inp.param(name, plan.param[name])
        for m in range(plan.pool_lo, plan.pool_lo + plan.pool) if plan.pool > 1 else ():
            if m:  # LaS's pooling: keys and block ids shifted by m
                inp.per_channel(f"k{m:+d}", plan.shared[f"k{m:+d}"], "j0", T)
                inp.time_tile(f"seg{m:+d}_row", plan.shared[f"seg{m:+d}"][:, None, :], "j0", T, 2)
    else:
        for name in ("t", "P", "left", "diag", "row_log"):
            if name in v:
                inp.col(name, v[name], "i", T)
        inp.add(("mid", "i"), plan.mid[:, :, :, None, :], (1, Cb, 1, 1, plan.mid.shape[-1]),
                lambda b, I, J, c: (b, c, I, 0, 0))
        for s in sides:
            if plan.kind == "scalar":
                inp.row("S", v["S"], s, T)
            else:
                inp.col("S_col", v["S"], s, T)
            if "col_log" in v:
                inp.row("col_log", v["col_log"], s, T)
            if "right" in v:
                inp.row("right", v["right"], s, T)
                if plan.kind == "state":
                    inp.col("right_col", v["right"], s, T)
        for name in ("A", "group"):
            if name in plan.param:
                inp.param(name, plan.param[name])
        if "q" in plan.shared and plan.heads:  # one q, k per channel
            inp.per_channel("q", plan.shared["q"], "i", T)
            for s in sides:
                inp.per_channel("k", plan.shared["k"], s, T)
        elif "q" in plan.shared:
            q, k = plan.shared["q"], plan.shared["k"]
            axis = q.ndim - 2
            inp.time_tile("q", q, "i", T, axis)
            for s in sides:
                inp.time_tile("k", k, s, T, axis)
                if plan.kind == "state":
                    inp.time_tile("kT", jnp.swapaxes(k, 1, 2), s, T, 2)
    if plan.conv:
        inp.param("conv_w", plan.param["conv_w"])
    if "seg" in plan.shared:
        seg = plan.shared["seg"]
        inp.time_tile("seg_col", seg[:, :, None], "i", T, 1)
        inp.time_tile("seg_row", seg[:, None, :], "j0", T, 2)
    return inp


def _channels(plan: Plan) -> tuple[int, int]:
    x = next(iter(plan.vec.values()))
    return x.shape[0], x.shape[1]


def materialize(plan: Plan, target: Target):
    """Dense ``(B, n, L, L)`` float32 of the plan's channels: one ``(T, T)`` tile per step."""
    B, n = _channels(plan)
    T, nt, L = plan.T, plan.nt, plan.L
    inp = _plan_inputs(plan, 1)

    def kernel(*refs):
        R = _Tile(plan, dict(zip(inp.keys, refs[:-1])), 0)
        o = refs[-1]
        I, J = pl.program_id(1), pl.program_id(2)
        store = lambda value: target.store(o.at[0, 0], value, L - I * T, L - J * T)
        first = plan.first_key_tile(I)

        @pl.when((J > I) | (J < first))
        def _():
            store(jnp.zeros((T, T), f32))

        @pl.when((J <= I) & (J >= first))
        def _():
            store(_tile(R, I, J))

    return target.call(
        kernel, grid=(B, nt, nt, n), in_specs=inp.specs,
        out_specs=pl.BlockSpec((1, 1, T, T), lambda b, I, J, c: (b, c, I, J)),
        out_shape=jax.ShapeDtypeStruct((B, n, L, L), f32))(*inp.arrays)


def reduce(plan: Plan, mode, qw, kw, target: Target):
    """``sum_c qw[b,c,i] f(H_c[i, j]) kw[b,c,j]`` -> ``(B, L, L)``; ``f`` is the identity,
    ``abs`` or ``max(., 0)`` for ``mode`` (int32 scalar array) 0, 1, 2 (``operator.MODES``).
    ``qw, kw (B, n, L)`` float32. Only ``(B, L, L)`` is written."""
    B, n = _channels(plan)
    T, nt, L, Lp = plan.T, plan.nt, plan.L, plan.Lp
    Cb, nC = (1, n) if target.channel_grid else (n, 1)
    inp = _plan_inputs(plan, Cb)
    pad = lambda w: jnp.pad(w.astype(f32), ((0, 0), (0, 0), (0, Lp - L)))
    inp.col("qw", pad(qw), "i", T)
    inp.row("kw", pad(kw), "j0", T)
    inp.add(("mode", None), jnp.reshape(jnp.asarray(mode, jnp.int32), (1, 1)), (1, 1), lambda b, I, J, c: (0, 0))

    def kernel(*refs):
        refd = dict(zip(inp.keys, refs[:-1]))
        o = refs[-1]
        I, J, c = pl.program_id(1), pl.program_id(2), pl.program_id(3)
        mode_ = refd[("mode", None)][...]
        first = plan.first_key_tile(I)

        def channels():
            # The channels of one step share their group's q k^T tiles: one matmul per group.
            # (a plan of heads, or attention, has one q, k per channel: nothing to share)
            shared = Cb > 1 and plan.kind == "scalar" and not plan.heads
            qk = group_products(refd, ("j0", "j1") if plan.conv else ("j0",)) if shared else None

            def body(cl, acc):
                R = _Tile(plan, refd, cl, qk)
                H = apply_mode(_tile(R, I, J), mode_)
                return acc + R.col("qw") * H * R.row("kw", "j0")

            zero = jnp.zeros((T, T), f32)
            return body(0, zero) if Cb == 1 else jax.lax.fori_loop(0, Cb, body, zero)

        if nC == 1:
            store = lambda value: target.store(o.at[0], value, L - I * T, L - J * T)

            @pl.when((J > I) | (J < first))
            def _():
                store(jnp.zeros((T, T), f32))

            @pl.when((J <= I) & (J >= first))
            def _():
                store(channels())
        else:
            @pl.when(c == 0)
            def _():
                o[...] = jnp.zeros(o.shape, f32)

            @pl.when((J <= I) & (J >= first))
            def _():
                o[0] = o[0] + channels()

    return target.call(
        kernel, grid=(B, nt, nt, nC), in_specs=inp.specs,
        out_specs=pl.BlockSpec((1, T, T), lambda b, I, J, c: (b, I, J)),
        out_shape=jax.ShapeDtypeStruct((B, L, L), f32), sequential_last=nC > 1)(*inp.arrays)


def softmax_stats(plan: Plan, target: Target) -> Plan:
    """Row max ``m`` and normaliser ``z = sum_j exp(l[i, j] - m[i])`` of every RWKV row
    (online over the column tiles ``J <= I``, as flash attention does); returns the plan
    with ``m, z (B, n, Lp)`` added."""
    B, n = _channels(plan)
    T, nt, Lp = plan.T, plan.nt, plan.Lp
    ntp = next_pow2(nt)
    k4 = jnp.pad(plan.vec["k"], ((0, 0), (0, 0), (0, ntp * T - Lp))).reshape(B, n, ntp, T)
    w, u = plan.param["w"][:, None, :], plan.param["u"][:, None, :]  # (n, 1, 1)

    def kernel(k_ref, w_ref, u_ref, m_ref, z_ref):
        I = pl.program_id(1)
        wc, uc = w_ref[0], u_ref[0]

        def body(J, mz):
            m, z = mz
            lg = tiles.decay_rows_logits(k_ref[0, 0, pl.ds(J, 1), :], wc, uc, I * T, J * T, T)
            m_new = tiles.maximum(m, tiles.row_max(lg))
            # A row whose entries so far are all -inf (w = -inf) keeps m = -inf: shift by 0.
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            z = z * jnp.exp(m - shift) + jnp.sum(jnp.exp(lg - shift), axis=1, keepdims=True)
            return m_new, z

        m0 = jnp.full((T, 1), -jnp.inf, f32)
        m, z = jax.lax.fori_loop(0, I + 1, body, (m0, jnp.zeros((T, 1), f32)))
        m_ref[0, 0] = m
        z_ref[0, 0] = z

    m, z = target.call(
        kernel, grid=(B, nt, n),
        in_specs=[pl.BlockSpec((1, 1, ntp, T), lambda b, I, c: (b, c, 0, 0)),
                  pl.BlockSpec((1, 1, 1), lambda b, I, c: (c, 0, 0)),
                  pl.BlockSpec((1, 1, 1), lambda b, I, c: (c, 0, 0))],
        out_specs=[pl.BlockSpec((1, 1, T, 1), lambda b, I, c: (b, c, I, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, n, Lp, 1), f32)] * 2)(k4, w, u)
    vec = dict(plan.vec, m=m[..., 0], z=z[..., 0])
    return dataclasses.replace(plan, vec=vec)


def attention_stats(plan: Plan, target: Target) -> Plan:
    """Row max ``m`` and normaliser ``z = sum_j exp(l[i, j] - m[i])`` of every head's masked
    logits (online over the column tiles from ``Plan.first_key_tile`` to ``I``; LaS's distance
    terms included); returns the plan with ``m, z (B, n, Lp)`` in its ``vec``."""
    q, k, seg = plan.shared["q"], plan.shared["k"], plan.shared["seg"]
    B, n, Lp, d = q.shape
    T, W = plan.T, plan.window
    nt = Lp // T
    ntp = next_pow2(nt)  # whole-row blocks: Triton's block dimensions are powers of two
    k = jnp.pad(k, ((0, 0), (0, 0), (0, ntp * T - Lp), (0, 0)))
    seg_rows = jnp.pad(seg, ((0, 0), (0, ntp * T - Lp)), constant_values=-1).reshape(B, ntp, T)
    terms = [name for name in ("alpha", "slope") if name in plan.param]

    def kernel(q_ref, k_ref, seg_col_ref, seg_row_ref, *refs):
        I = pl.program_id(1)
        qI, seg_col = q_ref[0, 0], seg_col_ref[0]
        given = dict(zip(terms, (r[0] for r in refs[:len(terms)])))
        m_ref, z_ref = refs[len(terms):]

        def body(J, mz):
            m, z = mz
            lg, _ = tiles.attention_logits(qI, k_ref[0, 0, pl.ds(J * T, T), :], seg_col,
                                           seg_row_ref[0, pl.ds(J, 1), :], I * T, J * T, W,
                                           given.get("alpha"), given.get("slope"))
            m_new = tiles.maximum(m, tiles.row_max(lg))
            # rows with nothing visible yet (window, documents) keep m = -inf: shift by 0
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            z = z * jnp.exp(m - shift) + jnp.sum(jnp.exp(lg - shift), axis=1, keepdims=True)
            return m_new, z

        first = plan.first_key_tile(I)
        m0 = jnp.full((T, 1), -jnp.inf, f32)
        m, z = jax.lax.fori_loop(first, I + 1, body, (m0, jnp.zeros((T, 1), f32)))
        m_ref[0, 0] = m
        z_ref[0, 0] = z

    m, z = target.call(
        kernel, grid=(B, nt, n),
        in_specs=[pl.BlockSpec((1, 1, T, d), lambda b, I, c: (b, c, I, 0)),
                  pl.BlockSpec((1, 1, ntp * T, d), lambda b, I, c: (b, c, 0, 0)),
                  pl.BlockSpec((1, T, 1), lambda b, I, c: (b, I, 0)),
                  pl.BlockSpec((1, ntp, T), lambda b, I, c: (b, 0, 0))]
        + [pl.BlockSpec((1, 1, 1), lambda b, I, c: (c, 0, 0))] * len(terms),
        out_specs=[pl.BlockSpec((1, 1, T, 1), lambda b, I, c: (b, c, I, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, n, Lp, 1), f32)] * 2)(
            q, k, seg[:, :, None], seg_rows, *(plan.param[name][:, None, :] for name in terms))
    return dataclasses.replace(plan, vec=dict(plan.vec, m=m[..., 0], z=z[..., 0]))


def _source_identity(on_diag, T):
    """The values of a source stripe in row chunk ``I``: the identity where ``I == J``, else 0."""
    return jnp.where(on_diag & (tiles.iota2((T, T), 0) == tiles.iota2((T, T), 1)), 1.0, 0.0)


def _delta_tile(on_diag, S, decay, q_in, k_in, k_out, qk, solve):
    """One step of the delta rule's chunk recurrence for a source stripe: the ``(T, T)`` tile
    ``(I, J)`` of ``M`` and the stripe's state after chunk ``I >= J``.

    ``S (T, N)``: row ``j`` is source ``j``'s state (``b_j k_j^T A_{j+1} ... A_t``) entering the
    chunk; the values are the identity on the stripe, so they enter only at ``I == J`` (where
    ``S`` is zero). The rest are the chunk's ``DeltaChunks`` rows (``decay (1, N)``; ``solve``
    the solved ``T^{-1} diag(b)``)."""
    U = tiles.dot(solve, _source_identity(on_diag, qk.shape[0]) - tiles.dot_t(k_in, S))  # writes, one column per source
    O = tiles.dot_t(q_in, S) + tiles.dot(qk, U)
    return tiles.keep_lower(O, on_diag), decay * S + tiles.dot(jnp.transpose(U), k_out)


def _dplr_tile(on_diag, S, decay, q_in, k_out, qk, *low_rank):
    """The same step for the DPLR recurrence (``ops.DplrChunks`` rows; ``low_rank`` is ``(a_in,
    b_out, qb, ak, solve)`` with ``solve = (I - A_ab)^{-1}``, or empty for a diagonal transition).
    The values (the identity on the stripe) multiply ``A_qk``, ``A_ak`` and ``k_out`` only where
    ``I == J``, so those products are selections, not matmuls."""
    at_diag = lambda x: jnp.where(on_diag, x, 0.0)
    O = tiles.dot_t(q_in, S) + at_diag(qk)
    S_next = decay * S + at_diag(k_out)
    if low_rank:
        a_in, b_out, qb, ak, solve = low_rank
        X = tiles.dot(solve, tiles.dot_t(a_in, S) + at_diag(ak))  # rows x_t = S_{t-1} a_t, one column per source
        O = O + tiles.dot(qb, X)
        S_next = S_next + tiles.dot(jnp.transpose(X), b_out)
    return tiles.keep_lower(O, on_diag), S_next


def head_matrices(plan: HeadMatrixPlan, target: Target):
    """Every head's matrix ``M_h`` of a chunked recurrence (the gated delta rule or the DPLR
    recurrence): ``(B, H, L, L)`` float32, exact zeros above the diagonal.

    One program per (example, head, source stripe ``J`` of ``T`` positions) runs the chunk
    recurrence over the row chunks ``I >= J`` with a ``(T, N)`` state (the stripe's sources);
    the ``O(L C)`` chunk factors come from the plan, so each step is a few ``(T, .)`` matmuls.
    Triton and the interpreter loop over ``I`` inside the program (grid steps run in parallel
    there); Mosaic makes ``I`` a sequential grid axis and keeps the state in VMEM scratch, so
    each step holds one chunk's inputs."""
    B, H, nt, T = plan.rows[0].shape[:4]
    L, Lp = plan.L, plan.Lp
    N = plan.decay.shape[-1]
    tile = {"delta": _delta_tile, "dplr": _dplr_tile}[plan.form]
    rows = [x.reshape(B, H, Lp, x.shape[-1]) for x in plan.rows]  # (B, H, nt, T, X) -> (B, H, Lp, X)
    decay = plan.decay[:, :, :, None, :]
    out_shape = jax.ShapeDtypeStruct((B, H, Lp, Lp), f32)
    zero = lambda: jnp.zeros((T, T), f32)  # built inside the kernel (no captured constants)

    if target.channel_grid:
        def kernel(dec, *refs):
            *ins, o, S_ref = refs
            J, I = pl.program_id(2), pl.program_id(3)

            @pl.when(I < J)
            def _():
                o[0, 0] = zero()

            @pl.when(I == J)
            def _():
                S_ref[...] = jnp.zeros((T, N), f32)

            @pl.when(I >= J)
            def _():
                O, S = tile(I == J, S_ref[...], dec[0, 0, 0], *(x[0, 0] for x in ins))
                o[0, 0] = O
                S_ref[...] = S

        M = target.call(
            kernel, grid=(B, H, nt, nt),
            in_specs=[pl.BlockSpec((1, 1, 1, 1, N), lambda b, h, J, I: (b, h, I, 0, 0))]
            + [pl.BlockSpec((1, 1, T, x.shape[-1]), lambda b, h, J, I: (b, h, I, 0)) for x in rows],
            out_specs=pl.BlockSpec((1, 1, T, T), lambda b, h, J, I: (b, h, I, J)), out_shape=out_shape,
            sequential_last=True, scratch_shapes=[pltpu.VMEM((T, N), f32)])(decay, *rows)
    else:
        def kernel(dec, *refs):
            *ins, o = refs
            J = pl.program_id(2)

            def above(I, carry):
                o[0, 0, pl.ds(I * T, T), :] = zero()
                return carry

            def step(I, S):
                r = pl.ds(I * T, T)
                O, S = tile(I == J, S, dec[0, 0, I], *(x[0, 0, r, :] for x in ins))
                o[0, 0, r, :] = O
                return S

            jax.lax.fori_loop(0, J, above, 0)
            jax.lax.fori_loop(J, nt, step, jnp.zeros((T, N), f32))

        M = target.call(
            kernel, grid=(B, H, nt),
            in_specs=[pl.BlockSpec((1, 1, nt, 1, N), lambda b, h, J: (b, h, 0, 0, 0))]
            + [pl.BlockSpec((1, 1, Lp, x.shape[-1]), lambda b, h, J: (b, h, 0, 0)) for x in rows],
            out_specs=pl.BlockSpec((1, 1, Lp, T), lambda b, h, J: (b, h, 0, J)), out_shape=out_shape)(decay, *rows)
    return M[:, :, :L, :L]
