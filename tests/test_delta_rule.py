"""The gated delta rule's exact token-mixing matrix (``ops.delta_rule``, ``ops.delta_rule_matrix``,
``operator.DeltaRuleCore``) against two independent references: a float64 step-by-step
recurrence of the state (``S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``, ``o_t = S_t
q_t``) and HF's torch chunked kernel (``torch_chunk_gated_delta_rule`` of Qwen3-Next, with its
own q/k normalisation). Write strengths near 0 and near 2 (negative eigenvalues), long inputs,
grouped heads, the chunk length, the ``delta=False`` approximation, and Kimi Delta Attention's
per-dimension decays (against the recurrence and HF's torch KDA kernel)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.kernels.pallas import calls, plans
from implicit_attn.operator import DeltaRuleCore, ImplicitOperator, Mamba2Operator
from implicit_attn.ops import decay_matrix, delta_rule, delta_rule_matrix, grouped_transfer_matrix, unit_lower_inverse

from conftest import torch_or_skip


def recurrence(q, k, v, log_a, beta, erase=True):
    """Float64 ``o (B, H, L, d_v)`` of the delta rule, one step at a time: the state decays
    (``log_a (B, H, L)`` per head, or ``(B, H, L, d_k)`` per key dimension), then the erasure
    (unless ``erase`` is False), then the write."""
    B, H, L, dk = k.shape
    o = np.zeros(v.shape[:3] + (v.shape[-1],))
    for b in range(B):
        for h in range(H):
            S = np.zeros((v.shape[-1], dk))
            for t in range(L):
                kt = k[b, h, t]
                S = S * np.exp(log_a[b, h, t])  # a scalar, or one factor per key column
                if erase:
                    S = S - beta[b, h, t] * np.outer(S @ kt, kt)
                S = S + beta[b, h, t] * np.outer(v[b, h, t], kt)
                o[b, h, t] = S @ q[b, h, t]
    return o


def inputs(B, H, L, dk, dv, beta_range, seed=0, decay=1.0):
    """Random float64 ``q, k, v, log_a, beta`` with keys of unit norm and queries scaled by
    ``dk^-0.5`` (as Qwen3-Next's kernel normalises them)."""
    g = np.random.default_rng(seed)
    unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    q = unit(g.standard_normal((B, H, L, dk))) * dk ** -0.5
    k = unit(g.standard_normal((B, H, L, dk)))
    v = g.standard_normal((B, H, L, dv))
    log_a = -g.uniform(0.0, decay, (B, H, L))
    beta = g.uniform(*beta_range, (B, H, L))
    return q, k, v, log_a, beta


f32 = lambda *xs: tuple(jnp.asarray(x, jnp.float32) for x in xs)
rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("L, dk, chunk, beta_range", [(11, 4, 4, (0.0, 1.0)), (37, 8, 16, (0.0, 2.0)),
                                                      (64, 8, 64, (1.9, 2.0)), (50, 6, 8, (0.0, 0.01))],
                         ids=["small", "up_to_2", "near_2", "near_0"])
def test_outputs_and_matrix_equal_the_float64_recurrence(L, dk, chunk, beta_range):
    q, k, v, log_a, beta = inputs(2, 3, L, dk, 5, beta_range)
    ref = recurrence(q, k, v, log_a, beta)
    assert rel(delta_rule(*f32(q, k, v, log_a, beta), chunk=chunk), ref) <= 2e-6
    M = np.asarray(delta_rule_matrix(*f32(q, k, log_a, beta), chunk=chunk))
    assert not np.triu(M, 1).any()  # exact zeros above the diagonal
    assert rel(np.einsum("bhij,bhjv->bhiv", M, v), ref) <= 2e-6
    eye = np.broadcast_to(np.eye(L), (2, 3, L, L))
    assert rel(M, recurrence(q, k, eye, log_a, beta)) <= 2e-6


@pytest.mark.parametrize("L, chunk, beta_range, erase", [(23, 8, (0.0, 1.0), True), (40, 16, (1.9, 2.0), True),
                                                       (33, 8, (0.0, 1.0), False)],
                         ids=["small", "near_2", "no_erasure"])
def test_per_dimension_decays_equal_the_float64_recurrence(L, chunk, beta_range, erase):
    """Kimi Delta Attention's decays, one per key dimension and strong (down to ``e^-4`` a step):
    outputs and the matrix equal the float64 recurrence."""
    q, k, v, _, beta = inputs(2, 3, L, 6, 5, beta_range, seed=7)
    log_a = -np.random.default_rng(8).uniform(0.0, 4.0, (2, 3, L, 6))
    ref = recurrence(q, k, v, log_a, beta, erase)
    assert rel(delta_rule(*f32(q, k, v, log_a, beta), chunk=chunk, erase=erase), ref) <= 2e-6
    M = np.asarray(delta_rule_matrix(*f32(q, k, log_a, beta), chunk=chunk, erase=erase))
    assert not np.triu(M, 1).any()
    assert rel(M, recurrence(q, k, np.broadcast_to(np.eye(L), (2, 3, L, L)), log_a, beta, erase)) <= 2e-6


@pytest.mark.parametrize("sequential", [False, True], ids=["loop", "sequential_grid"])
@pytest.mark.parametrize("per_dim, beta_range, erase", [(False, (0.0, 2.0), True), (False, (1.9, 2.0), True),
                                                        (True, (0.0, 1.0), True), (True, (0.0, 1.0), False)],
                         ids=["up_to_2", "near_2", "per_dim", "per_dim_no_erasure"])
def test_pallas_chunk_recurrence_equals_the_float64_recurrence(sequential, per_dim, beta_range, erase):
    """The Pallas kernel of ``M_h`` (``kernels.pallas.calls.delta_matrices``, interpret mode) in
    both forms: the in-program loop over row chunks (Triton, the interpreter) and the sequential
    grid axis with the state in scratch (Mosaic TPU). L = 37 in chunks of 8: a ragged last chunk."""
    L = 37
    q, k, _, log_a, beta = inputs(2, 3, L, 6, 1, beta_range, seed=11)
    if per_dim:
        log_a = -np.random.default_rng(12).uniform(0.0, 4.0, (2, 3, L, 6))
    core = DeltaRuleCore(*f32(q, k, log_a, beta), head=jnp.arange(3), delta=erase)
    target = calls.Target("interpret", channel_grid=sequential)
    M = np.asarray(calls.head_matrices(plans.plan_delta(core, None, 8), target))
    assert M.shape == (2, 3, L, L) and not np.triu(M, 1).any()
    assert rel(M, recurrence(q, k, np.broadcast_to(np.eye(L), (2, 3, L, L)), log_a, beta, erase)) <= 2e-6


def test_matches_hf_kimi_chunked_kernel():
    """HF's torch KDA kernel (Kimi-Linear; per-dimension decays, l2-normalised q, k inside,
    queries scaled by ``d_k^-0.5``) on raw inputs: our outputs agree with it."""
    torch, _ = torch_or_skip()
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    g = np.random.default_rng(9)
    B, L, H, dk, dv = 2, 70, 3, 8, 6
    q, k, v = g.standard_normal((B, L, H, dk)), g.standard_normal((B, L, H, dk)), g.standard_normal((B, L, H, dv))
    log_a, beta = -g.uniform(0, 2, (B, L, H, dk)), g.uniform(0, 1, (B, L, H))
    t = lambda x: torch.tensor(x, dtype=torch.float32)
    ref, _ = chunk_kimi_delta_attention(t(q), t(k), t(v), g=t(log_a), beta=t(beta), initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=True)
    ref = ref.numpy().transpose(0, 2, 1, 3)  # (B, H, L, dv)
    unit = lambda x: (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)).transpose(0, 2, 1, 3)
    ours = delta_rule(*f32(unit(q) * dk ** -0.5, unit(k), v.transpose(0, 2, 1, 3), log_a.transpose(0, 2, 1, 3),
                           beta.transpose(0, 2, 1)))
    assert rel(ours, ref) <= 1e-5


@pytest.mark.parametrize("C", [1, 2, 3, 16, 33, 64])
def test_unit_lower_inverse_equals_the_float64_inverse(C):
    """The recursive block inverse (what the chunk solves use) against numpy's float64 inverse of
    the unit lower-triangular part; the diagonal and the part above it are junk it must not read."""
    g = np.random.default_rng(C)
    unit = np.tril(g.standard_normal((2, 3, C, C)), -1) * 0.3 + np.eye(C)
    junk = unit + np.triu(g.standard_normal((C, C)))
    got = np.asarray(unit_lower_inverse(jnp.asarray(junk, jnp.float32)))
    np.testing.assert_allclose(got, np.linalg.inv(unit), atol=2e-6 * np.abs(np.linalg.inv(unit)).max())
    assert not np.triu(got, 1).any()


def test_chunk_length_changes_only_rounding():
    q, k, _, log_a, beta = inputs(1, 2, 45, 8, 1, (0.0, 1.5), seed=1)
    Ms = [np.asarray(delta_rule_matrix(*f32(q, k, log_a, beta), chunk=c)) for c in (1, 7, 16, 64)]
    for M in Ms[1:]:
        np.testing.assert_allclose(M, Ms[0], atol=2e-6)


@pytest.mark.parametrize("per_dim", [False, True], ids=["per_head", "per_key_dim"])
def test_long_input_is_finite_and_exact(per_dim):
    """L = 4096 with strong decays (one per head, or one per key dimension as in KDA) and writes
    near 2: finite, and every row equals the float64 recurrence (the chunked form never
    exponentiates a large positive number)."""
    L = 4096
    q, k, v, log_a, beta = inputs(1, 1, L, 4, 3, (0.5, 2.0), seed=2, decay=3.0)
    if per_dim:
        log_a = -np.random.default_rng(10).uniform(0.0, 3.0, (1, 1, L, 4))
    M = np.asarray(jax.jit(delta_rule_matrix)(*f32(q, k, log_a, beta)))
    assert np.isfinite(M).all()
    ref = recurrence(q, k, v, log_a, beta)
    assert rel(np.einsum("bhij,bhjv->bhiv", M, v), ref) <= 1e-5


def test_matches_hf_qwen3_next_chunked_kernel():
    """HF's torch kernel (l2-normalised q, k inside, queries scaled by ``d_k^-0.5``, grouped
    value heads) on raw inputs: our outputs and ``M @ v`` agree with it."""
    torch, _ = torch_or_skip()
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    g = np.random.default_rng(3)
    B, L, Hk, Hv, dk, dv = 2, 70, 2, 4, 8, 6
    q, k = g.standard_normal((B, L, Hk, dk)), g.standard_normal((B, L, Hk, dk))
    v = g.standard_normal((B, L, Hv, dv))
    log_a, beta = -g.uniform(0, 1, (B, L, Hv)), g.uniform(0, 1, (B, L, Hv))
    t = lambda x: torch.tensor(x, dtype=torch.float32)
    ref, _ = torch_chunk_gated_delta_rule(t(q), t(k), t(v), g=t(log_a), beta=t(beta), use_qk_l2norm_in_kernel=True)
    ref = ref.numpy().transpose(0, 2, 1, 3)  # (B, Hv, L, dv)
    unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    rep = lambda x: np.repeat(x.transpose(0, 2, 1, 3), Hv // Hk, axis=1)  # value head h reads key head h // 2
    qn, kn = rep(unit(q)) * dk ** -0.5, rep(unit(k))
    ours = delta_rule(*f32(qn, kn, v.transpose(0, 2, 1, 3), log_a.transpose(0, 2, 1), beta.transpose(0, 2, 1)))
    assert rel(ours, ref) <= 1e-5
    # the same through the core: channels = value heads x d_v, key head = value head // 2
    core = DeltaRuleCore(q=jnp.asarray(unit(q).transpose(0, 2, 1, 3) * dk ** -0.5, jnp.float32),
                         k=jnp.asarray(unit(k).transpose(0, 2, 1, 3), jnp.float32),
                         log_a=jnp.asarray(log_a.transpose(0, 2, 1), jnp.float32),
                         beta=jnp.asarray(beta.transpose(0, 2, 1), jnp.float32),
                         head=jnp.repeat(jnp.arange(Hv), dv), heads_per_group=Hv // Hk)
    values = jnp.asarray(v.transpose(0, 2, 3, 1).reshape(B, Hv * dv, L), jnp.float32)  # (B, C, L)
    op = Mamba2Operator(values=values, offset=jnp.zeros_like(values), output=jnp.asarray(
        ref.transpose(0, 1, 3, 2).reshape(B, Hv * dv, L)), core=core)
    assert op.relative_error() <= 1e-5
    H = np.asarray(op.head_matrices())
    assert H.shape == (B, Hv, L, L)
    np.testing.assert_allclose(np.asarray(op.materialize(channels=[0, dv, 3 * dv + 1]))[:, 1], H[:, 1], atol=1e-6)


def test_core_factors_conv_and_the_no_delta_approximation():
    """``DeltaRuleCore`` is ``diag(left) M diag(right) Conv`` per channel; ``head_matrices("mean")``
    averages a head's channels; ``delta=False`` is ``tril(q k^T * Gamma) diag(b)``, which misses
    the exact matrix by a large margin (the heuristic others report)."""
    B, H, L, dk, P, K = 1, 2, 13, 4, 3, 3
    q, k, _, log_a, beta = inputs(B, H, L, dk, 1, (0.2, 1.0), seed=4)
    g = np.random.default_rng(5)
    C = H * P
    left, right = g.uniform(0.5, 1.5, (B, C, L)), g.uniform(0.5, 1.5, (B, C, L))
    conv_w = g.standard_normal((C, K))
    args = dict(q=jnp.asarray(q, jnp.float32), k=jnp.asarray(k, jnp.float32), log_a=jnp.asarray(log_a, jnp.float32),
                beta=jnp.asarray(beta, jnp.float32), head=jnp.repeat(jnp.arange(H), P),
                left=jnp.asarray(left, jnp.float32), right=jnp.asarray(right, jnp.float32),
                conv_w=jnp.asarray(conv_w, jnp.float32))
    core = DeltaRuleCore(**args)
    Hd = np.asarray(core.dense(jnp.arange(C)))
    M = recurrence(q, k, np.broadcast_to(np.eye(L), (B, H, L, L)), log_a, beta)
    conv = np.zeros((C, L, L))
    for d in range(K):
        for i in range(d, L):
            conv[:, i, i - d] = conv_w[:, K - 1 - d]
    want = left[..., :, None] * M[:, np.repeat(np.arange(H), P)] * right[..., None, :] @ conv
    assert rel(Hd, want) <= 2e-6
    np.testing.assert_allclose(np.asarray(jax.jit(lambda i: core.dense(i))(jnp.arange(C))), Hd, atol=1e-6)
    v = jnp.zeros((B, C, L), jnp.float32)
    op = Mamba2Operator(values=v, offset=v, output=v, core=core)
    np.testing.assert_allclose(np.asarray(op.head_matrices("mean")), Hd.reshape(B, H, P, L, L).mean(2), atol=1e-6)
    # reductions linear in H go through each head's matrix (no H_c formed): equal to the sums
    wq, wk = g.standard_normal((B, C, L)), g.standard_normal((B, C, L))
    sel = [5, 0, 2]  # a subset across heads, out of order
    want_w = np.einsum("bci,bcij,bcj->bij", wq[:, sel], want[:, sel], wk[:, sel])
    got = op.reduce("weighted", weights=wq[:, sel], key_weights=wk[:, sel], channels=sel, impl="xla")
    assert rel(got, want_w) <= 2e-6
    assert rel(op.reduce("mean", impl="xla"), want.mean(1)) <= 2e-6
    pre = core.precompute()  # every M_h once: dense reads it
    assert pre.matrices.shape == (B, H, L, L) and rel(pre.dense(jnp.arange(C)), want) <= 2e-6
    with pytest.raises(ValueError, match=r"head matrices must have shape \(1, 2, 13, 13\)"):
        core.with_head_matrices(jnp.zeros((B, H, L, L - 1)))
    approx = np.asarray(DeltaRuleCore(**args, delta=False).dense(jnp.arange(C)))
    plain = np.asarray(decay_matrix(jnp.asarray(log_a, jnp.float32))) * np.einsum("bhid,bhjd->bhij", q, k) * beta[
        :, :, None, :]
    assert rel(approx, left[..., :, None] * plain[:, np.repeat(np.arange(H), P)] * right[..., None, :] @ conv) <= 2e-6
    assert rel(approx, want) > 0.05
    assert isinstance(op, ImplicitOperator) and core.named_factors()["log_decay"].shape == (B, H, L)


@pytest.mark.parametrize("per_dim", [False, True], ids=["per_head", "per_key_dim"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_materialize_exports_for_accelerators(platform, per_dim):
    """The chunked form (matmuls: the chunk solves are block inverses, ``ops.unit_lower_inverse``)
    lowers for cuda and tpu, with one decay per head and with one per key dimension."""
    q, k, _, log_a, beta = inputs(1, 2, 40, 8, 1, (0.0, 2.0), seed=6)
    if per_dim:
        log_a = -np.random.default_rng(11).uniform(0.0, 1.0, (1, 2, 40, 8))
    fn = jax.jit(lambda *a: delta_rule_matrix(*a, chunk=16))
    exported = jax.export.export(fn, platforms=[platform])(*f32(q, k, log_a, beta))
    text = exported.mlir_module()
    assert "dot_general" in text and exported.out_avals[0].shape == (1, 2, 40, 40)


@pytest.mark.parametrize("dense", [False, True], ids=["diagonal", "dense"])
@pytest.mark.parametrize("n, group", [(9, 4)])
def test_grouped_transfer_matrix_equals_the_float64_chunk_products(dense, n, group):
    """Block ``(I, K)`` of ``grouped_transfer_matrix`` is ``R_I P_{I-1} ... P_{K+1} J_K`` (``D_I`` on the
    diagonal blocks, 0 above), in float64 from the chunks' own factors: groups that do not divide
    the chunks (a padded last group)."""
    g = np.random.default_rng(n + group)
    C, dk = 3, 4
    R, J = g.standard_normal((n, 1, 2, C, dk)), g.standard_normal((n, 1, 2, dk, C))
    P = g.standard_normal((n, 1, 2, dk, dk)) / 2 if dense else g.uniform(0, 1, (n, 1, 2, dk))
    D = np.tril(g.standard_normal((n, 1, 2, C, C)))
    full = P if dense else P[..., :, None] * np.eye(dk)
    want = np.zeros((1, 2, n * C, n * C))
    for I in range(n):
        want[:, :, I * C:(I + 1) * C, I * C:(I + 1) * C] = D[I]
        for K in range(I):
            T = np.broadcast_to(np.eye(dk), (1, 2, dk, dk))
            for c in range(K + 1, I):
                T = full[c] @ T
            want[:, :, I * C:(I + 1) * C, K * C:(K + 1) * C] = R[I] @ T @ J[K]
    got = grouped_transfer_matrix(*(jnp.asarray(x, jnp.float32) for x in (R, P, J, D)), group)
    assert float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()) <= 1e-6


@pytest.mark.parametrize("per_dim, erase", [(False, True), (True, True), (True, False), (False, False)])
def test_cpu_head_matrices_equal_the_float64_recurrence(per_dim, erase):
    """``kernels.cpu.head_matrices`` of a ``DeltaRuleCore`` (two value heads per key head, per-head or
    per-dimension decays, with and without the erasure: the low-rank and the decay kernel) equals
    the float64 recurrence with the identity as values, and XLA's ``delta_rule_matrix``."""
    from implicit_attn.kernels import cpu

    B, G, L, dk = 2, 2, 37, 8
    q, k, _, _, _ = inputs(B, G, L, dk, 1, (0.0, 2.0), seed=31)
    _, _, _, log_a, beta = inputs(B, 2 * G, L, dk, 1, (0.0, 2.0), seed=32, decay=2.0)
    if per_dim:
        log_a = -np.random.default_rng(33).uniform(0.0, 2.0, (B, 2 * G, L, dk))
    core = DeltaRuleCore(*f32(q, k, log_a, beta), head=jnp.arange(2 * G), heads_per_group=2, delta=erase)
    assert cpu.head_matrix_kernel(core) == ("lowrank" if erase else "decay")
    heads = jnp.asarray([3, 0, 2])
    M = np.asarray(jax.jit(cpu.head_matrices)(core, heads), np.float64)
    g = np.asarray(heads) // 2
    eye = np.broadcast_to(np.eye(L), (B, 3, L, L))
    want = recurrence(q[:, g], k[:, g], eye, log_a[:, np.asarray(heads)], beta[:, np.asarray(heads)], erase)
    assert not np.triu(M, 1).any()
    assert rel(M, want) <= 1e-5
    assert rel(M, np.asarray(core.alpha(heads), np.float64)) <= 1e-5
