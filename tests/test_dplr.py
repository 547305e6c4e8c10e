"""The diagonal-plus-low-rank recurrence's exact token-mixing matrix (``ops.dplr_rule``,
``ops.dplr_matrix``: RWKV-7's generalised delta rule, and RWKV-5/6's read-before-update form)
against two independent references: a float64 step-by-step recurrence of the state, and
flash-linear-attention's plain-torch reference recurrences (``dplr_recurrence``,
``naive_recurrent_rwkv6``), loaded by file path from the ``fla-core`` wheel (never installed
or imported as a package: it would replace Hugging Face's CPU paths). Strong decays, the
low-rank term of RWKV-7's shape, ragged chunks, long inputs."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.kernels.pallas import calls, plans
from implicit_attn.operator import DplrCore, Mamba2Operator
from implicit_attn.ops import delta_rule, dplr_matrix, dplr_rule


def recurrence(q, k, v, log_w, a=None, b=None, after=True):
    """Float64 ``o (B, H, L, d_v)``: ``S_t = S_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T`` (``S`` is
    ``d_v x d_k``), read ``S_t q_t`` (``after``) or ``S_{t-1} q_t``."""
    B, H, L, dk = k.shape
    o = np.zeros(v.shape)
    for bi in range(B):
        for h in range(H):
            S = np.zeros((v.shape[-1], dk))
            for t in range(L):
                if not after:
                    o[bi, h, t] = S @ q[bi, h, t]
                P = np.diag(np.exp(log_w[bi, h, t]))
                if a is not None:
                    P = P + np.outer(a[bi, h, t], b[bi, h, t])
                S = S @ P + np.outer(v[bi, h, t], k[bi, h, t])
                if after:
                    o[bi, h, t] = S @ q[bi, h, t]
    return o


def rwkv7_inputs(B, H, L, dk, dv, seed=0, decay=0.6065):
    """Random float64 inputs of RWKV-7's shape: ``a = -kk``, ``b = kk * iclr`` with ``kk`` of unit
    norm and ``iclr`` in (0, 1); log decays in ``[-decay, 0]``."""
    g = np.random.default_rng(seed)
    kk = g.standard_normal((B, H, L, dk))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    q, k, v = g.standard_normal((B, H, L, dk)), g.standard_normal((B, H, L, dk)), g.standard_normal((B, H, L, dv))
    log_w = -g.uniform(0.0, decay, (B, H, L, dk))
    return q, k, v, log_w, -kk, kk * g.uniform(0.0, 1.0, (B, H, L, dk))


f32 = lambda *xs: tuple(None if x is None else jnp.asarray(x, jnp.float32) for x in xs)
rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("L, chunk, decay, low_rank, after", [
    (37, 8, 0.6065, True, True),    # RWKV-7's decay range, ragged last chunk
    (40, 16, 4.0, True, True),      # strong decays
    (37, 8, 7.0, False, False),     # RWKV-6: read before the update, decays down to e^-7
    (29, 32, 1.0, True, False),     # one chunk longer than the input
    (150, 8, 0.1, False, False),    # RWKV-6, weak decays reaching across three groups of 8 chunks, the last padded
], ids=["rwkv7", "rwkv7_strong", "rwkv6", "one_chunk", "rwkv6_groups"])
def test_outputs_and_matrix_equal_the_float64_recurrence(L, chunk, decay, low_rank, after):
    q, k, v, log_w, a, b = rwkv7_inputs(2, 3, L, 6, 5, seed=L, decay=decay)
    if not low_rank:
        a = b = None
    ref = recurrence(q, k, v, log_w, a, b, after)
    assert rel(dplr_rule(*f32(q, k, v, log_w, a, b), chunk=chunk, after=after), ref) <= 2e-6
    M = np.asarray(dplr_matrix(*f32(q, k, log_w, a, b), chunk=chunk, after=after))
    assert not np.triu(M, 0 if not after else 1).any()  # exact zeros above (and, read before, on) the diagonal
    eye = np.broadcast_to(np.eye(L), (2, 3, L, L))
    assert rel(M, recurrence(q, k, eye, log_w, a, b, after)) <= 2e-6
    assert rel(np.einsum("bhij,bhjv->bhiv", M, v), ref) <= 2e-6


@pytest.mark.parametrize("chunk, factorized", [(16, True), (32, True), (64, False)])
def test_bounded_decays_take_the_factorized_chunks(chunk, factorized):
    """With a static floor of the log decays (RWKV-7's ``-e^-1/2``) chunks whose decays cannot
    underflow (``ops.factorizable``: up to 39 positions) take the pair sums as matmuls of ``x e^R``
    and ``y e^-G``; longer chunks fall back to the per-pair exponents. Both equal the float64
    recurrence (outputs and matrix)."""
    from implicit_attn.ops import factorizable

    floor = -0.6065306597126334
    assert factorizable(floor, chunk) == factorized and not factorizable(None, chunk)
    L = 70
    q, k, v, log_w, a, b = rwkv7_inputs(2, 3, L, 6, 5, seed=chunk, decay=-floor)
    ref = recurrence(q, k, v, log_w, a, b)
    assert rel(dplr_rule(*f32(q, k, v, log_w, a, b), chunk=chunk, decay_floor=floor), ref) <= 2e-6
    M = np.asarray(dplr_matrix(*f32(q, k, log_w, a, b), chunk=chunk, decay_floor=floor))
    assert not np.triu(M, 1).any()
    assert rel(M, recurrence(q, k, np.broadcast_to(np.eye(L), (2, 3, L, L)), log_w, a, b)) <= 2e-6


def test_long_input_is_finite_and_exact():
    """L = 4096 with RWKV-7's decays and low-rank term: every entry finite, rows equal the float64
    recurrence (checked on the last 64 rows of the matrix through its outputs)."""
    L = 4096
    q, k, v, log_w, a, b = rwkv7_inputs(1, 1, L, 8, 3, seed=1)
    M = np.asarray(jax.jit(dplr_matrix)(*f32(q, k, log_w, a, b)))
    assert np.isfinite(M).all()
    ref = recurrence(q, k, v, log_w, a, b)
    assert rel(np.einsum("bhij,bhjv->bhiv", M, v)[:, :, -64:], ref[:, :, -64:]) <= 1e-5


def decay_matrix64(q, k, log_w, after, bonus=None):
    """Float64 ``(M, size)`` of the recurrence without low-rank terms, entry by entry: ``M[i, j] =
    sum_d q_id k_jd exp(F_ijd)`` with ``F_ijd`` the log decays summed over ``j < u <= i`` (``after``)
    or ``j < u < i``, plus ``bonus_i`` on the diagonal; ``size`` the sum of the terms' magnitudes
    (a ``-inf`` log decay is a reset)."""
    L = q.shape[2]
    F = np.cumsum(np.where(np.isinf(log_w), -1e4, log_w), axis=2)  # -1e4: exp underflows to 0 in float64
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    expo = F[:, :, :, None] - F[:, :, None, :]  # [i, j]: sum over j < u <= i
    if not after:
        expo = np.concatenate([np.zeros_like(expo[:, :, :1]), expo[:, :, :-1]], axis=2)  # through i - 1
    keep = (i >= j) if after else (i > j)
    w = np.where(keep[..., None], np.exp(np.where(keep[..., None], expo, 0.0)), 0.0)
    terms = q[:, :, :, None] * k[:, :, None] * w  # (B, H, i, j, d)
    ref, size = terms.sum(-1), np.abs(terms).sum(-1)
    if bonus is not None:
        ref, size = ref + bonus[..., None] * np.eye(L), size + np.abs(bonus)[..., None] * np.eye(L)
    return ref, size


@pytest.mark.parametrize("after", [False, True], ids=["rwkv6", "after"])
def test_unbounded_decays_are_exact_entry_by_entry(after):
    """Without a decay floor the chunk pairs come in sub-blocks (``ops.blocked_pairs``: three
    factors <= 1 between sub-blocks, per-pair exponents inside). Strong decays (e^-5 to e^-20) in
    every dimension of one head, in half of them mixed with weak ones (~e^-0.05) in the other, a reset (-inf) and a ragged last chunk: every entry equals the
    float64 ``sum_d q_id k_jd exp(F_ijd)`` to float32 rounding of its own terms' size, so no
    weight is lost to a factor's underflow (or overflow) that the true weight does not share."""
    g = np.random.default_rng(7)
    B, H, L, dk = 1, 2, 70, 8
    q, k = g.standard_normal((B, H, L, dk)), g.standard_normal((B, H, L, dk))
    strong = g.uniform(size=(B, H, 1, dk)) < np.array([1.0, 0.5])[:, None, None]  # head 0: every dimension strong
    log_w = np.where(strong, -g.uniform(5.0, 20.0, (B, H, L, dk)), -g.uniform(0.0, 0.1, (B, H, L, dk)))
    log_w[0, 1, 33, 2] = -np.inf
    M = np.asarray(dplr_matrix(*f32(q, k, log_w), chunk=16, after=after), np.float64)
    ref, size = decay_matrix64(q, k, log_w, after)
    assert not np.triu(M, 0 if not after else 1).any()
    assert (np.abs(M - ref) <= 1e-5 * size + 1e-37).all()
    assert (np.abs(ref) > 1e-30).sum() > L * L / 4  # a range of weights, not just zeros


def test_a_nan_key_stays_out_of_earlier_rows():
    """A NaN key at position 21 (inside a chunk of 16 and a sub-block of 4) of the read-before
    recurrence without a floor: outputs and matrix rows before it stay finite, the rows after it
    turn NaN (the per-pair weights above the diagonal are selected away, not multiplied by 0)."""
    g = np.random.default_rng(0)
    q, k, v = (g.standard_normal((1, 2, 40, 4)) for _ in range(3))
    log_w = -g.uniform(0.0, 8.0, (1, 2, 40, 4))
    k[0, 0, 21] = np.nan
    o = np.asarray(dplr_rule(*f32(q, k, v, log_w), chunk=16, after=False))
    M = np.asarray(dplr_matrix(*f32(q, k, log_w), chunk=16, after=False))
    assert np.isfinite(o[0, 0, :22]).all() and np.isfinite(M[0, 0, :22]).all() and np.isfinite(o[0, 1]).all()
    assert np.isnan(o[0, 0, 22]).all() and np.isnan(M[0, 0, 22, 21])


def test_chunked_forms_and_their_gradients_call_no_lapack():
    """The chunks' triangular systems are solved by matmuls (``ops.unit_lower_inverse``), never by
    jax's triangular solve: on CPU that is LAPACK's ``trsm`` behind an FFI call that splits its batch
    over XLA's thread pool and waits for it inside a pool thread, so two such calls at once on a
    two-thread pool wait for each other forever (a gradient through five layers of the chunked form
    did, below)."""
    g = np.random.default_rng(1)
    q, k, v, a = (jnp.asarray(g.standard_normal((1, 2, 40, 8)), jnp.float32) for _ in range(4))
    log_w = -jnp.exp(q)
    beta = jax.nn.sigmoid(v[..., 0])
    programs = {
        "dplr": lambda q: dplr_rule(q, k, v, log_w, -a, 0.5 * a, chunk=16),
        "delta": lambda q: delta_rule(q, k, v, log_w[..., 0], beta, chunk=16),
        "kda": lambda q: delta_rule(q, k, v, log_w, beta, chunk=8),
    }
    for name, f in programs.items():
        for program in (f, jax.grad(lambda q, f=f: jnp.sum(f(q) ** 2))):
            text = jax.jit(program).lower(q).as_text()
            assert "custom_call" not in text and "lapack" not in text, name


HANG_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from implicit_attn.ops import dplr_rule
    g = np.random.default_rng(0)
    x = lambda: jnp.asarray(0.3 * g.standard_normal((1, 12, 256, 64)), jnp.float32)
    q, k, v, kk = x(), x(), x(), x()
    log_w, kk = -jnp.exp(x()), kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
    def loss(*xs):
        q, rest = xs[0], xs[1:]
        for _ in range(5):
            q = jnp.tanh(dplr_rule(q, rest[0], rest[1] + q, *rest[2:]))
        return jnp.sum(q ** 2)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, log_w, -kk, 0.5 * kk)
    print(max(float(jnp.abs(t).max()) for t in grads))
""")


@pytest.mark.deep
def test_gradient_through_five_chunked_layers_finishes():
    """The program that hung with the triangular solves in it (RWKV-7's shapes, L = 256, the
    gradient in every operand, XLA's default flags; on the 2-core CPU it never ended, idle, both
    pool threads in LAPACK's wait): it ends, with a finite gradient, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-c", HANG_SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert np.isfinite(float(run.stdout.split()[-1]))


@pytest.mark.parametrize("sequential", [False, True], ids=["loop", "sequential_grid"])
@pytest.mark.parametrize("form", ["rwkv7", "rwkv6"])
def test_pallas_chunk_recurrence_equals_the_float64_recurrence(sequential, form):
    """The Pallas kernel of ``M_h`` for ``DplrCore`` (``calls.head_matrices``, interpret mode) in
    both forms (the in-program loop of Triton and the interpreter; Mosaic's sequential grid axis
    with the state in scratch), RWKV-7's low-rank transition and RWKV-6's read before the update
    with a bonus; L = 37 in chunks of 8."""
    L = 37
    q, k, _, log_w, a, b = rwkv7_inputs(2, 3, L, 6, 1, seed=21, decay=0.61 if form == "rwkv7" else 5.0)
    eye = np.broadcast_to(np.eye(L), (2, 3, L, L))
    if form == "rwkv7":
        core = DplrCore(*f32(q, k, log_w), head=jnp.arange(3), a=jnp.asarray(a, jnp.float32),
                        b=jnp.asarray(b, jnp.float32))
        ref = recurrence(q, k, eye, log_w, a, b)
    else:
        bonus = np.random.default_rng(22).standard_normal((2, 3, L))
        core = DplrCore(*f32(q, k, log_w), head=jnp.arange(3), bonus=jnp.asarray(bonus, jnp.float32), after=False)
        ref = recurrence(q, k, eye, log_w, after=False) + bonus[..., None] * np.eye(L)
    M = np.asarray(calls.head_matrices(plans.plan_dplr(core, None, 8), calls.Target("interpret", sequential)))
    assert M.shape == (2, 3, L, L) and not np.triu(M, 1).any()
    assert rel(M, ref) <= 2e-6


def test_core_is_the_gated_recurrence_per_channel():
    """``DplrCore``'s ``H_c = diag(left_c) M_h diag(right_c)`` applied to values is the recurrence
    run on each channel's values with the gates around it; ``head_matrices`` gives ``M_h``."""
    B, H, L, dk, P = 2, 2, 19, 4, 3
    q, k, v, log_w, a, b = rwkv7_inputs(B, H, L, dk, P, seed=23)
    g = np.random.default_rng(24)
    left, right = g.standard_normal((B, H * P, L)), g.uniform(0.5, 1.5, (B, H * P, L))
    core = DplrCore(*f32(q, k, log_w), head=jnp.repeat(jnp.arange(H), P), a=jnp.asarray(a, jnp.float32),
                    b=jnp.asarray(b, jnp.float32), left=jnp.asarray(left, jnp.float32),
                    right=jnp.asarray(right, jnp.float32))
    vals = v.transpose(0, 1, 3, 2).reshape(B, H * P, L)  # channel h P + p is value p of head h
    want = left.reshape(B, H, P, L) * recurrence(q, k, (right * vals).reshape(B, H, P, L).transpose(0, 1, 3, 2),
                                                 log_w, a, b).transpose(0, 1, 3, 2)
    op = Mamba2Operator(values=jnp.asarray(vals, jnp.float32), offset=jnp.zeros((B, H * P, L)),
                        output=jnp.asarray(want.reshape(B, H * P, L), jnp.float32), core=core)
    assert op.relative_error() <= 2e-6
    eye = np.broadcast_to(np.eye(L), (B, H, L, L))
    assert rel(op.head_matrices("alpha"), recurrence(q, k, eye, log_w, a, b)) <= 2e-6
    assert core.named_factors()["log_decay"].shape == (B, H, L, dk)


def test_bad_low_rank_arguments_fail_loudly():
    q, k, v, log_w, a, _ = f32(*rwkv7_inputs(1, 1, 5, 4, 2))
    with pytest.raises(ValueError, match="both low-rank vectors"):
        dplr_rule(q, k, v, log_w, a=a)
    with pytest.raises(ValueError, match="both low-rank vectors"):
        dplr_matrix(q, k, log_w, b=a)


# ----------------------------------------------------------------------------- fla's references
# (the ``fla_naive`` fixture is in conftest.py)


def test_matches_fla_dplr_recurrence(fla_naive):
    """fla's ``dplr_recurrence`` (what ``chunk_rwkv7`` computes; key-major state, queries scaled by
    ``d_k^-1/2`` inside) on RWKV-7-shaped inputs."""
    import torch

    ref_fn = fla_naive("fla/ops/generalized_delta_rule/dplr/naive.py").dplr_recurrence
    dk = 16
    q, k, v, log_w, a, b = rwkv7_inputs(2, 3, 45, dk, 8, seed=3)
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # it computes in float32 (and mixes no other)
    ref, _ = ref_fn(t(q * dk ** 0.5), t(k), t(v), t(a), t(b), t(log_w))
    ours = dplr_rule(*f32(q, k, v, log_w, a, b), chunk=16)
    assert rel(ours, ref.numpy()) <= 1e-5


def test_matches_fla_rwkv6_recurrence(fla_naive):
    """fla's ``naive_recurrent_rwkv6`` (read before the update plus the bonus ``u``): ours is the
    read-before matrix plus the bonus on the diagonal."""
    import torch

    ref_fn = fla_naive("fla/ops/rwkv6/recurrent_naive.py").naive_recurrent_rwkv6
    q, k, v, log_w, _, _ = rwkv7_inputs(2, 3, 41, 8, 5, seed=4, decay=5.0)
    u = np.random.default_rng(5).standard_normal((3, 8))
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # it computes in float32
    ref, _ = ref_fn(t(q), t(k), t(v), t(log_w), t(u), scale=1.0)
    bonus = np.einsum("bhid,hd,bhid->bhi", q, u, k)
    M = np.asarray(dplr_matrix(*f32(q, k, log_w), bonus=jnp.asarray(bonus, jnp.float32), chunk=8, after=False))
    assert rel(np.einsum("bhij,bhjv->bhiv", M, v), ref.numpy()) <= 1e-5
    assert rel(dplr_rule(*f32(q, k, v, log_w), bonus=jnp.asarray(bonus, jnp.float32), chunk=16, after=False),
               ref.numpy()) <= 1e-5


# The fused CPU kernel's recurrence (kernels.cpu.dplr_scan: RWKV-5/6/7's forward) against the
# float64 recurrence above and the chunked form: both readings, with and without the low-rank
# term, RWKV-5/6's bonus; d_v = 7 (a partial vector) and 70 (more than one block of vectors).
@pytest.mark.parametrize("low_rank, after, bonus, dv", [(True, True, False, 7), (False, False, True, 70),
                                                        (True, False, True, 21), (False, True, False, 16)])
def test_cpu_kernel_equals_the_float64_recurrence(low_rank, after, bonus, dv):
    from implicit_attn.kernels import cpu

    q, k, v, log_w, a, b = rwkv7_inputs(2, 3, 29, 6, dv, seed=3, decay=2.0)
    a, b = (a, b) if low_rank else (None, None)
    u = np.random.default_rng(4).standard_normal((2, 3, 29)) if bonus else None
    want = recurrence(q, k, v, log_w, a, b, after=after) + (0.0 if u is None else u[..., None] * v)
    got = jax.jit(cpu.dplr_scan, static_argnames="after")(*f32(q, k, v, log_w, a, b, u), after=after)
    assert rel(got, want) <= 1e-5
    assert rel(got, np.asarray(dplr_rule(*f32(q, k, v, log_w, a, b, u), after=after), np.float64)) <= 1e-5


def test_cpu_kernel_derivatives_vmap_and_bad_arguments(monkeypatch):
    from implicit_attn.kernels import cpu
    from test_cpu_kernel import check_forward_kernel

    args = f32(*rwkv7_inputs(2, 2, 13, 5, 6, seed=5))
    ref = lambda *x: dplr_rule(*x, after=True)
    check_forward_kernel(lambda *x: cpu.dplr_scan(*x, after=True), ref, args, (0,) * 6, monkeypatch)
    with pytest.raises(ValueError, match="both low-rank vectors"):
        cpu.dplr_scan(*args[:5])
    with pytest.raises(ValueError, match="bonus"):
        cpu.dplr_scan(*args[:4], bonus=args[0])


def test_rwkv_forwards_take_the_cpu_kernel_where_it_pays_off(monkeypatch):
    """``rwkv6.block.dplr_outputs`` (RWKV-5/6/7's recurrence) lowers the kernel's call on CPU from
    ``SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS`` state updates on, the chunked form below it and
    in an export for an accelerator, with the same numbers."""
    from implicit_attn.families.rwkv6.block import dplr_outputs
    from implicit_attn.kernels import cpu

    args = f32(*rwkv7_inputs(1, 2, 12, 4, 5, seed=6))
    run = lambda *x: dplr_outputs(*x, after=True, chunk=4)
    lowered = lambda *a: jax.jit(lambda *x: run(*x)).lower(*a).as_text()  # traced anew: the choice is made then
    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 1)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 2 * 12 * 4 * 5)
    assert "implicit_attn_dplr_scan" in lowered(*args)
    assert "implicit_attn_dplr_scan" not in jax.export.export(jax.jit(run), platforms=["cuda"])(*args).mlir_module()
    fast = jax.jit(lambda *x: run(*x))(*args)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 2 * 12 * 4 * 5 + 1)
    assert "implicit_attn_dplr_scan" not in lowered(*args)
    assert rel(fast, np.asarray(jax.jit(lambda *x: run(*x))(*args), np.float64)) <= 1e-5
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 0)


def check_head_kernel_call(core, heads, target, monkeypatch):
    """``kernels.cpu.head_matrices(core, heads)`` lowers the kernel ``target``; under vmap each example
    equals its call alone; one thread and three give the same bits."""
    from implicit_attn.kernels import cpu

    run = jax.jit(cpu.head_matrices)
    assert target in run.lower(core, heads).as_text()
    qs = jnp.stack([core.q, -2 * core.q])
    stacked = jax.vmap(lambda x: cpu.head_matrices(dataclasses.replace(core, q=x), heads))(qs)
    for n in range(2):
        assert np.array_equal(stacked[n], run(dataclasses.replace(core, q=qs[n]), heads))
    threads = {}
    for n in (1, 3):
        monkeypatch.setattr(cpu, "num_threads", lambda n=n: n)
        threads[n] = np.asarray(jax.jit(lambda c, h: cpu.head_matrices(c, h))(core, heads))  # traced anew
    assert np.array_equal(threads[1], threads[3])


# The CPU kernel of the head matrices without low-rank terms (kernels.cpu.head_matrices: RWKV-5/6's
# DplrCore in materialize and reduce), entry by entry against the float64 definition.
@pytest.mark.parametrize("L, dk, after, bonus", [(37, 6, False, True), (70, 20, True, False), (16, 64, False, False),
                                                 (17, 3, True, True), (1, 5, False, True), (1, 5, True, False)])
def test_cpu_decay_matrix_is_exact_entry_by_entry(L, dk, after, bonus, monkeypatch):
    """Strong decays (e^-5 to e^-20) in some dimensions and weak ones in the others, a reset (-inf),
    ragged last chunks, ``d_k`` from 3 to 64 (partial vectors), both readings, with and without
    the bonus; a head subset in a new order, and the same bits from one thread and three."""
    from implicit_attn.kernels import cpu

    g = np.random.default_rng(L + dk)
    B, H = 2, 3
    q, k = g.standard_normal((B, H, L, dk)), g.standard_normal((B, H, L, dk))
    strong = g.uniform(size=(B, H, 1, dk)) < 0.5
    log_w = np.where(strong, -g.uniform(5.0, 20.0, (B, H, L, dk)), -g.uniform(0.0, 0.1, (B, H, L, dk)))
    log_w[0, 1, L // 2, 0] = -np.inf
    u = g.standard_normal((B, H, L)) if bonus else None
    core = DplrCore(*f32(q, k, log_w), head=jnp.arange(H), bonus=None if u is None else jnp.asarray(u, jnp.float32),
                    after=after)
    assert cpu.head_matrix_kernel(core) == "decay"
    heads = jnp.asarray([2, 0, 1])
    run = jax.jit(cpu.head_matrices)
    M = np.asarray(run(core, heads), np.float64)
    ref, size = decay_matrix64(q, k, log_w, after, u)
    ref, size = ref[:, [2, 0, 1]], size[:, [2, 0, 1]]
    assert not np.triu(M, 1 if after or bonus else 0).any()
    assert (np.abs(M - ref) <= 1e-5 * size + 1e-37).all()
    check_head_kernel_call(core, heads, "implicit_attn_decay_matrix", monkeypatch)


def test_cpu_decay_matrix_nan_rows_like_xla_and_where_it_applies():
    """A NaN key at position 21: the kernel's matrix has NaN exactly where XLA's ``dplr_matrix`` has
    (rows from 22 on), and equals it elsewhere. The kernel takes only cores without low-rank
    terms, without given matrices and with ``d_k <= MAX_STATE``; the others go to XLA."""
    from implicit_attn.kernels import cpu

    g = np.random.default_rng(0)
    q, k = (g.standard_normal((1, 2, 40, 4)) for _ in range(2))
    log_w = -g.uniform(0.0, 8.0, (1, 2, 40, 4))
    k[0, 0, 21] = np.nan
    core = DplrCore(*f32(q, k, log_w), head=jnp.arange(2), after=False)
    M = np.asarray(cpu.head_matrices(core, jnp.arange(2)))
    X = np.asarray(dplr_matrix(*f32(q, k, log_w), chunk=16, after=False))
    assert np.array_equal(np.isnan(M), np.isnan(X)) and np.isnan(M[0, 0, 22:, 21]).all()
    assert np.isfinite(M[0, 0, :22]).all() and np.isfinite(M[0, 1]).all()
    ok = ~np.isnan(X)
    assert rel(M[ok], X[ok]) <= 1e-5
    _, _, _, lw, a, b = rwkv7_inputs(1, 1, 5, 4, 1)
    small = DplrCore(*f32(q[:, :1, :5], k[:, :1, :5], lw), head=jnp.arange(1))
    assert cpu.head_matrix_kernel(small) == "decay"
    assert cpu.head_matrix_kernel(dataclasses.replace(small, a=f32(a)[0], b=f32(b)[0])) == "lowrank"
    assert cpu.head_matrix_kernel(small.precompute()) is None
    wide = DplrCore(*f32(*(g.standard_normal((1, 1, 5, cpu.MAX_STATE + 1)) for _ in range(3))), head=jnp.arange(1))
    assert cpu.head_matrix_kernel(wide) == "lowrank"


# The CPU kernel of the head matrices with the low-rank term (RWKV-7; any d_k): each row's query
# taken back through the steps, sixteen rows at a time.
@pytest.mark.parametrize("L, dk, after, bonus, low_rank", [(37, 6, True, False, True), (29, 5, False, True, True),
                                                           (70, 20, True, True, True), (29, 70, False, True, False),
                                                           (1, 4, True, False, True), (16, 3, False, False, True)])
def test_cpu_lowrank_matrix_equals_the_float64_recurrence(L, dk, after, bonus, low_rank, monkeypatch):
    """RWKV-7's shape (decays down to e^-2 a step, the low-rank term of unit-norm keys), both
    readings, with and without the bonus, ragged and whole blocks of sixteen rows, L = 1, and
    ``d_k = 70`` without a low-rank term (above the decay kernel's limit); a head subset in a new
    order, under vmap each example as alone, the same bits from one thread and three."""
    from implicit_attn.kernels import cpu

    q, k, _, log_w, a, b = rwkv7_inputs(2, 3, L, dk, 1, seed=L + dk, decay=2.0)
    a, b = (a, b) if low_rank else (None, None)
    u = np.random.default_rng(L).standard_normal((2, 3, L)) if bonus else None
    core = DplrCore(*f32(q, k, log_w), head=jnp.arange(3), a=None if a is None else f32(a)[0],
                    b=None if b is None else f32(b)[0], bonus=None if u is None else f32(u)[0], after=after)
    assert cpu.head_matrix_kernel(core) == "lowrank"
    heads = jnp.asarray([1, 2, 0])
    run = jax.jit(cpu.head_matrices)
    M = np.asarray(run(core, heads), np.float64)
    want = recurrence(q, k, np.broadcast_to(np.eye(L), (2, 3, L, L)), log_w, a, b, after)
    if u is not None:
        want = want + u[..., None] * np.eye(L)
    want = want[:, [1, 2, 0]]
    assert not np.triu(M, 1 if after or bonus else 0).any()
    assert rel(M, want) <= 1e-5
    check_head_kernel_call(core, heads, "implicit_attn_lowrank_matrix", monkeypatch)


def test_cpu_lowrank_matrix_nan_rows_like_xla():
    """A NaN key at position 21: the kernel's NaN entries are XLA's ``dplr_matrix``'s (none before row
    21), and the other entries equal it. A reset (log decay -inf) at position 30 of the other head:
    equal to XLA's there too."""
    from implicit_attn.kernels import cpu

    q, k, _, log_w, a, b = rwkv7_inputs(1, 2, 40, 4, 1, seed=9)
    k[0, 0, 21] = np.nan
    log_w[0, 1, 30, 2] = -np.inf
    core = DplrCore(*f32(q, k, log_w), head=jnp.arange(2), a=f32(a)[0], b=f32(b)[0])
    M = np.asarray(cpu.head_matrices(core, jnp.arange(2)))
    X = np.asarray(dplr_matrix(*f32(q, k, log_w, a, b), chunk=16))
    assert np.array_equal(np.isnan(M[0, 0]), np.isnan(X[0, 0])) and np.isnan(M[0, 0, 21:, 21]).all()
    assert np.isfinite(M[0, 0, :21]).all() and np.isfinite(M[0, 1]).all()
    ok = ~np.isnan(X[0, 0])
    assert rel(M[0, 0][ok], X[0, 0][ok]) <= 1e-5 and rel(M[0, 1], X[0, 1]) <= 1e-5
