"""NaN and infinite decays (issue 16 items 5-7): exact operators for a huge decay rate, an
exactness self-check that sees NaN, and NaN kept out of earlier rows of H."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.kernels import cpu, pallas, pallas_dense, pallas_reduce
from implicit_attn.kernels.pallas import calls, tiles
from implicit_attn.operator import dispatch
from implicit_attn.operator.base import applied_block, relative_error
from implicit_attn.registry import FAMILIES

from hf_build import build_hf

T = 13  # the poisoned position; L = 40 spans several chunks of every kernel


def tiny(model_type: str):
    spec = FAMILIES[model_type]
    cfg = spec.config.from_hf(spec.tiny)
    return spec, spec.lm(cfg, spec.init_params(cfg, 0))


def test_a_huge_decay_rate_keeps_h_finite_and_exact(tmp_path):
    """``A_log = 100`` in one channel: ``A = -exp(100)`` is -inf in float32; ``-inf * 0`` in the
    segment sums gave NaN in H. Reference: HF torch logits and the float64 operator (where
    ``-exp(100)`` is finite)."""
    torch = pytest.importorskip("torch")
    tm = build_hf("mamba", tmp_path)
    with torch.no_grad():
        tm.backbone.layers[0].mixer.A_log[3, :2] = 100.0
    tm.save_pretrained(tmp_path, safe_serialization=True)
    model = ia.load(tmp_path)
    spec = FAMILIES["mamba"]
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 40))
    with torch.no_grad():
        want = tm(torch.tensor(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), want, atol=1e-4)
    x = np.asarray(model.mixer_inputs(ids, [0])[0])
    op = model.layers[0].mixer.as_operator(x)
    ref = spec.naive_operator(model.layers[0].mixer.arrays(), x, model.config, 0)
    assert np.isfinite(ref).all()
    # the C++ kernel and the Pallas tile (interpret mode here) had the same -inf * 0
    impls = ["xla", "pallas"] + (["cpu"] if cpu.has_kernel(op.core) and jax.default_backend() == "cpu" else [])
    for impl in impls:
        H = np.asarray(op.materialize(impl=impl))
        assert np.isfinite(H).all(), impl
        assert np.max(np.abs(H - ref)) <= 1e-5 * np.max(np.abs(ref)), impl
    assert op.relative_error() <= 1e-5


def test_relative_error_sees_nan_and_inf():
    o = np.ones((1, 2, 5), np.float32)
    assert relative_error(o, o) == 0.0
    a = o.copy()
    a[0, 1, 3] = np.nan
    assert relative_error(a, o) == np.inf  # NaN in the operator, not in the block
    assert relative_error(o, a) == np.inf
    b = o.copy()
    b[0, 1, 3] = np.nan
    assert relative_error(a, b) == 0.0  # the same NaN in both: compared on the rest
    c = o.copy()
    c[0, 0, 0] = np.inf
    assert relative_error(c, o) == np.inf
    assert np.isnan(relative_error(np.full(3, np.nan), np.full(3, np.nan)))


def test_relative_error_of_an_operator_with_nan_output_is_not_small():
    spec, model = tiny("mamba")
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, 12))
    op = model.operators(ids, [0])[0]
    assert op.relative_error() <= 1e-5
    bad = type(op)(values=op.values, offset=op.offset, output=op.output.at[0, 0, 4].set(np.nan), core=op.core)
    assert bad.relative_error() == np.inf


# Item 7: NaN at position T must not reach rows < T: H, operator outputs and logits, every
# family (chunked forwards replace NaN by 0 and mark the outputs a sequential pass makes NaN,
# ops.nan; H keeps exact zeros above the diagonal, ops.keep_causal).
def operators_with_nan(model, seed: int, value: float = np.nan):
    """Per layer: the operator of the clean mixer input and of the same input with ``value``
    (NaN) at T."""
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, (1, 40))
    for i, x in model.mixer_inputs(ids).items():
        x = np.asarray(x).copy()
        clean = model.layers[i].mixer.as_operator(x)
        x[0, T] = value
        yield i, clean, model.layers[i].mixer.as_operator(x)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_nan_at_t_leaves_rows_before_t_of_h_and_outputs_unchanged(model_type):
    spec, model = tiny(model_type)
    for i, clean, poisoned in operators_with_nan(model, 2):
        H, H0 = (np.asarray(op.materialize(impl="xla")) for op in (poisoned, clean))
        np.testing.assert_allclose(H[:, :, :T], H0[:, :, :T], atol=1e-6, err_msg=f"layer {i}")
        assert not np.triu(H, 1).any(), f"layer {i}: nonzero (NaN) above the diagonal"
        out, out0 = np.asarray(poisoned.output), np.asarray(clean.output)
        np.testing.assert_allclose(out[:, :, :T], out0[:, :, :T], atol=1e-6, err_msg=f"layer {i}")
        assert np.isnan(out[:, :, T]).any(), f"layer {i}: the NaN position itself must be NaN"
        if type(poisoned.core).__name__ != "AttentionCore":
            # H's row holds NaN exactly where the block's output is NaN (the delta rule's, DPLR's and
            # the mLSTM's rows were once finite there, built from the zeroed inputs). Attention's
            # exact H stays finite past a NaN key's reach, where the block's 0 * NaN is NaN, as in HF.
            np.testing.assert_array_equal(np.isnan(H).any(-1), np.isnan(out), err_msg=f"layer {i}")
        # H v: a NaN value at T times the exact zeros of rows before T counts as 0, as in the block
        applied, applied0 = np.asarray(poisoned.apply()), np.asarray(clean.apply())
        np.testing.assert_allclose(applied[:, :, :T], applied0[:, :, :T], atol=1e-6, err_msg=f"layer {i}")


# One family per core with a Pallas kernel: Mamba-1's per-state decay, Mamba-2's heads (q k^T
# and the conv), Griffin's RG-LRU and local attention, RWKV-4's WKV, the delta rule and global
# attention, RWKV-7's DPLR, the mLSTM, and the parallel cores of Zamba (Mamba-1 heads; its shared
# attention too) and Falcon-H1 (Mamba-2 beside attention), and LFM2's short convolution: the core
# types of the tiny models' layers.
PALLAS_CORES = {"mamba": {"StateDecayCore"}, "mamba2": {"Mamba2Core"},
                "recurrent_gemma": {"ScalarDecayCore", "AttentionCore"}, "rwkv": {"RwkvCore"},
                "qwen3_next": {"DeltaRuleCore", "AttentionCore"}, "rwkv7": {"DplrCore"}, "xlstm": {"MlstmCore"},
                "zamba": {"ParallelCore", "AttentionCore"}, "falcon_h1": {"ParallelCore"},
                "lfm2": {"ShortConvCore", "AttentionCore"}}


@pytest.mark.parametrize("model_type", sorted(PALLAS_CORES))
def test_pallas_kernels_keep_nan_causal(model_type):
    """The Pallas kernels (interpret mode here; on a GPU the same tiles compiled) with NaN in
    the mixer input at ``T``: rows before ``T`` of ``materialize`` and ``reduce`` as without
    it, exact zeros above the diagonal, and NaN exactly where the XLA path has NaN, with its
    values elsewhere. Their matmuls (in-tile segment sums, the conv's bands) once multiplied a
    later NaN by zeros into every row of the tile (found on an H200)."""
    _, model = tiny(model_type)
    seen = set()
    for i, clean, poisoned in operators_with_nan(model, 2):
        if not pallas.has_kernel(poisoned.core):
            continue
        seen.add(type(poisoned.core).__name__)
        H, H0 = (np.asarray(op.materialize(impl="pallas")) for op in (poisoned, clean))
        Hx = np.asarray(poisoned.materialize(impl="xla"))
        assert np.isnan(H).any() == np.isnan(Hx).any(), f"layer {i}"
        np.testing.assert_array_equal(H[:, :, :T], H0[:, :, :T], err_msg=f"layer {i}")
        assert not np.triu(H, 1).any(), f"layer {i}"  # NaN is nonzero: none above the diagonal
        np.testing.assert_array_equal(np.isnan(H), np.isnan(Hx), err_msg=f"layer {i}")
        np.testing.assert_allclose(H, Hx, atol=1e-5, err_msg=f"layer {i}")  # NaN where Hx has NaN
        r, r0 = (np.asarray(op.reduce("abs_mean", impl="pallas")) for op in (poisoned, clean))
        np.testing.assert_array_equal(r[:, :T], r0[:, :T], err_msg=f"layer {i}")
    assert seen == PALLAS_CORES[model_type], seen


class NumpyWithNanSkippingMax:
    """``jax.numpy`` whose ``maximum``, ``minimum``, ``max`` and ``min`` skip NaN operands, as the
    compiled GPU kernels' do: Pallas lowers them for Triton to ``maxnumf`` / ``minnumf``, where
    XLA and interpret mode return NaN."""
    maximum, minimum, max, min = (staticmethod(f) for f in (jnp.fmax, jnp.fmin, jnp.nanmax, jnp.nanmin))

    def __getattr__(self, name):
        return getattr(jnp, name)


@pytest.mark.parametrize("model_type", sorted(PALLAS_CORES))
def test_pallas_kernels_keep_nan_where_max_skips_nan(model_type, monkeypatch):
    """The Pallas kernels with Triton's NaN-skipping ``max`` and ``min`` (``NumpyWithNanSkippingMax``
    in the kernel modules, interpret mode, one tile of 64 over L = 40): NaN in the mixer input at ``T`` gives NaN
    exactly where XLA has NaN, its values elsewhere, in ``materialize`` and ``reduce``. On an H200
    (2026-12-04) Mamba-1's tiles had NaN where XLA has none (layer 0: 3,136 entries) and the RG-LRU's
    none where XLA has NaN (4,320), because ``max(NaN, -1e30)`` in the in-tile segment sums gave
    ``-1e30``; this emulation gave the same counts on a CPU (at the GPU's tiles of 32) until
    ``tiles.maximum``."""
    numpy = NumpyWithNanSkippingMax()
    monkeypatch.setattr(tiles, "jnp", numpy)
    monkeypatch.setattr(calls, "jnp", numpy)
    _, model = tiny(model_type)
    seen = set()
    for i, clean, poisoned in operators_with_nan(model, 2):
        core = poisoned.core
        if not pallas.has_kernel(core):
            continue
        seen.add(type(core).__name__)
        B, C, L, _ = poisoned.shape
        idx = np.arange(C)
        # interpret=True, tile 64: kernels traced here, under the patch (no other test compiles these)
        H = np.asarray(pallas_dense(core, idx, tile=64, interpret=True))
        Hx = np.asarray(poisoned.materialize(impl="xla"))
        assert np.isnan(Hx).any(), f"layer {i}"
        np.testing.assert_array_equal(np.isnan(H), np.isnan(Hx), err_msg=f"layer {i}")
        np.testing.assert_allclose(H, Hx, atol=1e-5, err_msg=f"layer {i}")
        qw, kw = jnp.full((B, C, L), 1.0 / C, jnp.float32), jnp.ones((B, C, L), jnp.float32)
        r = np.asarray(pallas_reduce(core, idx, "abs_mean", qw, kw, tile=64, interpret=True))
        rx = np.asarray(poisoned.reduce("abs_mean", impl="xla"))
        np.testing.assert_array_equal(np.isnan(r), np.isnan(rx), err_msg=f"layer {i}")
        np.testing.assert_allclose(r, rx, atol=1e-5, err_msg=f"layer {i}")
    assert seen == PALLAS_CORES[model_type], seen


def test_pallas_kernels_keep_exact_zeros_above_the_diagonal_after_an_overflow():
    """A huge finite mixer input at ``T`` (``1e30``) overflows ``H``'s entries to inf inside the
    tiles, with no NaN in the inputs (so the plain tiles): the conv's band matmul once spread
    ``inf * 0 = NaN`` over those rows, above the diagonal too (Mamba-1: 3,235 entries of layer
    0). ``materialize`` and ``reduce`` with rows before ``T`` as without it, zeros above the
    diagonal. (Mamba-2's tiles, also with a conv, showed none.)"""
    _, model = tiny("mamba")
    for i, clean, huge in operators_with_nan(model, 2, 1e30):
        if not pallas.has_kernel(huge.core):
            continue
        for run in (lambda op: op.materialize(impl="pallas"), lambda op: op.reduce("abs_mean", impl="pallas")):
            H, H0 = (np.asarray(run(op)) for op in (huge, clean))
            np.testing.assert_array_equal(H[..., :T, :], H0[..., :T, :], err_msg=f"layer {i}")
            assert not np.triu(H, 1).any(), f"layer {i}"


# One family per core with a fused CPU kernel: Mamba-2, the delta rule and global attention, DPLR,
# the mLSTM, the short conv, the short conv and windowed attention, Falcon-H1's parallel Mamba-2 +
# attention, RWKV-4, and the state-decay kernel (Mamba-1, the RG-LRU).
CPU_KERNEL_FAMILIES = ("mamba2", "qwen3_next", "rwkv7", "xlstm", "lfm2", "lfm3", "falcon_h1", "rwkv", "mamba",
                       "recurrent_gemma")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_overflowing_input_at_t_leaves_rows_before_t_unchanged(model_type):
    """A finite but huge mixer input at ``T`` (``±1e30``, reachable through ``mixer.hook_in``):
    the block's output and ``H`` before ``T`` as without it, through the CPU kernels where a
    forward has one. The state input it makes overflows to inf, and Mamba-2's and RWKV-7's
    chunked forms' masked products carried that into earlier rows as ``0 * inf`` until
    2026-12-02 (``test_overflowing_input_keeps_the_chunked_forwards_causal``)."""
    _, model = tiny(model_type)
    for value in (1e30, -1e30):
        for i, clean, huge in operators_with_nan(model, 2, value):
            out, out0 = np.asarray(huge.output), np.asarray(clean.output)
            np.testing.assert_allclose(out[:, :, :T], out0[:, :, :T], atol=1e-6, err_msg=f"layer {i} {value}")
            H, H0 = (np.asarray(op.materialize(impl="xla")) for op in (huge, clean))
            np.testing.assert_allclose(H[:, :, :T], H0[:, :, :T], atol=1e-6, err_msg=f"layer {i} {value}")
            assert not np.triu(H, 1).any(), f"layer {i} {value}"


# One family per forward with a CPU kernel (Mamba-1's scan, Mamba-2's SSD, the delta rule, the
# mLSTM, RWKV-4's WKV, DPLR): the tests above see the kernels' recurrences, not the chunked forms.
FORWARD_KERNEL_FAMILIES = ("mamba", "mamba2", "qwen3_next", "xlstm", "rwkv", "rwkv7")


@pytest.mark.parametrize("model_type", FORWARD_KERNEL_FAMILIES)
def test_overflowing_input_keeps_the_chunked_forwards_causal(model_type, monkeypatch):
    """As above through the forwards' chunked XLA forms (an accelerator's, and the CPU's below
    the kernels' size threshold): the block's output before ``T`` as without the huge input.
    The mixers' jitted operators are traced anew with the threshold out of reach (layer 0's
    then holds no kernel call, where it held one before) and again after it."""
    _, model = tiny(model_type)
    mixer = model.layers[0].mixer
    x = np.asarray(model.mixer_inputs(np.zeros((1, 40), np.int32), [0])[0])
    lowered = lambda: jax.jit(lambda x: mixer.as_operator(x).output).lower(x).as_text()
    assert "implicit_attn_" in lowered()
    fns = (type(layer.mixer).operator_fn for layer in model.layers)
    traced = {getattr(fn, "func", fn) for fn in fns}  # the jitted function under a functools.partial
    try:
        with monkeypatch.context() as m:
            m.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 1 << 62)
            for fn in traced:
                fn.clear_cache()
            assert "implicit_attn_" not in lowered()
            for i, clean, huge in operators_with_nan(model, 2, 1e30):
                out, out0 = np.asarray(huge.output), np.asarray(clean.output)
                np.testing.assert_allclose(out[:, :, :T], out0[:, :, :T], atol=1e-6, err_msg=f"layer {i}")
    finally:
        for fn in traced:
            fn.clear_cache()  # later tests must not reuse the programs traced without the kernels
    assert "implicit_attn_" in lowered()


@pytest.mark.parametrize("model_type", CPU_KERNEL_FAMILIES)
def test_cpu_kernels_keep_nan_causal(model_type):
    """The fused CPU kernels with NaN in the mixer input at ``T``: ``materialize``, ``reduce("abs_mean")``
    and ``reduce("mean")`` with rows before ``T`` as without it, exact zeros above the diagonal,
    and NaN exactly where the XLA path has it, its values elsewhere. The attention kernel once
    spread a row's NaN over the whole row (above the diagonal and outside a window too), the
    state-decay and RWKV-4 kernels put NaN above the diagonal, and the state-decay kernel's
    diagonal block carried a NaN step right of the diagonal, where its conv read it."""
    _, model = tiny(model_type)
    seen = 0
    for i, clean, poisoned in operators_with_nan(model, 2):
        if not cpu.has_kernel(poisoned.core):
            continue
        seen += 1
        H, H0, Hx = (np.asarray(op.materialize(impl=impl)) for op, impl in
                     ((poisoned, "cpu"), (clean, "cpu"), (poisoned, "xla")))
        r, r0, rx = (np.asarray(op.reduce("abs_mean", impl=impl)) for op, impl in
                     ((poisoned, "cpu"), (clean, "cpu"), (poisoned, "xla")))
        # the linear reduce too (the RG-LRU's has a banded path of its own)
        m, m0, mx = (np.asarray(op.reduce("mean", impl=impl)) for op, impl in
                     ((poisoned, "cpu"), (clean, "cpu"), (poisoned, "xla")))
        np.testing.assert_array_equal(H[:, :, :T], H0[:, :, :T], err_msg=f"layer {i}")
        np.testing.assert_allclose(r[:, :T], r0[:, :T], atol=1e-6, err_msg=f"layer {i}")
        np.testing.assert_allclose(m[:, :T], m0[:, :T], atol=1e-6, err_msg=f"layer {i}")
        assert not (np.triu(H, 1).any() or np.triu(r, 1).any() or np.triu(m, 1).any()), f"layer {i}"
        np.testing.assert_array_equal(np.isnan(H), np.isnan(Hx), err_msg=f"layer {i}")
        np.testing.assert_allclose(H, Hx, atol=1e-5, err_msg=f"layer {i}")  # NaN where Hx has NaN
        np.testing.assert_array_equal(np.isnan(r), np.isnan(rx), err_msg=f"layer {i}")
        np.testing.assert_allclose(r, rx, atol=1e-5, err_msg=f"layer {i}")
        np.testing.assert_array_equal(np.isnan(m), np.isnan(mx), err_msg=f"layer {i}")
        np.testing.assert_allclose(m, mx, atol=1e-5, err_msg=f"layer {i}")
    assert seen, model_type


@pytest.mark.parametrize("model_type", ["mamba2", "qwen3_next", "rwkv7", "xlstm"])
def test_xla_linear_reduce_keeps_rows_before_t(model_type):
    """``reduce("mean")`` and ``reduce("weighted")`` on the XLA path with NaN in the mixer input at ``T``, through the heads
    (``head_weighted_sum``; one family per core that has it): rows before ``T`` as without the
    NaN, and the mean (weighted sum) over channels of ``materialize``, NaN pattern included. Before the fix the
    conv taps' ``0 * NaN`` put NaN into 91 entries of rows before ``T`` per Mamba-2 layer."""
    _, model = tiny(model_type)
    seen = False
    for i, clean, poisoned in operators_with_nan(model, 2):
        if type(poisoned.core).__name__ == "AttentionCore":
            continue
        seen = True
        H = np.asarray(poisoned.materialize(impl="xla"), np.float64)
        w, kw = np.random.default_rng(i).uniform(0.5, 1.5, (2,) + H.shape[:3]).astype(np.float32)
        for how, kwargs, want in (("mean", {}, H.mean(1)),
                                  ("weighted", dict(weights=w, key_weights=kw), np.einsum("bci,bcij,bcj->bij", w, H, kw))):
            r, r0 = (np.asarray(op.reduce(how, impl="xla", **kwargs)) for op in (poisoned, clean))
            np.testing.assert_allclose(r[:, :T], r0[:, :T], atol=1e-6, err_msg=f"layer {i} {how}")
            np.testing.assert_array_equal(np.isnan(r), np.isnan(want), err_msg=f"layer {i} {how}")
            np.testing.assert_allclose(r, want, atol=1e-5, err_msg=f"layer {i} {how}")
    assert seen, model_type


def test_apply_in_blocks_and_under_jit_keeps_the_nan_rule(monkeypatch):
    """``apply`` forms ``H`` in blocks of at most ``APPLY_BUDGET`` elements and skips the NaN
    reach pass for values without NaN (``lax.cond`` under jit): blocked, jitted and one-block
    eager results agree, for channels (RG-LRU) and heads (local attention), with and without
    a NaN value at ``T``. Reference: the dense einsum with the NaN rule written out."""
    _, model = tiny("recurrent_gemma")
    sizes = []  # channels (heads) of the blocked loop's block, once per trace of it
    for i, clean, poisoned in operators_with_nan(model, 3):
        if i == 1:
            continue  # a second RG-LRU layer: layer 0 has channels, layer 2 attention heads
        # a NaN value on a finite H: only the reach pass makes rows >= T NaN
        nan_value = dataclasses.replace(clean, values=clean.values.at[0, :, T].set(np.nan))
        for op in (clean, poisoned, nan_value):
            H = np.asarray(op.materialize(), np.float64)
            v = np.asarray(op.values, np.float64)
            spec = "bcij,bcj->bci" if v.ndim == 3 else "bhij,bhjd->bhid"
            want = np.einsum(spec, H, np.nan_to_num(v, nan=0.0))
            reach = np.einsum(spec, (H != 0).astype(np.float64), np.isnan(v).astype(np.float64))
            want = np.where(reach > 0, np.nan, want) + np.asarray(op.offset, np.float64)
            one = np.asarray(op.apply())
            with monkeypatch.context() as m:
                m.setattr(dispatch, "APPLY_BUDGET", 2 * 40 * 40)  # two channels (heads) per block
                m.setattr(dispatch, "applied_block",
                          lambda spec, H, *a: sizes.append(H.shape[1]) or applied_block(spec, H, *a))
                blocked = np.asarray(op.apply())
                jitted = np.asarray(jax.jit(lambda o: o.apply())(op))
            for got in (one, blocked, jitted):
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"layer {i}")
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"layer {i}")
            assert np.isnan(want).any() == (op is not clean)
            assert not np.isnan(want[:, :, :T]).any()
    assert len(sizes) >= 2 and set(sizes) == {2}, sizes  # both layers' loops ran blocks of two


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_causality_of_logits_for_nan_and_perturbed_embeddings(model_type):
    """Property over positions t: a NaN or a changed embedding at t changes no logit before t."""
    spec, model = tiny(model_type)
    L = 24
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (1, L))
    base = np.asarray(model(ids))
    D = model.config.hidden_size
    bump = 3.0 * np.random.default_rng(5).standard_normal(D).astype(np.float32)  # not a constant: norms remove those
    for t in (0, 7, 16, L - 1):  # inside a chunk, at chunk edges, the last position
        for value in ("nan", "bump"):
            delta = np.zeros((1, L, D), np.float32)
            delta[0, t] = np.nan if value == "nan" else bump
            out = np.asarray(model.run_with_hooks(ids, adds={"hook_embed": delta}))
            np.testing.assert_allclose(out[:, :t], base[:, :t], atol=1e-5, err_msg=f"t={t} value={value}")
            assert not np.allclose(out[:, t:], base[:, t:], atol=1e-5, equal_nan=False), (t, value)
