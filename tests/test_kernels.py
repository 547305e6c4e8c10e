"""Pallas kernels (interpret mode on CPU) against the XLA reference path.

Operators come from every family's own pure functions on random weights (tiny
configs), so the cores are exactly what the models produce. Tile 8 with L = 37 gives
5 x 5 tiles (a ragged last tile, tiles between row and column tiles); L = 1 and
batch 2 are covered too.
"""
import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from implicit_attn import kernels
from implicit_attn.families.xlstm.naive import naive_head_matrix
from implicit_attn.kernels import cpu, pallas
from implicit_attn.kernels.pallas import calls, plans
from implicit_attn.operator import DocumentMaskedCore, ImplicitOperator, ParallelCore, resolve_impl
from traced import assert_full_float32_products
from kernel_cores import BUILDERS, NOT_CAUSAL, SYNTHETIC, NoKernelCore, griffin_op, mamba2_op, scalar_lowrank_op

B, L, TILE = 2, 37, 8  # the builders' default shapes; tile 8 gives 5 x 5 tiles
HOWS = ("mean", "abs_mean", "pos_mean", "weighted")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# conftest.xdist_group: `ops` builds every core once; the tests named after a family stay with the file
ONE_WORKER = True


@pytest.fixture(scope="module", autouse=True)
def small_tile():
    old = pallas.DEFAULT_TILE
    pallas.DEFAULT_TILE = TILE
    yield
    pallas.DEFAULT_TILE = old


@pytest.fixture(scope="module")
def ops():
    return {k: f() for k, f in BUILDERS.items()}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_materialize_and_reduce_match_xla(ops, family):
    op = ops[family]
    C = op.shape[1]
    chans = [C - 1, 0, 2]  # a subset, out of order
    ref = op.materialize(chans, impl="xla")
    out = op.materialize(chans, impl="pallas")
    assert out.shape == (B, 3, L, L)
    assert rel(out, ref) <= 1e-5, rel(out, ref)
    if family not in NOT_CAUSAL:
        assert np.all(np.triu(np.asarray(out), 1) == 0)  # exact zeros above the diagonal
    if family not in SYNTHETIC:  # the model's own output, through the pallas operator
        idx = jnp.asarray(chans)
        y = jnp.einsum("bcij,bcj...->bci...", out, op.values[:, idx], precision="highest") + op.offset[:, idx]
        assert rel(y, op.output[:, idx]) <= 1e-5
    w = jax.random.normal(jax.random.PRNGKey(3), (B, C, L))
    kw = jax.random.normal(jax.random.PRNGKey(4), (B, C, L))
    for how in HOWS:
        kwargs = dict(weights=w, key_weights=kw) if how == "weighted" else {}
        a = op.reduce(how, impl="pallas", **kwargs)
        b = op.reduce(how, impl="xla", **kwargs)
        assert a.shape == (B, L, L)
        assert rel(a, b) <= 1e-5, (how, rel(a, b))


# (RWKV-4's and the short conv's entries are formed elementwise: no products to check)
@pytest.mark.parametrize("family", [f for f in BUILDERS if f not in ("rwkv", "short_conv")])
def test_kernel_paths_trace_full_float32_products(ops, family):
    """``materialize``, ``reduce`` and ``reduce``'s gradient with ``impl="pallas"`` ask for HIGHEST in
    every matrix product, the XLA steps around the kernels and the XLA backward pass included. On
    an H200 (2026-12-04) the head-matrix cores' reduce was 1e-4 to 1e-3 off XLA: those steps, traced
    outside the entry points' ``full_precision``, ran in TF32."""
    op = ops[family]
    C = op.shape[1]
    w = jax.random.normal(jax.random.PRNGKey(5), (B, C, L))
    loss = lambda w: jnp.sum(op.reduce("weighted", weights=w, impl="pallas") ** 2)
    assert_full_float32_products(lambda: op.materialize([C - 1, 0], impl="pallas"),
                                 lambda: op.reduce("mean", impl="pallas"), lambda: jax.grad(loss)(w))


def mlstm_matrices64(core):
    """Every head's mLSTM matrix of ``core`` in float64 (``xlstm.naive``), rows divided by the core's
    own normaliser: ``(B, H, L, L)``."""
    q, k, log_f, log_i, m, norm = (np.asarray(x, np.float64) for x in
                                   (core.q, core.k, core.log_f, core.log_i, core.m, core.norm))
    return naive_head_matrix(q, k, log_f, log_i, m, norm=norm)


def test_mlstm_kernel_keeps_the_gates_inside_the_exponential(ops):
    """The mLSTM's tiles (the scalar plan over its heads, ``plans.plan_mlstm``) equal the float64
    matrices; with the input gates and the stabiliser both raised by 100 (the same matrices: only
    ``log i_j - m_i`` enters) they still do, where ``e^{log i}`` alone overflows float32."""
    op = ops["mlstm"]
    C = op.shape[1]
    want = op.core.with_head_matrices(jnp.asarray(mlstm_matrices64(op.core), jnp.float32)).dense(jnp.arange(C))
    assert rel(op.materialize(impl="pallas"), want) <= 1e-5
    raised = dataclasses.replace(op.core, log_i=op.core.log_i + 100.0, m=op.core.m + 100.0)
    assert float(raised.log_i.max()) > np.log(np.finfo(np.float32).max)  # e^{log i} alone: inf
    big = dataclasses.replace(op, core=raised)
    for impl in ("pallas", "xla"):
        assert rel(big.materialize(impl=impl), want) <= 1e-4, impl
    assert rel(big.reduce("abs_mean", impl="pallas"), op.reduce("abs_mean", impl="xla")) <= 1e-4


def test_a_plan_of_heads_sums_its_heads_in_one_kernel_step(ops):
    """``calls.reduce`` of the mLSTM's plan (one ``q, k`` per channel; the interpreter, like Triton,
    loops over every channel inside one kernel step) equals the sum over its heads' float64
    matrices. The operators' reduce goes through the head matrices instead; this keeps the tiles'
    per-channel path right for any caller."""
    core = ops["mlstm"].core
    H = core.num_heads
    plan = plans.make_plan(core, jnp.arange(H), TILE)
    assert plan.heads and H > 1
    qw, kw = (jax.random.normal(jax.random.PRNGKey(s), (B, H, L)) for s in (7, 8))
    got = calls.reduce(plan, jnp.asarray(1, jnp.int32), qw, kw, calls.TARGETS["interpret"])
    M = mlstm_matrices64(core)
    want = np.einsum("bhi,bhij,bhj->bij", np.asarray(qw, np.float64), np.abs(M), np.asarray(kw, np.float64))
    assert rel(got, want) <= 1e-5


def attention64(core):
    """Every head's masked softmax of ``core`` (an ``AttentionCore``) in float64: ``(B, H, L, L)``."""
    q, k, seg = (np.asarray(x, np.float64) for x in (core.q, core.k, core.seg))
    B, H, L, _ = q.shape
    k = np.repeat(k, H // k.shape[1], axis=1)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = (j <= i) & (i - j < core.window) & (seg[:, None, :, None] == seg[:, None, None, :])
    logits = np.where(visible, np.einsum("bhid,bhjd->bhij", q, k), -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_attention_kernel_masks_window_documents_and_groups(ops):
    """Griffin's local attention with a window of 11, grouped keys and a second document: the
    kernel's probabilities (row statistics over the column tiles the window reaches) against
    float64, and its fused reduce against XLA's."""
    op = ops["attention"]
    P = attention64(op.core)
    assert np.all(P[1, :, 25, :20] == 0) and np.all(P[0, :, 25, :15] == 0)  # the document, the window
    assert rel(op.materialize(impl="pallas"), P) <= 1e-5
    assert rel(op.reduce("pos_mean", impl="pallas"), op.reduce("pos_mean", impl="xla")) <= 1e-5


def test_document_mask_zeroes_cross_document_entries(ops):
    """The Griffin operator packs two documents in batch row 1: no entry crosses the start."""
    op = ops["griffin"]
    assert type(op.core).__name__ == "DocumentMaskedCore"
    H = np.asarray(op.materialize([0, 5], impl="pallas"))
    assert np.all(H[1, :, 20:, :20] == 0) and np.any(H[0, :, 20:, :20] != 0)


def test_documents_over_mamba2_mask_its_kernels_output(ops):
    """A ``DocumentMaskedCore`` over Mamba-2: its kernel's matrices with no entry across a document
    start (exact zeros where XLA has them); over a core without a kernel the inner core is named."""
    op = ops["documents"]
    H, ref = np.asarray(op.materialize(impl="pallas")), np.asarray(op.materialize(impl="xla"))
    assert not H[1, :, L // 2:, :L // 2].any() and H[1, :, L // 2:, L // 2:].any() and H[0, :, L // 2:, :L // 2].any()
    np.testing.assert_array_equal(H == 0, ref == 0)
    assert rel(H, ref) <= 1e-5 and rel(op.reduce("abs_mean", impl="pallas"), op.reduce("abs_mean", impl="xla")) <= 1e-5
    masked = DocumentMaskedCore(inner=NoKernelCore(scale=jnp.ones((2,))), seg=jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(TypeError, match="its inner core has no kernel: no kernel for NoKernelCore"):
        pallas.pallas_dense(masked, [0])
    assert not pallas.trusted(op.core)  # Mamba-2's kernel is not verified anywhere: auto keeps XLA


def test_length_one_and_single_tile():
    op = griffin_op(L_=1)
    for chans in ([3], None):
        a, b = op.materialize(chans, impl="pallas"), op.materialize(chans, impl="xla")
        assert a.shape[-2:] == (1, 1) and rel(a, b) <= 1e-5
    assert rel(op.reduce("abs_mean", impl="pallas"), op.reduce("abs_mean", impl="xla")) <= 1e-5


def test_tile_larger_than_length_and_blocked_materialize(ops):
    """L = 37 in one 64-wide tile (ragged), and block_channels splitting the channels."""
    op = ops["mamba"]
    ref = op.materialize(impl="xla")
    a = kernels.pallas_dense(op.core, np.arange(op.shape[1]), tile=64)
    assert rel(a, ref) <= 1e-5
    b = op.materialize(impl="pallas", block_channels=3)
    assert rel(b, ref) <= 1e-5


def test_materialize_gradient_matches_xla(ops):
    """custom_vjp (backward through the XLA reference) equals the XLA path's gradient."""
    op = ops["griffin"]
    R = jax.random.normal(jax.random.PRNGKey(5), (B, 2, L, L))

    def loss(core, impl):
        o = ImplicitOperator(op.values, op.offset, op.output, core)
        return jnp.sum(o.materialize([1, 4], impl=impl) * R)

    gp = jax.jit(jax.grad(lambda c: loss(c, "pallas"), allow_int=True))(op.core)
    gx = jax.jit(jax.grad(lambda c: loss(c, "xla"), allow_int=True))(op.core)
    for name in ("log_a", "left", "right", "conv_w"):
        a, b = getattr(gp.inner, name), getattr(gx.inner, name)
        assert np.any(np.asarray(b) != 0) and rel(a, b) <= 1e-5, name


def test_reduce_gradient_matches_xla(ops):
    op = ops["rwkv"]
    C = op.shape[1]
    w = jax.random.normal(jax.random.PRNGKey(6), (B, C, L))

    def loss(core, w, impl):
        o = ImplicitOperator(op.values, op.offset, op.output, core)
        return jnp.sum(o.reduce("weighted", weights=w, impl=impl) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    gp = grad(op.core, w, "pallas")
    gx = grad(op.core, w, "xla")
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gx)):
        assert rel(a, b) <= 1e-5


def test_a_parallel_core_runs_each_part_through_its_own_kernel(ops):
    """Falcon-H1's layer: the Mamba-2 part's kernel and the attention part's, side by side.
    Channels from both parts out of order, the reduce over all channels (the attention heads'
    repeats share each head's matrix) and over the same channels traced under ``jit`` (each block
    from every part, then selected: ``ParallelCore.dense_by``'s traced path): each equals XLA."""
    op = ops["falcon_h1"]
    core, C = op.core, op.shape[1]
    split = int(core.starts[1])  # the first attention channel
    assert pallas.has_kernel(core.parts[0]) and pallas.has_kernel(core.parts[1])
    chans = [C - 1, 0, split, split - 1, split + 9]
    assert rel(op.materialize(chans, impl="pallas"), op.materialize(chans, impl="xla")) <= 1e-5
    w = jax.random.normal(jax.random.PRNGKey(7), (B, C, L))
    for how, kw in (("abs_mean", {}), ("weighted", dict(weights=w))):
        assert rel(op.reduce(how, impl="pallas", **kw), op.reduce(how, impl="xla", **kw)) <= 1e-5, how
    some = jax.jit(lambda o, c: o.reduce("pos_mean", channels=c, impl="pallas"))(op, jnp.asarray(chans))
    assert rel(some, op.reduce("pos_mean", channels=chans, impl="xla")) <= 1e-5


def test_a_parallel_core_reduce_differentiates_like_xla(ops):
    """The gradient of Falcon-H1's fused reduce (each part's kernel, the attention heads' repeats
    sharing their matrix) with respect to every float leaf of the core and the weights."""
    op = ops["falcon_h1"]
    core = op.core
    w = jax.random.normal(jax.random.PRNGKey(7), (B, op.shape[1], L))

    def loss(core, w, impl):
        o = ImplicitOperator(op.values, op.offset, op.output, core)
        return jnp.sum(o.reduce("weighted", weights=w, impl=impl) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True), static_argnums=2)
    pairs = [(a, b) for a, b in zip(jax.tree.leaves(grad(core, w, "pallas")), jax.tree.leaves(grad(core, w, "xla")))
             if a.dtype == jnp.float32]  # (the document ids' float0 left out)
    assert len(pairs) > 10 and all(rel(a, b) <= 1e-5 for a, b in pairs)


def test_a_parallel_core_takes_kernels_where_a_part_has_one():
    """A core no backend has a kernel for beside a Mamba-2 core: its channels by XLA, the Mamba-2
    channels by the kernel; such cores alone are refused, naming the parts."""
    m2 = mamba2_op()
    other = NoKernelCore(scale=jnp.asarray([0.5, -2.0]), B=B, L=L)
    values = jnp.concatenate([jnp.ones((B, 2, L)), m2.values], axis=1)
    mixed = ImplicitOperator(values, jnp.zeros_like(values), values,
                             ParallelCore(parts=(other, m2.core), repeats=(1, 1)))
    C = mixed.shape[1]
    assert rel(mixed.materialize([C - 1, 0], impl="pallas"), mixed.materialize([C - 1, 0], impl="xla")) <= 1e-5
    assert rel(mixed.reduce("abs_mean", impl="pallas"), mixed.reduce("abs_mean", impl="xla")) <= 1e-5
    core = ParallelCore(parts=(other, other), repeats=(1, 1))
    assert not pallas.has_kernel(core)
    with pytest.raises(TypeError, match="none of its parts has a kernel .parts: NoKernelCore, NoKernelCore"):
        kernels.pallas_dense(core, [0])


def test_a_core_without_a_kernel_is_refused():
    """``impl="pallas"`` names a core type it has no kernel for; ``auto`` computes it with XLA."""
    v = jnp.ones((1, 2, 5))
    op = ImplicitOperator(v, jnp.zeros_like(v), v, NoKernelCore(scale=jnp.ones((2,))))
    with pytest.raises(TypeError, match="NoKernelCore"):
        op.materialize(impl="pallas")
    with pytest.raises(TypeError, match="NoKernelCore"):
        op.reduce(impl="pallas")
    assert not pallas.has_kernel(op.core) and resolve_impl("auto", op.core) == "xla"
    assert resolve_impl("pallas", scalar_lowrank_op().core) == "pallas"
    with pytest.raises(ValueError, match="impl must be one of"):
        op.materialize(impl="triton")


def test_short_conv_kernel_without_the_input_gate(ops):
    """LFM2's operator without ``right`` (a variant that drops the input gate): the band alone,
    scaled on the left; exact zeros off the band where the left scaling is NaN."""
    op = ops["short_conv"]
    core = dataclasses.replace(op.core, right=None, left=op.core.left.at[0, 1, 30].set(jnp.nan))
    a, b = kernels.pallas_dense(core, [1, 0]), core.dense(jnp.asarray([1, 0]))
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    assert np.isnan(a[0, 0, 30, 28:31]).all() and not np.isnan(a[0, 0, 30, :28]).any()
    assert rel(np.nan_to_num(a), np.nan_to_num(b)) <= 1e-6


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what auto picks on CPU")
def test_auto_never_picks_the_interpreter_on_cpu():
    """A core with a Pallas kernel and a CPU one gets the CPU one; a core with only a Pallas kernel
    (here: a conv wider than the CPU kernel's 16 taps) gets XLA."""
    core = scalar_lowrank_op().core
    assert resolve_impl("auto", core) == "cpu"
    wide = dataclasses.replace(core, conv_w=jnp.ones((core.num_channels, 17)))
    assert pallas.has_kernel(wide) and not cpu.has_kernel(wide)
    assert resolve_impl("auto", wide) == "xla"


def test_bad_arguments_fail_loudly(ops):
    core = ops["griffin"].core
    with pytest.raises(ValueError, match="tile must be a positive int"):
        kernels.pallas_dense(core, [0], tile=0)
    with pytest.raises(ValueError, match="conv width 4 needs a tile of at least 3"):
        kernels.pallas_dense(core, [0], tile=2)
    with pytest.raises(ValueError, match="how must be one of"):
        kernels.pallas_reduce(core, [0], "max", jnp.ones((B, 1, L)), jnp.ones((B, 1, L)))
