"""Translate each operator core into the inputs of one kernel family (a ``Plan``).

Three tile kinds serve every block:

* ``"scalar"``: ``diag(l) [exp(T^{la}) * (q k^T)] diag(r) + diag(d)``, one log decay per
  channel row (Griffin's RG-LRU, Mamba-2 heads with ``dt`` and ``D`` folded into ``r``
  and ``d``, any ``ScalarDecayCore``), optional document mask;
* ``"state"``: ``diag(l) [sum_n q k exp(A_n T^{dt})] diag(r) + diag(d)`` (Mamba-1);
* ``"softmax"``: ``diag(gate) softmax_rows(l)`` (RWKV-4), with row statistics from a
  first pass.

All then get the optional banded conv on the right. Per-channel vectors are gathered
for the selected channels here (``O(B n L)``); per-group ``q, k`` stay per group and
are indexed inside the kernel, so nothing of size ``n * L * N`` is built.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from ...operator import DocumentMaskedCore, Mamba2Core, RwkvCore, ScalarDecayCore, StateDecayCore

f32 = jnp.float32

# core type -> (plan function ``(core, idx, T) -> Plan``, ``core -> problem or None``)
PLANS: dict[type, tuple[Callable, Callable]] = {}
# core type -> the platforms ("cuda", "rocm", "tpu") where its compiled kernel is known to
# lower, compile and match XLA; impl="auto" picks Pallas only there. None are yet: the
# kernels index whole rows with dynamic slices, which only interpret mode accepts.
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
    """Kernel inputs for ``n`` selected channels at padded length ``Lp`` (a multiple of ``T``).

    ``chan``: name -> ``(B, n, X)`` float32 per-channel rows; ``small``: name -> ``(n, X)``
    per-channel parameters; ``shared``: name -> ``(B, ...)`` per-example arrays.
    """

    kind: str
    L: int
    Lp: int
    T: int
    chan: dict
    small: dict
    shared: dict

    @property
    def flags(self) -> tuple:
        return tuple(sorted(list(self.chan) + list(self.small) + list(self.shared)))


def _pad_last(x, size: int, value=0.0):
    pad = [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])]
    return jnp.pad(x, pad, constant_values=value)


def _rows(x, idx, Lin):
    """``(B, C, L)`` -> selected channels, float32, padded to ``Lin``."""
    return _pad_last(jnp.take(x, idx, axis=1).astype(f32), Lin)


def _tile_totals(t, Lp: int, T: int):
    """Per-tile sums ``(B, n, nt)`` of ``t (B, n, >= Lp)``, padded to a power of two."""
    B, n = t.shape[:2]
    nt = Lp // T
    tot = jnp.sum(t[..., :Lp].reshape(B, n, nt, T), axis=-1)
    return _pad_last(tot, next_pow2(nt))


def _geometry(L: int, T: int):
    Lp = -(-L // T) * T
    return Lp, next_pow2(Lp)


def _finish_decay(plan_kind, L, T, Lp, Lin, t, idx, left, right, diag, conv_w, shared, small):
    chan = {"t": t, "tot": _tile_totals(t, Lp, T)}
    for name, v in (("left", left), ("right", right), ("diag", diag)):
        if v is not None:
            chan[name] = _pad_last(v.astype(f32), Lin)
    if conv_w is not None:
        if conv_w.shape[-1] - 1 > T:
            raise ValueError(f"conv width {conv_w.shape[-1]} needs a tile of at least {conv_w.shape[-1] - 1}, got {T}")
        small["conv_w"] = jnp.take(conv_w, idx, axis=0).astype(f32)
    return Plan(plan_kind, L, Lp, T, chan, small, shared)


@plan_for(ScalarDecayCore)
def plan_scalar(core, idx, T: int, seg=None) -> Plan:
    """``ScalarDecayCore`` -> scalar plan (``seg (B, L)``: optional document ids)."""
    B, G, L = core.log_a.shape
    Lp, Lin = _geometry(L, T)
    g = jnp.take(core.group, idx)
    t = _rows(core.log_a, g, Lin)
    small, shared = {}, {}
    if core.q is not None:
        small["gidx"] = g.astype(jnp.int32)[:, None]
        shared["q"] = _pad_time4(core.q, Lin)
        shared["k"] = _pad_time4(core.k, Lin)
    if seg is not None:
        shared["seg"] = _pad_last(seg.astype(jnp.int32), Lin, -1)
    take = lambda x: None if x is None else jnp.take(x, idx, axis=1)
    return _finish_decay("scalar", L, T, Lp, Lin, t, idx, take(core.left), take(core.right),
                         take(core.diag), core.conv_w, shared, small)


def _pad_time4(x, Lin):
    """``(B, G, L, N)`` -> float32, time padded to ``Lin``."""
    return jnp.pad(x.astype(f32), ((0, 0), (0, 0), (0, Lin - x.shape[2]), (0, 0)))


@plan_for(Mamba2Core)
def plan_mamba2(core, idx, T: int) -> Plan:
    """``Mamba2Core`` -> scalar plan: ``alpha = K diag(dt) + D I`` folded into ``right`` and ``diag``."""
    B, H, L = core.log_a.shape
    Lp, Lin = _geometry(L, T)
    h = jnp.take(core.head, idx)
    t = _rows(core.log_a, h, Lin)
    dt = jnp.take(core.dt, h, axis=1).astype(f32)
    left = None if core.left is None else jnp.take(core.left, idx, axis=1).astype(f32)
    right = None if core.right is None else jnp.take(core.right, idx, axis=1).astype(f32)
    D = jnp.take(core.D, h).astype(f32)[None, :, None]
    diag = D * (1.0 if left is None else left) * (1.0 if right is None else right)
    diag = jnp.broadcast_to(diag, dt.shape)
    right = dt if right is None else dt * right
    small = {"gidx": (h // core.heads_per_group).astype(jnp.int32)[:, None]}
    shared = {"q": _pad_time4(core.q, Lin), "k": _pad_time4(core.k, Lin)}
    return _finish_decay("scalar", L, T, Lp, Lin, t, idx, left, right, diag, core.conv_w, shared, small)


@plan_for(StateDecayCore)
def plan_state(core, idx, T: int) -> Plan:
    """``StateDecayCore`` (Mamba-1) -> state plan."""
    B, C, L = core.dt.shape
    Lp, Lin = _geometry(L, T)
    t = _rows(core.dt, idx, Lin)
    small = {"A": jnp.take(core.A, idx, axis=0).astype(f32)}
    pad3 = lambda x: jnp.pad(x.astype(f32), ((0, 0), (0, Lin - L), (0, 0)))
    shared = {"q": pad3(core.q), "k": pad3(core.k)}
    take = lambda x: None if x is None else jnp.take(x, idx, axis=1)
    return _finish_decay("state", L, T, Lp, Lin, t, idx, take(core.left), take(core.right),
                         take(core.diag), core.conv_w, shared, small)


@plan_for(RwkvCore)
def plan_softmax(core, idx, T: int) -> Plan:
    """``RwkvCore`` -> softmax plan (row statistics are added by the caller)."""
    B, C, L = core.k.shape
    Lp, Lin = _geometry(L, T)
    chan = {"k": _rows(core.k, idx, Lin)}
    if core.gate is not None:
        chan["gate"] = _rows(core.gate, idx, Lin)
    wu = jnp.stack([jnp.take(core.w, idx), jnp.take(core.u, idx)], axis=1).astype(f32)
    return Plan("softmax", L, Lp, T, chan, {"wu": wu}, {})


def _inner_scalar(core) -> str | None:
    if not isinstance(core.inner, ScalarDecayCore):
        return f"documents are masked only around a ScalarDecayCore, not {type(core.inner).__name__}"
    return None


@plan_for(DocumentMaskedCore, _inner_scalar)
def plan_document_masked(core, idx, T: int) -> Plan:
    """``DocumentMaskedCore(ScalarDecayCore)`` -> scalar plan with the document ids."""
    return plan_scalar(core.inner, idx, T, seg=core.seg)


def make_plan(core, idx, T: int) -> Plan:
    """The plan of ``core``'s registered plan function (the backend checked the type)."""
    return PLANS[type(core)][0](core, idx, T)
