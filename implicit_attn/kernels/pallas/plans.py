"""Translate each operator core into the inputs of one kernel family (a ``Plan``).

Three tile kinds serve every block:

* ``"scalar"``: ``diag(l) [exp(T^{la}) * (q k^T)] diag(r) + diag(d)``, one log decay per
  channel row (Griffin's RG-LRU, Mamba-2 heads with ``dt`` and ``D`` folded into ``r``
  and ``d``, any ``ScalarDecayCore``), optional document mask;
* ``"state"``: ``diag(l) [sum_n q k exp(A_n T^{dt})] diag(r) + diag(d)`` (Mamba-1);
* ``"softmax"``: ``diag(gate) softmax_rows(l)`` (RWKV-4), with row statistics from a
  first pass;
* ``"attention"``: masked ``softmax_rows(q k^T)`` per head (``AttentionCore``: causal, local
  window, documents, grouped keys), with row statistics from a first pass; LaS attention
  (``LaSCore``) adds its distance terms to the logits and pools each row over keys;
* ``"band"``: ``diag(l) M diag(r)`` with ``M`` a banded causal conv matrix (LFM2's short
  convolution, ``ShortConvCore``): nonzero only in the diagonal tile and the one left of it;
* the scalar kind over a core's heads (``Plan.heads``): the mLSTM's matrices ``M_h``
  (``MlstmCore``), one ``q, k`` per head and the row and column log weights ``-m``, ``log i``
  inside the exponential; each channel's ``H_c`` is then its head's ``M_h`` with the
  per-channel scalings and conv (``HeadMatrixCore.dense``);
* ``"head_matrices"`` (``HeadMatrixPlan``): the per-head matrices ``M_h`` of the gated delta rule
  (``DeltaRuleCore``) or the DPLR recurrence (``DplrCore``: RWKV-5/6/7), computed by a chunk
  recurrence kernel from the per-chunk factors; each channel's ``H_c`` is then its head's
  ``M_h`` with the per-channel scalings and conv (``HeadMatrixCore.dense``).

All then get the optional banded conv on the right. Everything that is ``O(B n L)`` is
computed here with XLA, once: the per-channel rows of the selected channels, and for the
decay kinds the three parts of the chunked segment sum (``ops.chunk_sums``, the same
parts the XLA reference uses). The kernels compute only what is ``O(L^2)``. Per-group
``q, k`` stay per group and are selected inside the kernel, so nothing of size
``n * L * N`` is built.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ...operator import (AttentionCore, DeltaRuleCore, DocumentMaskedCore, DplrCore, LaSCore, Mamba2Core, MlstmCore,
                         RwkvCore, ScalarDecayCore, ShortConvCore, StateDecayCore)
from ...ops import block_start, chunk_factors, chunk_sums, dplr_factors, pool_window

f32 = jnp.float32

# core type -> (plan function ``(core, idx, T) -> Plan``, ``core -> problem or None``)
PLANS: dict[type, tuple[Callable, Callable]] = {}
# core type -> the platforms ("cuda", "rocm", "tpu") where impl="auto" uses its compiled
# kernel: run there, equal to XLA, and faster than XLA for both materialize and reduce
# (benchmarks/gpu.py). On an H100 (jax 0.11.2) every kernel compiled and matched XLA to
# 2e-7, but Mamba-1's reduce and Mamba-2's materialize were slower than XLA, so auto keeps
# XLA for those two core types. TPU: lowering is tested, compiling is not (no TPU here).
VERIFIED: dict[type, frozenset] = {}


def plan_for(core_type: type, check: Callable | None = None, verified=()):
    """Register a plan function for ``core_type`` (``check(core)``: why a particular core
    cannot run, or None; ``verified``: platforms where the compiled kernel is known to work)."""
    def wrap(fn):
        PLANS[core_type] = (fn, check or (lambda core: None))
        VERIFIED[core_type] = frozenset(verified)
        return fn

    return wrap


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass
class Plan:
    """Kernel inputs for ``n`` selected channels, time padded to ``Lp = nt * T``.

    Attributes:
      kind: ``"scalar"``, ``"state"``, ``"softmax"``, ``"attention"`` or ``"band"``.
      L, T: true length and tile edge.
      vec: name -> ``(B, n, Lp)`` float32 per-channel rows. Decay kinds: ``t`` (log decays
        or step sizes), ``P`` (inclusive in-tile prefix sums of ``t``), ``S`` (exclusive
        in-tile suffix sums), optional ``left, right, diag``; the scalar kind also optional
        ``row_log, col_log`` (log weights of rows and columns added inside the exponential,
        both or neither). Softmax: ``k``, optional ``gate``. Softmax and attention: the row
        statistics ``m, z`` (added by their first kernel).
      mid: ``(B, n, nt, ntp)`` sums of the whole tiles strictly between row tile ``I`` and
        column tile ``J`` (decay kinds; ``ntp`` = ``nt`` padded to a power of two), else None.
      param: name -> ``(n, X)`` per-channel parameters (``A``, ``conv_w``, ``w``, ``u``, ``group``).
      shared: name -> per-example arrays: ``q, k`` (``(B, G, Lp, N)`` scalar kind,
        ``(B, Lp, N)`` state kind, ``(B, n, Lp, N)`` for a plan of heads and for attention;
        ``N`` padded to >= 16, a power of two), ``seg (B, Lp)``.
      conv: the conv width ``K`` (0: no conv).
      nan_safe: the tiles keep NaN where the elementwise form has it (two matmuls where one
        does otherwise; ``calls.nan_safe_call`` picks them for inputs that hold a NaN).
      heads: the plan's channels are the core's heads (``HeadMatrixCore``): one ``q, k`` per
        channel, and its ``materialize`` gives every ``M_h``, from which the caller forms the
        channels asked for.
      window: the attention kind's window (keys at distance ``>= window`` are masked), at most
        ``Lp``; None for the other kinds.
      pool: LaS attention's pooling window ``P`` over keys (attention kind; 1: none), its offsets
        ``pool_lo .. pool_lo + P - 1`` (``ops.pool_window``); the keys and block ids shifted by each
        nonzero offset ``m`` are ``shared["k{m:+d}"]``, ``shared["seg{m:+d}"]``, and the ELD rates and
        ALiBi slopes, where the core has them, ``param["alpha"]``, ``param["slope"]`` ``(n, 1)``.
      block: LaS attention's chunk length (attention kind; None: no chunks): a row sees only the
        keys of its own chunk, so the column tiles left of its chunk are skipped.
    """

    kind: str
    L: int
    T: int
    vec: dict
    mid: object
    param: dict
    shared: dict
    conv: int = 0
    nan_safe: bool = False
    heads: bool = False
    window: int | None = None
    pool: int = 1
    pool_lo: int = 0
    block: int | None = None

    @property
    def Lp(self) -> int:
        return next(iter(self.vec.values())).shape[-1]

    @property
    def nt(self) -> int:
        return self.Lp // self.T

    def first_key_tile(self, I):
        """The first column tile that a row of row tile ``I`` sees: the window's reach and the
        LaS-chunk block's start for the attention kind, 0 for the others. Every entry of a column
        tile left of it is 0 (kernels skip it). ``I``: a traced int32 scalar."""
        if self.kind != "attention":
            return 0
        T = self.T
        # lax.div (numerators >= 0): `//` lowers through sign(), which Mosaic resolves by asking
        # the TPU it lowers on for its kind
        first = jax.lax.div(jnp.maximum(I * T - (self.window - 1), 0), T)
        if self.block is not None:
            first = jnp.maximum(first, jax.lax.div(jax.lax.div(I * T, self.block) * self.block, T))
        return first


def _pad_axis(x, axis: int, size: int, value=0.0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _rows(x, idx, Lp):
    """``(B, C, L)`` -> selected channels, float32, padded to ``Lp`` with zeros."""
    return _pad_axis(jnp.take(x, idx, axis=1).astype(f32), 2, Lp)


def _feature_pad(x, axis: int):
    """Zero-pad a contraction axis to a power of two >= 16 (Triton's smallest dot)."""
    return _pad_axis(x.astype(f32), axis, max(16, next_pow2(x.shape[axis])))


def _decay_plan(kind, T, t, idx, left, right, diag, conv_w, shared, param, L):
    """Common tail of the decay kinds: segment-sum parts, optional rows, the conv."""
    B, n, Lp = t.shape
    nt = Lp // T
    P, S, between = chunk_sums(t.reshape(B, n, nt, T))
    vec = {"t": t, "P": P.reshape(B, n, Lp), "S": S.reshape(B, n, Lp)}
    for name, v in (("left", left), ("right", right), ("diag", diag)):
        if v is not None:
            vec[name] = _pad_axis(v.astype(f32), 2, Lp)
    K = 0
    if conv_w is not None:
        K, param["conv_w"] = _conv_filters(conv_w, idx, T)
    mid = _pad_axis(between, 3, next_pow2(nt))
    return Plan(kind, L, T, vec, mid, param, shared, K)


def _conv_filters(conv_w, idx, T: int):
    """``(K, (n, Kp))``: the conv width and the selected channels' filters ``conv_w (C, K)``
    zero-padded to a power of two; the band must fit in two tiles (``K - 1 <= T``)."""
    K = conv_w.shape[-1]
    if K - 1 > T:
        raise ValueError(f"conv width {K} needs a tile of at least {K - 1}, got {T}")
    return K, _pad_axis(jnp.take(conv_w, idx, axis=0).astype(f32), 1, next_pow2(K))


def _padded_length(L: int, T: int) -> int:
    return -(-L // T) * T


@plan_for(ScalarDecayCore, verified=("cuda",))
def plan_scalar(core, idx, T: int, seg=None) -> Plan:
    """``ScalarDecayCore`` -> scalar plan (``seg (B, L)``: optional document ids)."""
    B, G, L = core.log_a.shape
    Lp = _padded_length(L, T)
    g = jnp.take(core.group, idx)
    param, shared = {}, {}
    if core.q is not None:
        param["group"] = g.astype(jnp.int32)[:, None]
        shared["q"] = _feature_pad(_pad_axis(core.q, 2, Lp), 3)
        shared["k"] = _feature_pad(_pad_axis(core.k, 2, Lp), 3)
    if seg is not None:
        shared["seg"] = _pad_axis(seg.astype(jnp.int32), 1, Lp, -1)
    take = lambda x: None if x is None else jnp.take(x, idx, axis=1)
    return _decay_plan("scalar", T, _rows(core.log_a, g, Lp), idx, take(core.left), take(core.right),
                       take(core.diag), core.conv_w, shared, param, L)


@plan_for(Mamba2Core)
def plan_mamba2(core, idx, T: int) -> Plan:
    """``Mamba2Core`` -> scalar plan: ``alpha = K diag(dt) + D I`` folded into ``right`` and ``diag``."""
    B, H, L = core.log_a.shape
    Lp = _padded_length(L, T)
    h = jnp.take(core.head, idx)
    dt = jnp.take(core.dt, h, axis=1).astype(f32)
    left = None if core.left is None else jnp.take(core.left, idx, axis=1).astype(f32)
    right = None if core.right is None else jnp.take(core.right, idx, axis=1).astype(f32)
    D = jnp.take(core.D, h).astype(f32)[None, :, None]
    diag = D * (1.0 if left is None else left) * (1.0 if right is None else right)
    diag = jnp.broadcast_to(diag, dt.shape)
    right = dt if right is None else dt * right
    param = {"group": (h // core.heads_per_group).astype(jnp.int32)[:, None]}
    shared = {"q": _feature_pad(_pad_axis(core.q, 2, Lp), 3), "k": _feature_pad(_pad_axis(core.k, 2, Lp), 3)}
    return _decay_plan("scalar", T, _rows(core.log_a, h, Lp), idx, left, right, diag, core.conv_w,
                       shared, param, L)


@plan_for(StateDecayCore)
def plan_state(core, idx, T: int) -> Plan:
    """``StateDecayCore`` (Mamba-1) -> state plan."""
    B, C, L = core.dt.shape
    Lp = _padded_length(L, T)
    param = {"A": _feature_pad(jnp.take(core.A, idx, axis=0), 1)}
    shared = {"q": _feature_pad(_pad_axis(core.q, 1, Lp), 2), "k": _feature_pad(_pad_axis(core.k, 1, Lp), 2)}
    take = lambda x: None if x is None else jnp.take(x, idx, axis=1)
    return _decay_plan("state", T, _rows(core.dt, idx, Lp), idx, take(core.left), take(core.right),
                       take(core.diag), core.conv_w, shared, param, L)


@plan_for(RwkvCore, verified=("cuda",))
def plan_softmax(core, idx, T: int) -> Plan:
    """``RwkvCore`` -> softmax plan (row statistics are added by the caller)."""
    B, C, L = core.k.shape
    Lp = _padded_length(L, T)
    vec = {"k": _rows(core.k, idx, Lp)}
    if core.gate is not None:
        vec["gate"] = _rows(core.gate, idx, Lp)
    param = {"w": jnp.take(core.w, idx)[:, None].astype(f32), "u": jnp.take(core.u, idx)[:, None].astype(f32)}
    return Plan("softmax", L, T, vec, None, param, {})


@plan_for(AttentionCore)
def plan_attention(core, idx, T: int) -> Plan:
    """``AttentionCore`` -> attention plan: each selected head's queries and its group's keys
    ``(B, n, Lp, d)`` (``d`` padded to a power of two >= 16) and the document ids padded with -1;
    its ``vec`` is empty until the caller adds the row statistics ``m, z``."""
    H, L = core.q.shape[1:3]
    Lp = _padded_length(L, T)
    kv = idx // (H // core.k.shape[1])
    shared = {"q": _feature_pad(_pad_axis(jnp.take(core.q, idx, axis=1), 2, Lp), 3),
              "k": _feature_pad(_pad_axis(jnp.take(core.k, kv, axis=1), 2, Lp), 3),
              "seg": _pad_axis(core.seg.astype(jnp.int32), 1, Lp, -1)}
    return Plan("attention", L, T, {}, None, {}, shared, window=int(min(core.window, Lp)))


def _shift_time(x, m: int, axis: int, value=0.0):
    """``y[..., j, ...] = x[..., j + m, ...]`` along ``axis``, ``value`` where ``j + m`` is outside."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (max(-m, 0), max(m, 0))
    start = max(m, 0)  # padded index of x[j + m] for output j
    return jnp.pad(x, pad, constant_values=value)[(slice(None),) * axis + (slice(start, start + x.shape[axis]),)]


@plan_for(LaSCore)
def plan_las(core, idx, T: int) -> Plan:
    """``LaSCore`` -> attention plan with LaS's parts: the heads' queries and keys ``(B, n, Lp, d)``,
    the LaS-chunk block of each position as its document id, the ELD rates and ALiBi slopes, and
    for the pooling the keys and block ids shifted by each offset of the window (``Plan.pool``): a
    pooled entry ``(1 / P) sum_m A[i, j + m]`` is formed from the shifted keys' probabilities."""
    B, H, L, _ = core.q.shape
    Lp = _padded_length(L, T)
    seg = jnp.broadcast_to(block_start(L, core.chunk).astype(jnp.int32), (B, L))
    shared = {"q": _feature_pad(_pad_axis(jnp.take(core.q, idx, axis=1), 2, Lp), 3),
              "k": _feature_pad(_pad_axis(jnp.take(core.k, idx, axis=1), 2, Lp), 3),
              "seg": _pad_axis(seg, 1, Lp, -1)}
    lo, hi = pool_window(core.pool, core.align)
    for m in range(lo, hi + 1) if core.pool > 1 else ():
        if m:
            shared[f"k{m:+d}"] = _shift_time(shared["k"], m, 2)
            shared[f"seg{m:+d}"] = _shift_time(shared["seg"], m, 1, -1)
    param = {name: jnp.take(jnp.asarray(x, f32), idx)[:, None] for name, x in (("alpha", core.alpha),
                                                                               ("slope", core.slope))
             if x is not None}
    return Plan("attention", L, T, {}, None, param, shared, window=Lp, pool=core.pool, pool_lo=lo, block=core.chunk)


@plan_for(ShortConvCore)
def plan_band(core, idx, T: int) -> Plan:
    """``ShortConvCore`` -> band plan: ``diag(left) M diag(right)`` with ``M`` the conv matrix, which
    reaches the diagonal tile and the one left of it (``Plan.conv`` is its width)."""
    Lp = _padded_length(core.left.shape[-1], T)
    vec = {"left": _rows(core.left, idx, Lp)}
    if core.right is not None:
        vec["right"] = _rows(core.right, idx, Lp)
    K, w = _conv_filters(core.conv_w, idx, T)
    return Plan("band", core.left.shape[-1], T, vec, None, {"conv_w": w}, {}, K)


@plan_for(MlstmCore)
def plan_mlstm(core, idx, T: int) -> Plan:
    """``MlstmCore`` -> scalar plan of all its heads (``Plan.heads``; the channels ``idx`` are picked
    from the head matrices afterwards): ``M_h = diag(1 / norm) [exp(T^{log f}[i, j] - m_i + log i_j)
    * (q k^T)]``, the stabiliser and the input gates inside the exponential as in
    ``ops.decayed_scores`` (``e^{-m}`` or ``e^{log i}`` alone may overflow)."""
    B, H, L = core.log_f.shape
    Lp = _padded_length(L, T)
    heads = jnp.arange(H)
    shared = {"q": _feature_pad(_pad_axis(core.q, 2, Lp), 3), "k": _feature_pad(_pad_axis(core.k, 2, Lp), 3)}
    plan = _decay_plan("scalar", T, _rows(core.log_f, heads, Lp), heads, 1.0 / core.norm.astype(f32), None, None,
                       None, shared, {}, L)
    vec = dict(plan.vec, row_log=_rows(-core.m.astype(f32), heads, Lp), col_log=_rows(core.log_i, heads, Lp))
    return dataclasses.replace(plan, vec=vec, heads=True)


@dataclasses.dataclass
class HeadMatrixPlan:
    """Kernel inputs of a core with one matrix per head computed by a chunk recurrence
    (``calls.head_matrices``): every head's chunk factors, time padded to ``Lp = nt * T`` (chunk =
    tile edge ``T``), key dimensions zero-padded to ``N`` (a power of two >= 16).

    Attributes:
      L, T: true length and chunk edge.
      form: ``"delta"`` (``DeltaRuleCore``) or ``"dplr"`` (``DplrCore``): which tile step.
      rows: the per-chunk factors the step reads, each ``(B, H, nt, T, X)`` in the step's
        argument order (``X`` is ``N`` or ``T``).
      decay: ``(B, H, nt, N)`` the state's decay over each chunk.
    """

    L: int
    T: int
    form: str
    rows: list
    decay: object
    kind: str = "head_matrices"
    heads: bool = True  # as ``Plan.heads``: the kernel gives every head's ``M_h``

    @property
    def nt(self) -> int:
        return self.decay.shape[2]

    @property
    def Lp(self) -> int:
        return self.nt * self.T


def _head_major(x):
    """Chunk-major ``(n, B, H, ...)`` factors -> ``(B, H, n, ...)`` float32."""
    return jnp.moveaxis(x.astype(f32), 0, 2)


@plan_for(DeltaRuleCore)
def plan_delta(core, idx, T: int) -> HeadMatrixPlan:
    """``DeltaRuleCore`` -> the chunk factors of all its heads (the channels ``idx`` are picked
    from the head matrices afterwards)."""
    B, H, L = core.beta.shape
    Lp = _padded_length(L, T)
    groups = jnp.arange(H) // core.heads_per_group
    q, k = (_pad_axis(jnp.take(x, groups, axis=1).astype(f32), 2, Lp) for x in (core.q, core.k))
    f = chunk_factors(q, k, _pad_axis(core.log_a.astype(f32), 2, Lp), _pad_axis(core.beta.astype(f32), 2, Lp),
                      T, erase=core.delta)
    # The kernel multiplies by T^{-1} diag(b) (formed here: one block inverse per chunk);
    # without the erasure the state only decays and adds, so the erasure's read k_in is zero.
    k_in = f.k_in if core.delta else jnp.zeros_like(f.k_in)
    N = lambda x: _feature_pad(_head_major(x), x.ndim - 1)
    rows = [N(f.q_in), N(k_in), N(f.k_out), _head_major(f.qk), _head_major(f.solved())]
    return HeadMatrixPlan(L, T, "delta", rows, N(f.decay))


@plan_for(DplrCore)
def plan_dplr(core, idx, T: int) -> HeadMatrixPlan:
    """``DplrCore`` -> the chunk factors of all its heads (``ops.dplr_factors``)."""
    B, H, L, _ = core.k.shape
    Lp = _padded_length(L, T)
    pad = lambda x: None if x is None else _pad_axis(x.astype(f32), 2, Lp)
    f = dplr_factors(pad(core.q), pad(core.k), pad(core.log_w), pad(core.a), pad(core.b), pad(core.bonus),
                     chunk=T, after=core.after, decay_floor=core.decay_floor)
    N = lambda x: _feature_pad(_head_major(x), x.ndim - 1)
    rows = [N(f.q_in), N(f.k_out), _head_major(f.qk)]
    if f.system is not None:
        rows += [N(f.a_in), N(f.b_out), _head_major(f.qb), _head_major(f.ak), _head_major(f.solved())]
    return HeadMatrixPlan(L, T, "dplr", rows, N(f.decay))


@plan_for(DocumentMaskedCore, verified=("cuda",))
def plan_document_masked(core, idx, T: int) -> Plan:
    """``DocumentMaskedCore(ScalarDecayCore)`` -> scalar plan with the document ids (the backend
    takes one over any other core through that core's kernel, ``pallas._masks_inner_output``)."""
    return plan_scalar(core.inner, idx, T, seg=core.seg)


def make_plan(core, idx, T: int) -> Plan:
    """The plan of ``core``'s registered plan function (the backend checked the type)."""
    return PLANS[type(core)][0](core, idx, T)
