"""The fused CPU kernels for the cores whose channels share a head matrix (Mamba-2, the gated
delta rule, DPLR: RWKV-6/7, mLSTM: xLSTM), RWKV-4's ``RwkvCore`` and LFM2's ``ShortConvCore``
against the family's float64 reference, the XLA path and the block's own scan. Operators come
from each family's layer on random weights and a random input (tiny configs: several heads,
grouped B/C or key heads, a conv, a gate, RWKV-7's diagonal). Lengths: 1, 16 (one chunk), 37
(ragged) and 300 (the fused reduces' column tiles are 256 wide: two tiles, a ragged one).
Falcon-H1's ``ParallelCore`` (Mamba-2 beside attention) runs its parts' kernels. RecurrentGemma's
local attention (``AttentionCore``) has a materialize kernel: against the family's float64
reference, and on random cores (packed documents, windows, grouped keys) against float64 softmax.
The default tier checks Mamba-2, RWKV-7, RWKV-4 and LFM2; the other families' float64 checks
repeat the conformance suite's (which runs ``materialize``'s default, these kernels) and are deep.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.explain import head_maps
from implicit_attn.kernels import cpu
from implicit_attn.operator import AttentionCore, ImplicitOperator, Mamba2Core, RwkvCore, resolve_impl
from implicit_attn.operator.dispatch import blocked_reduce, sum_over_channels
from implicit_attn.registry import FAMILIES

B = 2
deep = pytest.mark.deep
FAMILIES_WITH_KERNELS = ["mamba2", "rwkv7", "rwkv", "lfm2", pytest.param("qwen3_next", marks=deep),
                         pytest.param("kimi_linear", marks=deep), pytest.param("rwkv6", marks=deep),
                         pytest.param("xlstm", marks=deep), pytest.param("falcon_h1", marks=deep)]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


_MODELS = {}


def layer_and_input(family, L, layer=0):
    """``(model, layer's mixer, a random input (B, L, d))`` of a tiny random model (cached)."""
    if family not in _MODELS:
        spec = FAMILIES[family]
        cfg = spec.config.from_hf(dict(spec.tiny))
        _MODELS[family] = spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(1)))
    model = _MODELS[family]
    width = model.config.hidden_size + (model.config.value_width if family == "rwkv7" else 0)  # [x, v_first]
    x = jax.random.normal(jax.random.PRNGKey(L), (B, L, width))
    return model, model.layers[layer].mixer, x


def op_of(family, L):
    _, mixer, x = layer_and_input(family, L)
    return mixer.as_operator(x)


@pytest.mark.parametrize("family", FAMILIES_WITH_KERNELS)
def test_materialize_equals_the_float64_reference_and_the_scan(family):
    model, mixer, x = layer_and_input(family, 37)
    op = mixer.as_operator(x)
    assert cpu.has_kernel(op.core) and resolve_impl("auto", op.core) == "cpu"
    H = op.materialize(impl="cpu")
    ref = FAMILIES[family].naive_operator(mixer.arrays(), np.asarray(x), model.config, 0)
    assert rel(H, ref) <= 1e-5
    assert not np.triu(np.asarray(H), 1).any()  # exact zeros above the diagonal
    assert rel(jnp.einsum("bcij,bcj->bci", H, op.values) + op.offset, op.output) <= 1e-5


@pytest.mark.parametrize("L", [pytest.param(1, marks=deep), pytest.param(16, marks=deep), 300])
def test_materialize_matches_xla_at_edge_lengths(L):
    op = op_of("rwkv7", L)  # a diagonal term and a gate
    assert rel(op.materialize(impl="cpu"), op.materialize(impl="xla")) <= 1e-5


@pytest.mark.parametrize("family", ["mamba2", "falcon_h1"])
def test_channel_subsets_out_of_order_with_repeats(family):
    """(Falcon-H1: a ParallelCore, Mamba-2 heads then attention heads repeated per value feature.)"""
    op = op_of(family, 37)
    chans = [9, 0, op.shape[1] - 1, 3, 3]
    assert rel(op.materialize(chans, impl="cpu"), op.materialize(chans, impl="xla")) <= 1e-5
    assert rel(op.reduce("abs_mean", channels=chans, impl="cpu"),
               op.reduce("abs_mean", channels=chans, impl="xla")) <= 1e-5


DEFAULT_REDUCES = {("mamba2", "abs_mean"), ("mamba2", "weighted"), ("rwkv", "pos_mean"), ("lfm2", "weighted"),
                   ("falcon_h1", "abs_mean"), ("rwkv7", "weighted")}


@pytest.mark.parametrize("family, how", [
    pytest.param(f, h, marks=() if (f, h) in DEFAULT_REDUCES else deep)
    for f in ("mamba2", "rwkv", "lfm2", "rwkv7", "falcon_h1") for h in ("mean", "abs_mean", "pos_mean", "weighted")])
def test_fused_reduce_matches_materialize(family, how):
    """The reduce against the float64 sum of the materialized channels, at L = 300 (two column tiles)."""
    op = op_of(family, 300)
    g = np.random.default_rng(3)
    qw = g.standard_normal(op.values.shape).astype(np.float32) if how == "weighted" else None
    kw = g.standard_normal(op.values.shape).astype(np.float32) if how == "weighted" else None
    got = op.reduce(how, weights=qw, key_weights=kw, impl="cpu")
    H = np.asarray(op.materialize(impl="xla"), np.float64)
    f = {"mean": lambda h: h, "weighted": lambda h: h, "abs_mean": np.abs, "pos_mean": lambda h: np.maximum(h, 0)}[how]
    C = H.shape[1]
    qw = np.full(op.values.shape, 1 / C) if qw is None else qw
    kw = np.ones(op.values.shape) if kw is None else kw
    want = np.einsum("bci,bcij,bcj->bij", qw, f(H), kw)
    assert got.shape == (B, 300, 300)
    assert rel(got, want) <= 1e-5


@pytest.mark.parametrize("family, how", [pytest.param("qwen3_next", "pos_mean", marks=deep), ("mamba2", "mean")])
def test_reduce_in_head_blocks(monkeypatch, family, how):
    """Heads formed one per step (a small memory budget; a length no other test compiles): the
    channels of the other heads are skipped (Mamba-2's mean: the kernel's product over each head's
    channels)."""
    op = op_of(family, 23)
    monkeypatch.setattr(cpu, "HEAD_BLOCK_BYTES", 4 * B * 23 * 23)
    assert rel(op.reduce(how, impl="cpu"), op.reduce(how, impl="xla")) <= 1e-5


@pytest.mark.parametrize("family", ["mamba2", "rwkv6"])  # RWKV-6: its head matrices from the decay-matrix kernel
def test_gradients_match_xla(family):
    op = op_of(family, 17)
    R = jax.random.normal(jax.random.PRNGKey(5), op.shape)
    Rr = jax.random.normal(jax.random.PRNGKey(6), (B, 17, 17))
    w = jax.random.normal(jax.random.PRNGKey(3), op.values.shape)

    def loss(core, w, impl):
        o = ImplicitOperator(op.values, op.offset, op.output, core)
        return jnp.sum(o.materialize(impl=impl) * R) + jnp.sum(o.reduce("weighted", weights=w, impl=impl) * Rr)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True), static_argnums=2)
    floats = lambda g: [x for x in jax.tree_util.tree_leaves(g) if x.dtype != jax.dtypes.float0]
    got, want = floats(grad(op.core, w, "cpu")), floats(grad(op.core, w, "xla"))
    assert len(got) == len(want) >= 6
    for a, b in zip(got, want):
        assert rel(a, b) <= 1e-5


def test_traced_channels_and_threads(monkeypatch):
    """Channels traced under jit (every head formed), and 1 or 3 threads: the same numbers."""
    op = op_of("mamba2", 37)
    want = np.asarray(op.materialize(impl="xla"))
    C = op.shape[1]
    traced = jax.jit(lambda c, i: cpu.cpu_dense(c, i))(op.core, jnp.arange(C))
    assert rel(traced, want) <= 1e-5
    monkeypatch.setattr(cpu, "num_threads", lambda: 1)
    one = np.asarray(cpu.cpu_dense(op.core, np.arange(C)))
    monkeypatch.setattr(cpu, "num_threads", lambda: 3)
    np.testing.assert_array_equal(one, np.asarray(cpu.cpu_dense(op.core, np.arange(C))))


@pytest.mark.parametrize("family", ["mamba2", "qwen3_next"])  # tiny configs with at least 3 heads
def test_channels_form_only_the_heads_they_touch(monkeypatch, family):
    """The kernel forms the matrices of the heads the channels touch, not all ``H``: concrete
    channels of a traced core (``materialize``'s one compiled program, the fused reduce; before,
    every head), and traced channels spanning a contiguous range (``apply``'s blocks: the span's
    heads, with every head in the other branch of a ``cond`` for a scattered selection). The
    numbers equal XLA's (the reduce: float64 of XLA's matrices)."""
    op = op_of(family, 37)
    H, C = op.core.num_heads, op.shape[1]
    P = C // H
    assert H >= 3
    formed, head_matrices = [], cpu.head_matrices
    monkeypatch.setattr(cpu, "head_matrices", lambda core, hs: formed.append(hs.shape[0]) or head_matrices(core, hs))
    want = np.asarray(op.materialize(impl="xla"))
    for chans, heads in (([P + 1], 1), ([2 * P, 1, 0], 2)):
        formed.clear()
        got = jax.jit(lambda c: cpu.cpu_dense(c, chans))(op.core)
        assert formed == [heads], (chans, formed)
        assert rel(got, want[:, chans]) <= 1e-5
    assert rel(op.materialize([2 * P, 1, 0]), want[:, [2 * P, 1, 0]]) <= 1e-5
    chans = [P + 2, P + 1]  # the fused reduce over one head's channels (a per-head map's)
    w = jax.random.uniform(jax.random.PRNGKey(3), (B, 2, 37))
    formed.clear()
    got = cpu.cpu_reduce(op.core, chans, "abs_mean", w, w)
    assert formed == [1], formed
    red = np.einsum("bci,bcij,bcj->bij", np.asarray(w, np.float64), np.abs(want[:, chans]), np.asarray(w, np.float64))
    assert rel(got, red) <= 1e-5
    span = jax.jit(lambda c, s, n: cpu.cpu_dense(c, s + jnp.arange(n)), static_argnums=2)
    for start, n in ((P // 2, P), (0, 1), (1, 2 * P - 2)):
        formed.clear()
        got = span(op.core, start, n)
        assert rel(got, want[:, start:start + n]) <= 1e-5
        most = min(n, (n - 2) // P + 2)  # heads n contiguous channels can touch, wherever they start
        assert min(formed) == most < H and max(formed) in (most, H), (start, n, formed)
    # XLA's materialize (what impl="auto" runs where no kernel is trusted, as on a GPU) likewise
    name = "alpha" if isinstance(op.core, Mamba2Core) else "compute_head_matrix"
    xla_formed, compute = [], getattr(type(op.core), name)
    monkeypatch.setattr(type(op.core), name, lambda core, hs: xla_formed.append(len(hs)) or compute(core, hs))
    assert rel(op.materialize([P + 3], impl="xla"), want[:, [P + 3]]) <= 1e-5 and xla_formed == [1], xla_formed
    if not isinstance(op.core, Mamba2Core):  # HeadMatrixCores precompute the heads a blocked loop reads
        xla_formed.clear()
        got = op.materialize(chans, impl="xla", block_channels=1)
        assert rel(got, want[:, chans]) <= 1e-5 and xla_formed == [1], xla_formed
        xla_formed.clear()
        got = op.reduce("weighted", weights=w, key_weights=w, channels=chans, impl="xla", block_channels=1)
        assert rel(got, np.einsum("bci,bcij,bcj->bij", np.asarray(w, np.float64), want[:, chans],
                                  np.asarray(w, np.float64))) <= 1e-5 and xla_formed == [1], xla_formed
        xla_formed.clear()
        got = op.reduce("abs_mean", channels=[1, 2 * P + 1, 2], impl="xla", block_channels=2)
        assert rel(got, np.abs(want[:, [1, 2 * P + 1, 2]]).mean(axis=1)) <= 1e-5 and xla_formed == [2], xla_formed
        with pytest.raises(ValueError, match=r"heads \[0\] were not precomputed"):
            op.core.precompute(np.asarray([1, 2])).dense(np.asarray([0]))
    scattered = jnp.asarray([0, P, 2 * P])  # three heads where contiguous channels would span two
    formed.clear()
    got = jax.jit(lambda c, i: cpu.cpu_dense(c, i))(op.core, scattered)
    assert rel(got, want[:, [0, P, 2 * P]]) <= 1e-5 and max(formed) == H


@pytest.mark.parametrize("how", ["mean", "abs_mean"])
def test_head_maps_in_xla_form_the_head_matrices_once(monkeypatch, how):
    """Where the reductions run in XLA (no kernel trusted, as on a GPU), ``head_maps`` forms its heads'
    matrices once for all its maps, in one batched call (before: once per map, so the compiled
    program held the head recurrence once per head); the maps equal float64 means of XLA's ``H``."""
    L = 29  # a shape no other test traces head_maps at: the trace is new, with XLA's reductions
    op = op_of("qwen3_next", L)
    H, C = op.core.num_heads, op.shape[1]
    want = np.asarray(op.materialize(impl="xla"), np.float64).reshape(B, H, C // H, L, L)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 1 << 62)
    assert resolve_impl("auto", op.core) == "xla"
    formed, compute = [], type(op.core).compute_head_matrix
    monkeypatch.setattr(type(op.core), "compute_head_matrix",
                        lambda core, hs: formed.append(len(hs)) or compute(core, hs))
    f = np.abs if how == "abs_mean" else (lambda a: a)
    for heads, formed_once in (([2, 0], [2]), (None, [H])):
        formed.clear()
        got = head_maps(op, heads=heads, how=how)
        assert formed == formed_once, (heads, formed)
        assert rel(got, f(want[:, [2, 0] if heads else slice(None)]).mean(axis=2)) <= 1e-5


def test_attention_materialize_equals_the_float64_reference():
    """RecurrentGemma's local attention layer (window 5, one key head for four query heads)."""
    model, mixer, x = layer_and_input("recurrent_gemma", 37, layer=2)
    op = mixer.as_operator(x)
    assert type(op.core) is AttentionCore and resolve_impl("auto", op.core) == "cpu"
    P = op.materialize(impl="cpu")
    ref = FAMILIES["recurrent_gemma"].naive_operator(mixer.arrays(), np.asarray(x), model.config, 2)
    assert rel(P, ref) <= 1e-5
    np.testing.assert_array_equal(np.asarray(P) == 0, ref == 0)  # exact zeros where masked
    assert rel(jnp.einsum("bhij,bhjd->bhid", P, op.values), op.output) <= 1e-5


def attention_core(L, heads=4, kv=2, d=12, window=7, seed=0):
    g = np.random.default_rng(seed)
    q = jnp.asarray(g.standard_normal((B, heads, L, d)), jnp.float32)
    k = jnp.asarray(g.standard_normal((B, kv, L, d)), jnp.float32)
    seg = jnp.asarray(np.cumsum(g.random((B, L)) < 0.03, axis=1), jnp.int32)  # packed documents
    return AttentionCore(q=q, k=k, seg=seg, window=window)


def softmax64(core):
    """Float64 masked softmax from the definition: key j visible to query i iff j <= i,
    i - j < window and both in the same document."""
    q, k, seg = (np.asarray(a, np.float64) for a in (core.q, core.k, core.seg))
    k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    L = q.shape[2]
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    vis = (j <= i) & (i - j < core.window) & (seg[:, None, :, None] == seg[:, None, None, :])
    x = np.where(vis, np.einsum("bhid,bhjd->bhij", q, k), -np.inf)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("window", [40, 2 ** 31 - 1])
def test_attention_kernel_in_one_document(window):
    """One document: the kernel leaves unmasked the blocks every row of a chunk sees whole
    (left of the diagonal, inside the window); against the float64 softmax."""
    core = attention_core(300, window=window)
    core = AttentionCore(q=core.q, k=core.k, seg=jnp.zeros_like(core.seg), window=window)
    got = np.asarray(cpu.cpu_dense(core, np.arange(4)))
    want = softmax64(core)
    assert rel(got, want) <= 1e-5
    np.testing.assert_array_equal(got == 0, want == 0)


@pytest.mark.parametrize("L, window", [(1, 3), (16, 16), (37, 2 ** 31 - 1), (300, 40)])
def test_attention_kernel_on_random_cores(L, window):
    """Packed documents, windows shorter and longer than L (one of them not a multiple of the
    kernel's 16-key blocks), two query heads per key head, heads out of order and repeated."""
    core = attention_core(L, window=window)
    idx = np.array([3, 0, 0, 2])
    got = np.asarray(cpu.cpu_dense(core, idx))
    want = softmax64(core)[:, idx]
    assert rel(got, want) <= 1e-5
    np.testing.assert_array_equal(got == 0, want == 0)
    assert rel(got, core.dense(jnp.asarray(idx))) <= 1e-5


@pytest.mark.parametrize("L, window", [(1, 3), (37, 2 ** 31 - 1), (300, 40)])
def test_attention_kernel_streams_large_outputs_to_the_same_numbers(L, window, monkeypatch):
    """Outputs from ``STREAM_BYTES`` on are written with streaming stores: forced at these sizes
    (rows of odd lengths, so not 64-byte aligned; packed documents; a NaN query row), the same
    bits as the plain stores; the attribute is set by the output's size."""
    core = attention_core(L, window=window)
    core = dataclasses.replace(core, q=core.q.at[0, 1, L // 2, 0].set(jnp.nan))
    idx = np.array([3, 0, 1])
    plain = np.asarray(cpu.cpu_dense(core, idx))
    monkeypatch.setattr(cpu, "STREAM_BYTES", 0)
    np.testing.assert_array_equal(np.asarray(cpu.cpu_dense(core, idx)), plain)
    assert np.isnan(plain[0, 2]).any() and rel(plain[1], softmax64(core)[1][idx]) <= 1e-5
    monkeypatch.undo()
    lowered = lambda n: jax.jit(lambda c: cpu.cpu_dense(c, np.arange(1))).lower(attention_core(n)).as_text()
    assert "stream = 1" in lowered(725) and "stream = 0" in lowered(724)  # B = 2: 4 MiB of output from L = 725


def test_attention_gradients_match_xla():
    core = attention_core(21)
    R = jax.random.normal(jax.random.PRNGKey(2), (B, 4, 21, 21))
    loss = lambda c, impl: jnp.sum((cpu.cpu_dense(c, np.arange(4)) if impl == "cpu" else c.dense(jnp.arange(4))) * R)
    grads = [jax.jit(jax.grad(loss, allow_int=True), static_argnums=1)(core, impl) for impl in ("cpu", "xla")]
    assert rel(grads[0].q, grads[1].q) <= 1e-5 and rel(grads[0].k, grads[1].k) <= 1e-5


@pytest.mark.parametrize("how", ["mean", "abs_mean", "pos_mean", "weighted"])
def test_attention_reduce_forms_its_blocks_by_the_kernel(how):
    """The library's reduce forms its channel blocks by the dense kernel (its call in the program),
    in blocks of 3 heads (the last one padded), against the float64 sum over heads of
    ``qw f(P) kw`` from the definition; its gradient in the queries equals the XLA reduce's."""
    core = attention_core(45, heads=5, kv=1, window=20)
    g = np.random.default_rng(3)
    qw = jnp.asarray(g.standard_normal((B, 5, 45)), jnp.float32)
    kw = jnp.asarray(g.standard_normal((B, 5, 45)), jnp.float32)
    mode = {"mean": 0, "weighted": 0, "abs_mean": 1, "pos_mean": 2}[how]
    f = jax.jit(lambda c, q, k: blocked_reduce(c, jnp.arange(5), q, k, mode, 3, dense=cpu.cpu_dense))
    library = jax.jit(lambda c, q, k: cpu.cpu_reduce(c, np.arange(5), how, q, k))
    assert "implicit_attn_attention_dense" in library.lower(core, qw, kw).as_text()  # the library's path
    P = softmax64(core)  # probabilities are >= 0: every mode is the identity on them
    want = np.einsum("bhi,bhij,bhj->bij", np.asarray(qw, np.float64), P, np.asarray(kw, np.float64))
    assert rel(f(core, qw, kw), want) <= 1e-5
    got = cpu.cpu_reduce(core, np.arange(5), how, qw, kw)
    assert rel(got, want) <= 1e-5
    loss = lambda dense: (lambda c: jnp.sum(blocked_reduce(c, jnp.arange(5), qw, kw, mode, 3, dense=dense) ** 2))
    grads = [jax.jit(jax.grad(loss(d), allow_int=True))(core) for d in (cpu.cpu_dense, None)]
    assert rel(grads[0].q, grads[1].q) <= 1e-5 and rel(grads[0].k, grads[1].k) <= 1e-5


def test_sum_over_channels_is_the_sum():
    """The pairwise-halving channel sum at even, odd and single channel counts, against numpy."""
    g = np.random.default_rng(4)
    for c in (1, 2, 5, 8, 13):
        x = g.standard_normal((2, c, 3, 4)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(sum_over_channels(jnp.asarray(x))), x.astype(np.float64).sum(1),
                                   rtol=1e-6, atol=1e-6)


def test_attention_kernel_exports_for_cpu():
    """``jax.export`` keeps the kernel's FFI call (a target without jax's compatibility guarantee:
    the check is waived by name), and the exported function gives its numbers."""
    core = attention_core(37)
    f = jax.jit(lambda c: cpu.cpu_dense(c, np.arange(4)))
    ffi = jax.export.DisabledSafetyCheck.custom_call("implicit_attn_attention_dense")
    exp = jax.export.export(f, platforms=["cpu"], disabled_checks=[ffi])(core)
    assert "implicit_attn_attention_dense" in exp.mlir_module()
    np.testing.assert_array_equal(np.asarray(exp.call(core)), np.asarray(f(core)))


@pytest.mark.parametrize("how", ["mean", "abs_mean", "pos_mean"])
def test_rwkv_reduce_at_extreme_decays_and_bonuses(how):
    """RWKV-4's reduce factorises each entry left of its row chunk's diagonal block into a column
    and a row factor: keys up to +-30, decays from -1e-3 to -80 and -inf, bonuses up to +60 (rows
    whose other entries underflow), negative gates; against the float64 definition at L = 300."""
    g = np.random.default_rng(7)
    C, L = 6, 300
    k = (g.standard_normal((B, C, L)) * 10).clip(-30, 30).astype(np.float32)
    w = np.array([-1e-3, -0.5, -3.0, -80.0, -np.inf, -0.05], np.float32)
    u = np.array([0.0, 60.0, -5.0, 2.0, 1.0, 30.0], np.float32)
    gate = g.standard_normal((B, C, L)).astype(np.float32)
    core = RwkvCore(k=jnp.asarray(k), w=jnp.asarray(w), u=jnp.asarray(u), gate=jnp.asarray(gate))
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    w64 = w.astype(np.float64)[None, :, None, None]
    with np.errstate(invalid="ignore"):
        past = np.where(i - 1 - j > 0, (i - 1 - j) * w64, 0.0)
    l = np.where(j < i, past, u.astype(np.float64)[None, :, None, None]) + k.astype(np.float64)[:, :, None, :]
    l = np.where(j <= i, l, -np.inf)
    e = np.exp(l - l.max(-1, keepdims=True))
    H = gate.astype(np.float64)[..., None] * e / e.sum(-1, keepdims=True)
    f = {"mean": lambda h: h, "abs_mean": np.abs, "pos_mean": lambda h: np.maximum(h, 0)}[how]
    want = f(H).mean(1)
    qw = jnp.full((B, C, L), 1.0 / C, jnp.float32)
    got = cpu.cpu_reduce(core, np.arange(C), how, qw, jnp.ones((B, C, L), jnp.float32))
    assert rel(got, want) <= 1e-5


def test_rwkv_reduce_propagates_nan_like_the_elementwise_path():
    """A NaN key at position 150 of one channel: the factorised reduce gives NaN exactly where the
    float64 sum of the element-by-element kernel's channels does (that row on, left of the diagonal
    and on it) and agrees elsewhere, rows before it (the same row chunk's included) untouched."""
    g = np.random.default_rng(8)
    C, L = 5, 300
    k = (g.standard_normal((B, C, L)) * 3).astype(np.float32)
    k[1, 2, 150] = np.nan
    core = RwkvCore(k=jnp.asarray(k), w=jnp.asarray(-np.exp(g.standard_normal(C)).astype(np.float32)),
                    u=jnp.asarray(g.standard_normal(C).astype(np.float32)),
                    gate=jnp.asarray(g.standard_normal((B, C, L)).astype(np.float32)))
    qw = g.standard_normal((B, C, L)).astype(np.float32)
    kw = g.standard_normal((B, C, L)).astype(np.float32)
    got = np.asarray(cpu.cpu_reduce(core, np.arange(C), "weighted", jnp.asarray(qw), jnp.asarray(kw)))
    H = np.asarray(cpu.cpu_dense(core, np.arange(C)), np.float64)
    want = np.einsum("bci,bcij,bcj->bij", qw, H, kw)
    nan = np.isnan(want)
    assert nan[1, 150:].any() and not nan[0].any() and not nan[1, :150].any()
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert rel(got[~nan], want[~nan]) <= 1e-5


def test_linear_reduces_with_a_diagonal_term():
    """RWKV-7's linear reductions (a diagonal term beside the head matrix) by the kernel's product over
    a head's channels, for distinct, repeated and traced channels, equal the float64 sum of the
    materialized channels; with a conv added (the diagonal read at ``(i, i - s)``) too."""
    op = op_of("rwkv7", 37)
    g = np.random.default_rng(4)
    w = jnp.asarray(g.standard_normal((op.shape[1], 3)).astype(np.float32))
    for core in (op.core, dataclasses.replace(op.core, conv_w=w)):
        H = np.asarray(core.dense(jnp.arange(op.shape[1])), np.float64)
        for chans in ([9, 0, 5, 15], [9, 0, 9, 15]):
            qw = g.standard_normal((B, 4, 37)).astype(np.float32)
            kw = g.standard_normal((B, 4, 37)).astype(np.float32)
            want = np.einsum("bci,bcij,bcj->bij", qw, H[:, chans], kw)
            assert rel(cpu.cpu_reduce(core, np.asarray(chans), "weighted", qw, kw), want) <= 1e-5
        traced = jax.jit(lambda c, i: cpu.cpu_reduce(c, i, "weighted", qw, kw))(core, jnp.asarray(chans))
        assert rel(traced, want) <= 1e-5


@pytest.mark.parametrize("how", ["weighted", "abs_mean"])
def test_reduce_ignores_head_matrix_entries_above_the_diagonal(how):
    """Given head matrices with garbage above the diagonal, the kernel's reduce reads only the causal
    part, as ``dense`` does (repeated channels: the kernel, not the sum through the heads)."""
    op = op_of("qwen3_next", 37)
    M = op.core.head_matrix(jnp.arange(op.core.num_heads))
    core = op.core.with_head_matrices(M + jnp.triu(jnp.ones_like(M), 1) * 3.0)
    chans = np.array([0, 5, 5, op.shape[1] - 1])
    g = np.random.default_rng(5)
    qw, kw = (g.standard_normal((B, 4, 37)).astype(np.float32) for _ in range(2))
    H = np.asarray(core.dense(jnp.asarray(chans)), np.float64)
    f = np.abs if how == "abs_mean" else (lambda h: h)
    want = np.einsum("bci,bcij,bcj->bij", qw, f(H), kw)
    assert rel(cpu.cpu_reduce(core, chans, how, qw, kw), want) <= 1e-5
