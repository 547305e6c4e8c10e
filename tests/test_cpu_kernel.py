"""The fused CPU kernel (``impl="cpu"``) against the XLA reference and the block's own scan.

Operators come from Mamba's pure functions on random weights, so the cores are what
the model produces; bare cores cover every optional factor and a state size that is
not a multiple of the kernel's 16-wide vectors. Lengths 1, 16, 17, 37 and 100 cover
one partial chunk, exactly one chunk, a ragged last chunk and many chunks.
"""
import dataclasses
import functools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from implicit_attn.kernels import cpu
from implicit_attn.families import griffin, mamba
from implicit_attn.nn.hooks import between_layers
from implicit_attn.operator import (DocumentMaskedCore, ImplicitOperator, ScalarDecayCore, StateDecayCore,
                                  resolve_impl)
from kernel_cores import NoKernelCore

B = 2


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _op(L, variant="full", dt_shift=0.0, seed=2):
    cfg = mamba.Config(vocab_size=8, hidden_size=4, state_size=4, num_hidden_layers=1, conv_kernel=4)
    p = mamba.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["mixer"]
    p["dt_proj.bias"] = p["dt_proj.bias"] + dt_shift
    h = jax.random.normal(jax.random.PRNGKey(seed), (B, L, 4))
    return mamba.block.mixer_operator_jit(p, h, cfg=cfg, variant=variant)


def _bare_core(L, N=20, C=3, left=True, right=True, diag=True, conv=True, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    return StateDecayCore(
        q=f(B, L, N), k=f(B, L, N), A=-jnp.exp(f(C, N)), dt=jnp.abs(f(B, C, L)) * 0.3,
        left=f(B, C, L) if left else None, right=f(B, C, L) if right else None,
        diag=f(B, C, L) if diag else None, conv_w=f(C, 4) if conv else None)


def griffin_op(L, variant="full", restart=True):
    """Griffin's recurrent operator; batch row 1 packs a second document from position 20
    (or 2 for short L), so the document mask and the decay reset are both exercised."""
    cfg = griffin.Config(vocab_size=8, hidden_size=8, intermediate_size=4, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, lru_width=6,
                         block_types=("recurrent", "attention"))
    p = griffin.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["temporal_block"]
    h = jax.random.normal(jax.random.PRNGKey(2), (B, L, 8))
    pos = np.tile(np.arange(L), (B, 1))
    start = 20 if L > 24 else 2
    if restart and L > start:
        pos[1, start:] = np.arange(L - start)
    return griffin.block.recurrent_operator_jit(p, h, jnp.asarray(pos), cfg=cfg, variant=variant)


# 1: a single position; 37: several tiles, ragged, a document restart at 20; 100: longer rows
@pytest.mark.parametrize("L", [1, 37, 100])
@pytest.mark.parametrize("variant", griffin.VARIANTS)
def test_griffin_matches_xla(L, variant):
    op = griffin_op(L, variant)
    assert cpu.has_kernel(op.core) and resolve_impl("auto", op.core) == "cpu"
    got = op.materialize(impl="cpu")
    assert rel(got, op.materialize(impl="xla")) <= 1e-5
    if variant != "no_gate":  # no_gate carries the conv bias in the offset: still exact
        y = jnp.einsum("bcij,bcj->bci", got, op.values) + op.offset
        assert rel(y, op.output) <= 1e-5


# 1; 16: exactly one chunk; 37: several chunks with a ragged last one
@pytest.mark.parametrize("L", [1, 16, 37])
@pytest.mark.parametrize("variant", mamba.VARIANTS)
def test_materialize_matches_xla(L, variant):
    op = _op(L, variant)
    got = op.materialize(impl="cpu")
    want = op.materialize(impl="xla")
    assert got.shape == want.shape == (B, 8, L, L)
    assert rel(got, want) <= 1e-5
    assert np.all(np.triu(np.asarray(got), 1) == 0)  # exact zeros above the diagonal


def test_channel_subsets_out_of_order():
    op = _op(37)
    chans = [5, 0, 7, 3, 3]
    assert rel(op.materialize(chans, impl="cpu"), op.materialize(chans, impl="xla")) <= 1e-5


@pytest.mark.parametrize("parts", [(1, 1, 1, 1), (0, 0, 0, 0), (1, 0, 1, 0), (0, 1, 0, 1)])
def test_bare_cores_every_optional_factor(parts):
    core = _bare_core(41, **dict(zip(("left", "right", "diag", "conv"), map(bool, parts))))
    idx = jnp.arange(3)
    assert rel(cpu.cpu_dense(core, idx), core.dense(idx)) <= 1e-5


def test_operator_is_exact_through_the_kernel():
    """``H @ values + offset`` from the kernel's H reproduces the block's own scan output."""
    op = _op(100)
    H = op.materialize(impl="cpu")
    y = jnp.einsum("bcij,bcj->bci", H, op.values) + op.offset
    assert rel(y, op.output) <= 1e-5


def test_strong_decays_stay_finite():
    """Large steps drive the decays to underflow; the kernel must give zeros, not NaN."""
    op = _op(100, dt_shift=6.0)
    got = np.asarray(op.materialize(impl="cpu"))
    assert np.isfinite(got).all()
    assert rel(got, op.materialize(impl="xla")) <= 1e-5


def test_gradients_match_xla():
    op = _op(17)
    R = jax.random.normal(jax.random.PRNGKey(5), op.shape)

    def loss(core, impl):
        o = ImplicitOperator(op.values, op.offset, op.output, core)
        return jnp.sum(o.materialize(impl=impl) * R)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_cpu = grad(op.core, "cpu")
    g_xla = grad(op.core, "xla")
    for a, b in zip(jax.tree_util.tree_leaves(g_cpu), jax.tree_util.tree_leaves(g_xla)):
        assert rel(a, b) <= 1e-5


@pytest.mark.parametrize("how", ["mean", "abs_mean", "pos_mean", "weighted"])
@pytest.mark.parametrize("family", ["mamba", "griffin"])
def test_fused_reduce_matches_xla(how, family):
    op = _op(37) if family == "mamba" else griffin_op(37)
    shape = op.values.shape
    w = jax.random.normal(jax.random.PRNGKey(3), shape) if how == "weighted" else None
    kw = jax.random.normal(jax.random.PRNGKey(4), shape) if how == "weighted" else None
    got = op.reduce(how, weights=w, key_weights=kw, impl="cpu")
    want = op.reduce(how, weights=w, key_weights=kw, impl="xla", block_channels=3)
    assert got.shape == (B, 37, 37)
    assert rel(got, want) <= 1e-5


def test_fused_reduce_channel_subsets_and_short_inputs():
    for L in (1, 16, 17):
        op = _op(L)
        assert rel(op.reduce("abs_mean", channels=[6, 1, 1], impl="cpu"),
                   op.reduce("abs_mean", channels=[6, 1, 1], impl="xla")) <= 1e-5


def test_fused_reduce_gradients_match_xla():
    op = _op(17)
    w = jax.random.normal(jax.random.PRNGKey(3), op.values.shape)
    R = jax.random.normal(jax.random.PRNGKey(5), (B, 17, 17))

    def loss(core, w, impl):
        o = ImplicitOperator(op.values, op.offset, op.output, core)
        return jnp.sum(o.reduce("weighted", weights=w, impl=impl) * R)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    g_cpu = grad(op.core, w, "cpu")
    g_xla = grad(op.core, w, "xla")
    for a, b in zip(jax.tree_util.tree_leaves(g_cpu), jax.tree_util.tree_leaves(g_xla)):
        assert rel(a, b) <= 1e-5


def test_under_jit_and_vmap():
    op = _op(17)
    want = op.materialize(impl="xla")
    assert rel(jax.jit(lambda o: o.materialize(impl="cpu"))(op), want) <= 1e-5
    stacked = jax.vmap(lambda c: cpu.cpu_dense(c, jnp.arange(8)))(
        jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), op.core))
    assert rel(stacked[1], want) <= 1e-5


def test_threads_do_not_change_the_result(monkeypatch):
    core = _bare_core(37)
    idx = jnp.arange(3)
    monkeypatch.setattr(cpu, "num_threads", lambda: 1)
    one = np.asarray(cpu.cpu_dense(core, idx))
    monkeypatch.setattr(cpu, "num_threads", lambda: 4)
    four = np.asarray(cpu.cpu_dense(core, idx))
    np.testing.assert_array_equal(one, four)


def test_auto_uses_the_kernel_on_cpu_for_mamba():
    op = _op(5)
    assert jax.default_backend() == "cpu"
    assert resolve_impl("auto", op.core) == "cpu"
    big_state = _bare_core(5, N=80)
    assert not cpu.has_kernel(big_state)
    assert resolve_impl("auto", big_state) == "xla"


def test_unsupported_cores_and_limits_fail_loudly():
    other = NoKernelCore(scale=jnp.ones((2,)))
    with pytest.raises(TypeError, match="no kernel for NoKernelCore"):
        ImplicitOperator(jnp.ones((1, 2, 5)), jnp.zeros((1, 2, 5)), jnp.ones((1, 2, 5)), other).materialize(impl="cpu")
    assert resolve_impl("auto", other) == "xla"
    with pytest.raises(TypeError, match="state size 80 > 64"):
        cpu.cpu_dense(_bare_core(5, N=80), [0])
    with pytest.raises(ValueError, match="how must be one of"):
        cpu.cpu_reduce(_bare_core(5), [0], "max", jnp.ones((B, 1, 5)), jnp.ones((B, 1, 5)))


def _in_fresh_process(tmp_path, body, env):
    """Run ``body`` in a new interpreter (the kernel's build state is per process) with
    ``env`` replacing the variables it names; ``None`` removes one. Fails with its output."""
    full = dict(os.environ, IMPLICIT_ATTN_CACHE=str(tmp_path / "cache"))
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import sys
        sys.path[:0] = [{tests!r}, {root!r}]
        import jax, pytest
        from implicit_attn.kernels import cpu
        from implicit_attn.operator import resolve_impl
        from test_cpu_kernel import _op
    """).format(tests=str(Path(__file__).parent), root=str(Path(__file__).parent.parent)) + textwrap.dedent(body) + "\nprint('CHILD OK')\n")
    p = subprocess.run([sys.executable, str(script)], env=full, capture_output=True, text=True,
                       cwd=str(tmp_path))
    assert p.returncode == 0 and "CHILD OK" in p.stdout, p.stdout + p.stderr


def test_missing_compiler_is_reported(tmp_path):
    """Without a compiler, impl='cpu' raises naming the cause; 'auto' warns and uses XLA."""
    empty = tmp_path / "bin"
    empty.mkdir()
    _in_fresh_process(tmp_path, """
        # the mixer's forward asks for the scan kernel first: the one warning comes there
        with pytest.warns(UserWarning, match="fused CPU kernel unavailable"):
            op = _op(5)
        with pytest.raises(cpu.CpuKernelUnavailable, match="no C\\\\+\\\\+ compiler"):
            op.materialize(impl="cpu")
        assert resolve_impl("auto", op.core) == "xla"
    """, env=dict(PATH=str(empty), CXX=None))


def test_unwritable_cache_or_bad_library_is_reported(tmp_path):
    """A compiler that cannot be started (here: its interpreter is not executable, so the OS
    answers "Permission denied") is reported by load(); available() warns and says False."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    interp = bin_ / "interp"
    interp.write_text("not executable\n")
    interp.chmod(0o644)
    cxx = bin_ / "c++"
    cxx.write_text(f"#!{interp}\n")
    cxx.chmod(0o755)
    _in_fresh_process(tmp_path, """
        with pytest.raises(cpu.CpuKernelUnavailable, match="Permission denied"):
            cpu.load()
        with pytest.warns(UserWarning, match="fused CPU kernel unavailable"):
            assert not cpu.available()
    """, env=dict(PATH=str(bin_), CXX=None))


# 530 = two whole tiles of 256 columns and a ragged third: rows that span several column
# tiles, a conv reaching across a tile edge, a document restart (Griffin, batch row 1).
@pytest.mark.parametrize("family", ["mamba", "griffin"])
def test_fused_reduce_across_column_tiles(family, monkeypatch):
    L = 530
    op = _op(L) if family == "mamba" else griffin_op(L)
    w = jax.random.normal(jax.random.PRNGKey(3), op.values.shape)
    kw = jax.random.normal(jax.random.PRNGKey(4), op.values.shape)
    got = {}
    for how in ("weighted", "abs_mean"):
        args = dict(weights=w, key_weights=kw) if how == "weighted" else {}
        got[how] = op.reduce(how, **args, impl="cpu")
        assert rel(got[how], op.reduce(how, **args, impl="xla", block_channels=4)) <= 1e-5, how
    idx = jnp.arange(op.values.shape[1])
    monkeypatch.setattr(cpu, "num_threads", lambda: 1)
    one = np.asarray(cpu.cpu_reduce(op.core, idx, "weighted", w, kw))
    monkeypatch.setattr(cpu, "num_threads", lambda: 3)
    three = np.asarray(cpu.cpu_reduce(op.core, idx, "weighted", w, kw))
    np.testing.assert_array_equal(one, three)
    assert rel(one, got["weighted"]) <= 1e-5


def test_fused_reduce_several_channel_blocks():
    # The reduce prepares at most 64 channels at a time: 67 channels are two blocks.
    core = _bare_core(40, C=67)
    op = ImplicitOperator(jnp.ones((B, 67, 40)), jnp.zeros((B, 67, 40)), jnp.zeros((B, 67, 40)), core)
    for how in ("pos_mean", "mean"):  # the element-by-element tiles and the linear bands
        assert rel(op.reduce(how, impl="cpu"), op.reduce(how, impl="xla", block_channels=16)) <= 1e-5, how


def test_reduce_left_of_the_diagonal_folds_the_conv_and_keeps_nan_and_restarts():
    """Chunks two or more left of a row's own the reduce takes through conv columns (the conv folded
    into the key factors, the decay of the chunk after split off): every mode against XLA, with a
    NaN step (batch row 0, chunk 2) and a +inf step (a restart, batch row 1, chunk 4) whose decays
    reach those chunks; N = 20 (not a multiple of 16), every optional factor, two column tiles.
    NaN exactly where XLA has it, its values elsewhere; rows before the NaN as without it."""
    L = 300
    core = _bare_core(L, N=20, C=5, seed=3)
    dt = np.array(core.dt)
    dt[0, :, 40] = np.nan
    dt[1, :, 70] = np.inf
    poisoned = dataclasses.replace(core, dt=jnp.asarray(dt))
    r = np.random.default_rng(4)
    w, kw = (jnp.asarray(r.standard_normal((B, 5, L)), jnp.float32) for _ in range(2))
    idx = jnp.arange(5)
    for how in ("weighted", "abs_mean", "pos_mean", "mean"):
        args = dict(weights=w, key_weights=kw) if how == "weighted" else {}
        got, want = (np.asarray(ImplicitOperator(w, w, w, poisoned).reduce(how, **args, impl=impl))
                     for impl in ("cpu", "xla"))
        clean = np.asarray(ImplicitOperator(w, w, w, core).reduce(how, **args, impl="cpu"))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=how)
        assert np.isnan(got[0, 60:, :30]).all() and not np.isnan(got[1]).any(), how
        scale = np.max(np.abs(want[np.isfinite(want)]))
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0, err_msg=how)
        np.testing.assert_allclose(got[0, :40], clean[0, :40], atol=1e-5 * scale, rtol=0, err_msg=how)
        assert np.abs(got[1, 100:, :60]).max() <= 1e-6 * scale, how  # the restart: nothing across it
        assert rel(clean, ImplicitOperator(w, w, w, core).reduce(how, **args, impl="xla")) <= 1e-5, how
    one = np.asarray(cpu.cpu_reduce(poisoned, idx, "weighted", w, kw))
    assert np.isnan(one).any()


@pytest.mark.parametrize("K,N,L", [(1, 3, 100), (16, 20, 100), (16, 64, 70), (7, 1, 90)])
def test_reduce_folds_every_conv_width_and_state_size(K, N, L):
    """Conv widths 1 to 16 (a tap of the last column reaching through the whole next chunk), 1 to 64
    states: every mode equals XLA's."""
    core = _bare_core(L, N=N, C=4, seed=5)
    conv_w = jnp.asarray(np.random.default_rng(1).standard_normal((4, K)), jnp.float32)
    core = dataclasses.replace(core, conv_w=conv_w)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((B, 4, L)), jnp.float32)
    op = ImplicitOperator(w, w, w, core)
    for how in ("abs_mean", "pos_mean", "mean", "weighted"):
        args = dict(weights=w, key_weights=w) if how == "weighted" else {}
        assert rel(op.reduce(how, **args, impl="cpu"), op.reduce(how, **args, impl="xla")) <= 1e-5, how


def _rank_one_core(L, C=10, K=4, seed=0):
    """A bare rank-one decay (Griffin's RG-LRU without documents), which the kernel's linear reduce
    factorises left of each band of rows: in batch row 0 strong decays (some exp(-30), near 0) and
    a restart (a = 0, dt = +inf) in the middle, in row 1 mild decays only (columns far left of the
    diagonal still count), every optional factor, K conv taps."""
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    log_a = -np.abs(r.standard_normal((B, C, L))) * 0.02
    log_a[0, :, r.random(L) < 0.05] = -30.0
    log_a[0, :, L // 2] = -np.inf
    return ScalarDecayCore(log_a=jnp.asarray(log_a, jnp.float32), group=jnp.arange(C), left=f(B, C, L),
                           right=f(B, C, L), diag=f(B, C, L), conv_w=f(C, K))


# 37: a band and a ragged one; 300 (with the widest conv, 16 taps) and 530: many bands, rows whose
# left part spans several product tiles of 128 columns, ragged ends.
@pytest.mark.parametrize("L, K", [(37, 4), (300, 16), (530, 4)])
def test_rank_one_linear_reduce_matches_xla(L, K, monkeypatch):
    core = _rank_one_core(L, K=K)
    C = core.num_channels
    op = ImplicitOperator(jnp.ones((B, C, L)), jnp.zeros((B, C, L)), jnp.zeros((B, C, L)), core)
    w = jax.random.normal(jax.random.PRNGKey(3), (B, C, L))
    kw = jax.random.normal(jax.random.PRNGKey(4), (B, C, L))
    for how in ("mean", "weighted"):
        args = dict(weights=w, key_weights=kw) if how == "weighted" else {}
        got = np.asarray(op.reduce(how, **args, impl="cpu"))
        assert np.isfinite(got).all(), how
        assert rel(got, op.reduce(how, **args, impl="xla", block_channels=5)) <= 1e-5, how
    if L == 530:
        idx = jnp.arange(C)
        monkeypatch.setattr(cpu, "num_threads", lambda: 1)
        one = np.asarray(cpu.cpu_reduce(core, idx, "weighted", w, kw))
        monkeypatch.setattr(cpu, "num_threads", lambda: 3)
        np.testing.assert_array_equal(one, np.asarray(cpu.cpu_reduce(core, idx, "weighted", w, kw)))


def test_rank_one_linear_reduce_propagates_nan_like_the_elementwise_path():
    """A NaN decay: the factorised reduce gives NaN exactly where the kernel's element-by-element
    path does (taken for the same core inside a one-document mask) and agrees elsewhere."""
    L = 200
    core = _rank_one_core(L)
    core = dataclasses.replace(core, log_a=core.log_a.at[1, 3, 150].set(jnp.nan))
    idx = jnp.arange(core.num_channels)
    w = jax.random.normal(jax.random.PRNGKey(3), (B, idx.shape[0], L))
    got = np.asarray(cpu.cpu_reduce(core, idx, "weighted", w, w))
    want = np.asarray(cpu.cpu_reduce(DocumentMaskedCore(core, jnp.zeros((B, L), jnp.int32)), idx, "weighted", w, w))
    nan = np.isnan(want)
    assert nan.any() and not nan.all()
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert rel(got[~nan], want[~nan]) <= 1e-5


def test_rank_one_linear_reduce_without_optional_factors():
    """No gate, input scale, skip term or conv (K = 1); 1 and 17: no band left of another."""
    for L in (1, 17, 161):
        core = dataclasses.replace(_rank_one_core(L, C=3), left=None, right=None, diag=None, conv_w=None)
        op = ImplicitOperator(jnp.ones((B, 3, L)), jnp.zeros((B, 3, L)), jnp.zeros((B, 3, L)), core)
        w = jax.random.normal(jax.random.PRNGKey(3), (B, 3, L))
        got = op.reduce("weighted", weights=w, key_weights=w, impl="cpu")
        assert rel(got, op.reduce("weighted", weights=w, key_weights=w, impl="xla")) <= 1e-5, L


# A ScalarDecayCore with q k^T groups: each group's matrix formed once (XLA), the head-matrix kernel
# the channels; against a float64 definition written out here.
def _low_rank_core(L, optional=True, seed=0):
    """5 channels in 2 groups (channel 0 in group 1), N = 3, a reset (log a = -inf) in group 1."""
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    la = (-jnp.abs(f(B, 2, L))).at[0, 1, L // 2].set(-jnp.inf)
    parts = dict(left=f(B, 5, L), right=f(B, 5, L), diag=f(B, 5, L), conv_w=f(5, 3)) if optional else {}
    return ScalarDecayCore(log_a=la, group=jnp.array([1, 0, 0, 1, 1]), q=f(B, 2, L, 3), k=f(B, 2, L, 3), **parts)


def _low_rank64(core):
    """``(B, C, L, L)`` float64: ``(diag(left_c) K_g diag(right_c) + diag(diag_c)) M_c`` with ``K_g[i, j] =
    exp(sum_{t=j+1..i} log a_g[t]) q_g[i] . k_g[j]`` for ``j <= i`` and ``M_c`` the conv matrix."""
    g = np.asarray(core.group)
    la, q, k = (np.asarray(x, np.float64)[:, g] for x in (core.log_a, core.q, core.k))
    L = la.shape[-1]
    i, j, t = np.arange(L)[:, None, None], np.arange(L)[None, :, None], np.arange(L)[None, None, :]
    inside = (j < t) & (t <= i)  # (L, L, L): the steps between key j and query i
    S = np.where(inside, la[..., None, None, :], 0.0).sum(-1)
    causal = np.tril(np.ones((L, L), bool))
    H = np.where(causal, np.exp(np.where(causal, S, 0.0)) * np.einsum("bcin,bcjn->bcij", q, k), 0.0)
    one = lambda x: np.ones(la.shape) if x is None else np.asarray(x, np.float64)
    H = one(core.left)[..., :, None] * H * one(core.right)[..., None, :]
    if core.diag is not None:
        H = H + np.asarray(core.diag, np.float64)[..., :, None] * np.eye(L)
    if core.conv_w is not None:
        w = np.asarray(core.conv_w, np.float64)
        d = np.arange(L)[:, None] - np.arange(L)[None, :]
        K = w.shape[1]
        M = np.where((d >= 0) & (d < K), w[:, np.clip(K - 1 - d, 0, K - 1)], 0.0)  # (C, L, L)
        H = np.einsum("bcij,cjk->bcik", H, M)
    return H


@pytest.mark.parametrize("L, optional", [(1, True), (17, False), (37, True)])
def test_low_rank_scalar_decay_kernel_matches_float64_and_xla(L, optional):
    """``materialize`` (channels out of order and repeated, eager and under jit with traced channels)
    and every reduce against float64; exact zeros where XLA has them (across the reset)."""
    core = _low_rank_core(L, optional)
    assert cpu.has_kernel(core) and resolve_impl("auto", core) == "cpu"
    want = _low_rank64(core)
    idx = jnp.array([4, 0, 2, 2, 1])
    got = np.asarray(cpu.cpu_dense(core, idx))
    assert rel(got, want[:, np.asarray(idx)]) <= 1e-5
    np.testing.assert_array_equal(got == 0, np.asarray(jax.jit(lambda c: c.dense(idx))(core)) == 0)
    traced = jax.jit(cpu.cpu_dense)(core, idx)
    assert rel(traced, want[:, np.asarray(idx)]) <= 1e-5
    r = np.random.default_rng(1)
    qw, kw = (jnp.asarray(r.standard_normal((B, 5, L)), jnp.float32) for _ in range(2))
    for how, f in (("weighted", lambda x: x), ("abs_mean", np.abs), ("pos_mean", lambda x: np.maximum(x, 0))):
        red = np.einsum("bci,bcij,bcj->bij", np.asarray(qw, np.float64), f(want[:, np.asarray(idx)]),
                        np.asarray(kw, np.float64))
        assert rel(cpu.cpu_reduce(core, idx, how, qw, kw), red) <= 1e-5, how


def test_low_rank_scalar_decay_kernel_gradients():
    """Gradients of materialize and reduce equal XLA's (the backward pass is XLA's)."""
    core = _low_rank_core(17)
    R = jax.random.normal(jax.random.PRNGKey(3), (B, 5, 17, 17))
    w = jax.random.normal(jax.random.PRNGKey(4), (B, 5, 17))
    dense = lambda impl: lambda c: jnp.sum(ImplicitOperator(w, w, w, c).materialize(impl=impl) * R)
    reduce = lambda impl: lambda c: jnp.sum(ImplicitOperator(w, w, w, c).reduce("weighted", weights=w,
                                                                                 impl=impl) * R[:, 0])
    for loss in (dense, reduce):
        g = [jax.jit(jax.grad(loss(impl), allow_int=True))(core) for impl in ("cpu", "xla")]
        for name in ("log_a", "q", "k", "left", "right", "diag", "conv_w"):
            assert rel(getattr(g[0], name), getattr(g[1], name)) <= 1e-5, name


@pytest.mark.parametrize("inner", ["low_rank", "mamba2", "rwkv", "attention"])
def test_documents_over_a_core_whose_kernel_reads_none(inner):
    """A ``DocumentMaskedCore`` over a core whose kernel takes no document ids: that kernel's matrices
    with the entries between documents set to 0, equal to XLA's (exact zeros where XLA has them), and
    the reduce of such blocks; gradients through XLA. (Before, the CPU backend claimed these and ran
    the rank-one kernel on them, which failed.)"""
    from kernel_cores import document_ids, local_attention_op, mamba2_op, rwkv_op

    L = 37
    core = {"low_rank": lambda: _low_rank_core(L), "mamba2": lambda: mamba2_op().core,
            "rwkv": lambda: rwkv_op().core, "attention": lambda: local_attention_op().core}[inner]()
    masked = DocumentMaskedCore(inner=core, seg=document_ids(B, L))
    assert cpu.has_kernel(masked) and resolve_impl("auto", masked) == "cpu"
    idx = jnp.array([2, 0, 1, 1])
    got, want = np.asarray(cpu.cpu_dense(masked, idx)), np.asarray(jax.jit(lambda c: c.dense(idx))(masked))
    assert rel(got, want) <= 1e-5
    np.testing.assert_array_equal(got == 0, want == 0)
    assert not got[1, :, L // 2:, :L // 2].any() and got[1, :, L // 2:, L // 2:].any()
    w = jax.random.normal(jax.random.PRNGKey(4), (B, 4, L))
    for how in ("weighted", "abs_mean"):
        red = np.einsum("bci,bcij,bcj->bij", np.asarray(w, np.float64),
                        np.abs(want) if how == "abs_mean" else want, np.asarray(w, np.float64))
        assert rel(cpu.cpu_reduce(masked, idx, how, w, w), red) <= 1e-5, how
    loss = lambda dense: lambda c: jnp.sum(dense(c) ** 2)
    grads = [jax.jit(jax.grad(loss(f), allow_int=True))(masked) for f in (lambda c: cpu.cpu_dense(c, idx),
                                                                           lambda c: c.dense(idx))]
    for a, b in zip(jax.tree_util.tree_leaves(grads[0]), jax.tree_util.tree_leaves(grads[1])):
        if jnp.issubdtype(a.dtype, jnp.floating):
            assert rel(a, b) <= 1e-5


def test_documents_over_a_core_without_a_kernel_name_it():
    masked = DocumentMaskedCore(inner=NoKernelCore(scale=jnp.ones((2,))), seg=jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(TypeError, match="its inner core has no kernel: no kernel for NoKernelCore"):
        cpu.cpu_dense(masked, [0])
    assert resolve_impl("auto", masked) == "xla"


# Mamba-1's selective scan (the forward, kernels.cpu.selective_scan) against a float64
# recurrence written out here and XLA's sequential scan.
def scan_inputs(B_, L, C, N, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s).astype(np.float32)
    dt = np.log1p(np.exp(f(B_, L, C) - 2.0)).astype(np.float32)  # softplus: positive step sizes
    return f(B_, L, C), dt, -np.exp(f(C, N)), f(B_, L, N), f(B_, L, N)


def scan64(u, dt, A, Bm, Cm):
    u, dt, A, Bm, Cm = (np.asarray(x, np.float64) for x in (u, dt, A, Bm, Cm))
    h = np.zeros(u.shape[:1] + A.shape)
    y = np.zeros(u.shape)
    for t in range(u.shape[1]):
        h = np.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * Bm[:, t, None, :]
        y[:, t] = np.einsum("bcn,bn->bc", h, Cm[:, t])
    return y


# 21 and 37 channels: a last block of 5 lanes; N = 1 and 64 the smallest and largest states
@pytest.mark.parametrize("shape", [(2, 37, 21, 5), (1, 19, 37, 1), (1, 9, 16, 64)])
def test_selective_scan_kernel_matches_float64_and_xla(shape):
    from implicit_attn.ops import selective_scan_sequential

    args = scan_inputs(*shape)
    got = np.asarray(jax.jit(cpu.selective_scan)(*args))
    assert rel(got, scan64(*args)) <= 1e-5
    assert rel(got, selective_scan_sequential(*map(jnp.asarray, args))) <= 1e-5


def check_forward_kernel(kernel, reference, args, in_axes, monkeypatch, grad_tol: float = 1e-5):
    """A forward kernel's gradients (to ``grad_tol`` of each one's largest entry) and forward-mode
    derivatives against its XLA ``reference``; under ``vmap`` (``in_axes``: the unbatched operands
    None) each example as alone; the same bits with 1 and 3 threads. The loss is linear in the output
    (``c . y``), so the gradients compare the derivative rules, not the kernel's float32 rounding of
    ``y`` (a ``sin(y)`` loss carries it through ``cos(y)``); the outputs are compared by the
    forward-mode check."""
    c = jnp.asarray(np.random.default_rng(7).standard_normal(jax.eval_shape(reference, *args).shape), jnp.float32)
    loss = lambda f: (lambda *a: jnp.sum(c * f(*a)))
    argnums = tuple(range(len(args)))
    grad = lambda f: jax.jit(jax.grad(loss(f), argnums))(*args)
    for a, b in zip(grad(kernel), grad(reference)):
        assert rel(a, b) <= grad_tol
    tangents = tuple(jnp.ones_like(a) * 0.1 for a in args)
    fwd, ref = (jax.jit(functools.partial(jax.jvp, f))(args, tangents) for f in (kernel, reference))
    assert rel(fwd[0], ref[0]) <= 1e-5 and rel(fwd[1], ref[1]) <= 1e-5
    stacked = jax.vmap(kernel, in_axes=in_axes)(*(x if ax is None else jnp.stack([x, 2 * x])
                                                  for x, ax in zip(args, in_axes)))
    assert rel(stacked[0], kernel(*args)) == 0.0
    monkeypatch.setattr(cpu, "num_threads", lambda: 1)
    one = np.asarray(jax.jit(kernel)(*args))
    monkeypatch.setattr(cpu, "num_threads", lambda: 3)
    np.testing.assert_array_equal(one, np.asarray(jax.jit(kernel)(*args)))


def test_selective_scan_kernel_gradients_nan_vmap_and_threads(monkeypatch):
    from implicit_attn.ops import selective_scan_sequential

    args = tuple(map(jnp.asarray, scan_inputs(2, 23, 19, 4, seed=1)))
    check_forward_kernel(cpu.selective_scan, selective_scan_sequential, args, (0, 0, None, 0, 0), monkeypatch)
    # a NaN input at t = 7 of channel 3: rows before it untouched, that channel NaN from t on,
    # the same pattern as XLA's scan (other channels do not see it)
    u = args[0].at[0, 7, 3].set(jnp.nan)
    got = np.asarray(cpu.selective_scan(u, *args[1:]))
    ref = np.asarray(selective_scan_sequential(u, *args[1:]))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got[0, 7:, 3]).all() and not np.isnan(got[0, :7]).any() and not np.isnan(got[1]).any()
    with pytest.raises(ValueError, match="at most 64 states per channel, got 65"):
        cpu.selective_scan(*scan_inputs(1, 3, 2, 65))


def test_the_mamba_forward_takes_the_scan_kernel_where_it_pays_off(monkeypatch):
    """``selective_scan(method="auto")`` lowers the kernel's call on CPU from ``SCAN_AUTO_MIN_FACTOR
    * AUTO_MIN_FACTOR_ELEMENTS`` state updates on (and XLA's scan below, or for more than 64
    states), with the same numbers; by default the shipped induction model's scan stays XLA's."""
    assert cpu.SCAN_AUTO_MIN_FACTOR * cpu.AUTO_MIN_FACTOR_ELEMENTS in (0, 1 << 22)  # the suite's 0, else the default
    args = tuple(map(jnp.asarray, scan_inputs(1, 12, 8, 4, seed=2)))
    lowered = lambda *a: jax.jit(lambda *x: mamba.block.selective_scan(*x)).lower(*a).as_text()
    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 2)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 12 * 8 * 2)
    assert "implicit_attn_selective_scan" in lowered(*args)
    fast = mamba.block.selective_scan(*args)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 12 * 8 * 2 + 1)
    assert "implicit_attn_selective_scan" not in lowered(*args)
    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 64)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 1 << 16)  # the defaults
    shipped = tuple(map(jnp.asarray, scan_inputs(1, 255, 128, 16)))  # its layer at the task's length
    assert not cpu.scan_pays_off(shipped[0], shipped[2])
    assert rel(fast, mamba.block.selective_scan(*args)) <= 1e-6
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 0)
    big = tuple(map(jnp.asarray, scan_inputs(1, 4, 2, 65)))
    assert not cpu.scan_pays_off(big[0], big[2])
    assert "implicit_attn_selective_scan" not in lowered(*big)


# Mamba-2's SSD (the forward, kernels.cpu.ssd_scan) against a float64 recurrence written out here
# and the chunked XLA form (ops.ssd_chunked).
def ssd_inputs(B_, L, H, P, G, N, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s).astype(np.float32)
    dt = np.log1p(np.exp(f(B_, L, H) - 2.0)).astype(np.float32)  # softplus: positive step sizes
    return f(B_, L, H, P), dt, -np.exp(f(H)), f(B_, L, G, N), f(B_, L, G, N)


def ssd64(x, dt, A, Bm, Cm):
    x, dt, A, Bm, Cm = (np.asarray(a, np.float64) for a in (x, dt, A, Bm, Cm))
    hg = x.shape[2] // Bm.shape[2]
    S = np.zeros(x.shape[:1] + x.shape[2:] + Bm.shape[3:])  # (B, H, P, N)
    y = np.zeros(x.shape)
    for t in range(x.shape[1]):
        Bt, Ct = np.repeat(Bm[:, t], hg, axis=1), np.repeat(Cm[:, t], hg, axis=1)  # (B, H, N)
        S = np.exp(dt[:, t] * A)[..., None, None] * S + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None]
        y[:, t] = np.einsum("bhpn,bhn->bhp", S, Ct)
    return y


# P = 5 and 70: a partial vector and more than one pass of four vectors; G = 3 groups of 2 heads
# and one group of all heads; L = 1 and lengths that are not a multiple of the chunk
@pytest.mark.parametrize("shape", [(2, 37, 6, 5, 3, 7), (1, 70, 4, 19, 1, 16), (1, 9, 2, 70, 2, 3), (1, 1, 3, 8, 1, 4)])
def test_ssd_kernel_matches_float64_and_xla(shape):
    from implicit_attn.ops import ssd_chunked

    args = ssd_inputs(*shape)
    got = np.asarray(jax.jit(cpu.ssd_scan)(*args))
    assert rel(got, ssd64(*args)) <= 1e-5
    assert rel(got, ssd_chunked(*map(jnp.asarray, args), chunk=16)) <= 1e-5


def test_ssd_kernel_gradients_vmap_threads_and_bad_shapes(monkeypatch):
    from implicit_attn.ops import ssd_chunked

    args = tuple(map(jnp.asarray, ssd_inputs(2, 23, 4, 6, 2, 5, seed=1)))
    check_forward_kernel(cpu.ssd_scan, ssd_chunked, args, (0, 0, None, 0, 0), monkeypatch)
    with pytest.raises(ValueError, match="H a multiple of G"):
        cpu.ssd_scan(args[0], args[1], args[2], args[3][:, :, :1].repeat(3, 2), args[4][:, :, :1].repeat(3, 2))


def test_the_mamba2_forward_takes_the_ssd_kernel_where_it_pays_off(monkeypatch):
    """``mamba2.block.ssd`` lowers the kernel's call on CPU from ``SCAN_AUTO_MIN_FACTOR *
    AUTO_MIN_FACTOR_ELEMENTS`` state updates on (the chunked XLA form below it, and in an export
    for an accelerator), with the same numbers, NaN kept causal as before."""
    from implicit_attn.families import mamba2

    x, dt, A, Bm, Cm = map(jnp.asarray, ssd_inputs(1, 12, 4, 3, 2, 5, seed=2))
    D = jnp.arange(4.0)
    run = lambda *a: mamba2.block.ssd(*a, chunk=4, D=D)
    lowered = lambda *a: jax.jit(lambda *x: run(*x)).lower(*a).as_text()  # traced anew: the choice is made then
    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 2)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 12 * 4 * 3 * 5 // 2)
    assert "implicit_attn_ssd_scan" in lowered(x, dt, A, Bm, Cm)
    exported = jax.export.export(jax.jit(run), platforms=["cuda"])(x, dt, A, Bm, Cm).mlir_module()
    assert "implicit_attn_ssd_scan" not in exported
    x = x.at[0, 7, 1, 2].set(jnp.nan)  # a NaN input of head 1 at t = 7: that head NaN from t = 7 on
    fast = np.asarray(jax.jit(lambda *a: run(*a))(x, dt, A, Bm, Cm))
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 12 * 4 * 3 * 5 // 2 + 1)
    assert "implicit_attn_ssd_scan" not in lowered(x, dt, A, Bm, Cm)
    slow = np.asarray(jax.jit(lambda *a: run(*a))(x, dt, A, Bm, Cm))
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(slow))
    assert np.isnan(fast[0, 7:, 1]).all() and not np.isnan(fast[0, :7]).any() and not np.isnan(fast[0, :, 0]).any()
    assert rel(np.nan_to_num(fast), np.nan_to_num(slow)) <= 1e-6
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 0)


# The gated delta rule (the forward, kernels.cpu.delta_scan) against a float64 recurrence written out
# here and the chunked XLA form (ops.delta_rule).
def delta_inputs(B_, H, L, dk, dv, per_dim, seed=0):
    r = np.random.default_rng(seed)
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    q, k = unit(r.standard_normal((B_, H, L, dk))), unit(r.standard_normal((B_, H, L, dk)))
    log_a = -r.uniform(0, 1, (B_, H, L) + ((dk,) if per_dim else ())).astype(np.float32)
    return q, k, r.standard_normal((B_, H, L, dv)).astype(np.float32), log_a, r.uniform(0, 1.5, (B_, H, L)).astype(np.float32)


def delta64(q, k, v, log_a, beta, erase=True):
    q, k, v, log_a, beta = (np.asarray(x, np.float64) for x in (q, k, v, log_a, beta))
    S = np.zeros(v.shape[:2] + v.shape[3:] + k.shape[3:])  # (B, H, d_v, d_k)
    o = np.zeros(v.shape)
    for t in range(k.shape[2]):
        a = np.exp(log_a[:, :, t])
        S = S * (a[..., None, None] if a.ndim == 2 else a[:, :, None, :])  # S Diag(a_t)
        kt, bt = k[:, :, t], beta[:, :, t, None, None]
        if erase:
            S = S - bt * np.einsum("bhvd,bhd->bhv", S, kt)[..., None] * kt[:, :, None, :]
        S = S + bt * v[:, :, t, :, None] * kt[:, :, None, :]
        o[:, :, t] = np.einsum("bhvd,bhd->bhv", S, q[:, :, t])
    return o


# d_v = 7 and 70: a partial vector and more than one block of four vectors; a decay per head and
# per key dimension; with and without the erasure; L = 1
@pytest.mark.parametrize("shape", [(2, 3, 37, 5, 7, False), (1, 2, 29, 19, 70, True), (1, 1, 1, 4, 3, True),
                                   (1, 2, 40, 16, 16, False)])
@pytest.mark.parametrize("erase", [True, False])
def test_delta_kernel_matches_float64_and_xla(shape, erase):
    from implicit_attn.ops import delta_rule

    args = delta_inputs(*shape)
    got = np.asarray(jax.jit(cpu.delta_scan, static_argnames="erase")(*args, erase=erase))
    assert rel(got, delta64(*args, erase=erase)) <= 1e-5
    assert rel(got, delta_rule(*map(jnp.asarray, args), erase=erase)) <= 1e-5


@pytest.mark.parametrize("per_dim", [False, True])
def test_delta_kernel_gradients_vmap_threads_and_bad_shapes(per_dim, monkeypatch):
    from implicit_attn.ops import delta_rule

    args = tuple(map(jnp.asarray, delta_inputs(2, 3, 21, 6, 10, per_dim, seed=1)))
    check_forward_kernel(cpu.delta_scan, delta_rule, args, (0, 0, 0, 0, 0), monkeypatch)
    with pytest.raises(ValueError, match="log_a"):
        cpu.delta_scan(*args[:3], args[3][..., :1, None], args[4])


def test_the_delta_rule_forward_takes_the_kernel_where_it_pays_off(monkeypatch):
    """``qwen3_next.block.delta_inner`` (every DeltaNet family's forward) lowers the kernel's call on
    CPU from ``SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS`` state updates on (the chunked XLA form
    below it, and in an export for an accelerator), with the same output, NaN marked as before."""
    from implicit_attn.families import qwen3_next
    from implicit_attn.registry import family

    spec = family("qwen3_next")
    cfg = spec.config.from_hf(spec.tiny)
    kind = cfg.layer_types.index("delta")
    p = spec.init_params(cfg, jax.random.PRNGKey(0))["layers"][kind]["mixer"]
    h = jax.random.normal(jax.random.PRNGKey(1), (1, 12, cfg.hidden_size))
    updates = 12 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    check_layer_takes_the_recurrence_kernel(lambda p, h: qwen3_next.block.delta_inner(p, h, cfg)[0], p, h, updates,
                                            monkeypatch)


def check_layer_takes_the_recurrence_kernel(run, p, x, updates: int, monkeypatch):
    """``run(p, x)`` (``x (1, 12, D)``) lowers the DPLR kernel's call on CPU from ``updates`` state
    updates on and the XLA form below it and in an export for an accelerator, with the same output;
    a NaN input at t = 7 makes every output from t = 7 on NaN, none before, on both paths."""
    lowered = lambda *a: jax.jit(lambda *x: run(*x)).lower(*a).as_text()  # traced anew: the choice is made then
    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 1)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", updates)
    assert "implicit_attn_dplr_scan" in lowered(p, x)
    exported = jax.export.export(jax.jit(run), platforms=["cuda"])(p, x).mlir_module()
    assert "implicit_attn_dplr_scan" not in exported
    x = x.at[0, 7, 0].set(jnp.nan)
    fast = np.asarray(jax.jit(lambda *a: run(*a))(p, x))
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", updates + 1)
    assert "implicit_attn_dplr_scan" not in lowered(p, x)
    slow = np.asarray(jax.jit(lambda *a: run(*a))(p, x))
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(slow))
    assert np.isnan(fast[0, 7:]).all() and not np.isnan(fast[0, :7]).any()
    assert rel(np.nan_to_num(fast), np.nan_to_num(slow)) <= 1e-5
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 0)


# The mLSTM read-out (the forward, kernels.cpu.mlstm_scan) against a float64 recurrence written out
# here and the chunked XLA form (ops.mlstm_rule), with the torch forward's stabiliser.
def mlstm_inputs(B_, H, L, dk, dv, seed=0):
    from implicit_attn.ops import mlstm_stabiliser

    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s).astype(np.float32)
    log_f = np.log(1 / (1 + np.exp(-(f(B_, H, L) + 2.0)))).astype(np.float32)  # logsigmoid
    log_i = (3 * f(B_, H, L)).astype(np.float32)
    m = np.asarray(mlstm_stabiliser(log_f, log_i, 8, None))
    return f(B_, H, L, dk) * np.float32(dk ** -0.5), f(B_, H, L, dk), f(B_, H, L, dv), log_f, log_i, m


def mlstm64(q, k, v, log_f, log_i, m, eps):
    """``(h, norm)`` by the stabilised recurrence in float64, ``m_{-1} = 0``."""
    q, k, v, log_f, log_i, m = (np.asarray(x, np.float64) for x in (q, k, v, log_f, log_i, m))
    C = np.zeros(v.shape[:2] + k.shape[3:] + v.shape[3:])  # (B, H, d_k, d_v)
    n = np.zeros(k.shape[:2] + k.shape[3:])
    h, norm = np.zeros(v.shape), np.zeros(m.shape)
    before = np.zeros(m.shape[:2])
    for t in range(k.shape[2]):
        a, b = np.exp(log_f[:, :, t] + before - m[:, :, t]), np.exp(log_i[:, :, t] - m[:, :, t])
        C = a[..., None, None] * C + b[..., None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
        n = a[..., None] * n + b[..., None] * k[:, :, t]
        norm[:, :, t] = np.maximum(np.abs(np.einsum("bhd,bhd->bh", n, q[:, :, t])), np.exp(-m[:, :, t])) + eps
        h[:, :, t] = np.einsum("bhde,bhd->bhe", C, q[:, :, t]) / norm[:, :, t, None]
        before = m[:, :, t]
    return h, norm


# d_v = 7 and 70: a partial vector and more than one block with the column of ones; L = 1; a length
# that is not a multiple of the stabiliser's chunk
@pytest.mark.parametrize("shape", [(2, 3, 37, 5, 7), (1, 2, 29, 19, 70), (1, 1, 1, 4, 3), (1, 2, 40, 16, 16)])
def test_mlstm_kernel_matches_float64_and_xla(shape):
    from implicit_attn.ops import mlstm_rule

    args = mlstm_inputs(*shape)
    h, norm = jax.jit(cpu.mlstm_scan, static_argnames="eps")(*args, eps=1e-6)
    h64, norm64 = mlstm64(*args, 1e-6)
    assert rel(h, h64) <= 1e-5 and rel(norm, norm64) <= 1e-5
    hx, normx = mlstm_rule(*map(jnp.asarray, args), 1e-6, 8)
    assert rel(h, hx) <= 1e-5 and rel(norm, normx) <= 1e-5


def test_mlstm_kernel_gradients_vmap_threads_and_bad_shapes(monkeypatch):
    from implicit_attn.ops import mlstm_rule

    joined = lambda h, norm: jnp.concatenate([h, norm[..., None]], axis=-1)
    args = tuple(map(jnp.asarray, mlstm_inputs(2, 3, 21, 6, 10, seed=1)))
    kernel = lambda *a: joined(*cpu.mlstm_scan(*a, eps=1e-6))
    # The gradient in m is a difference of terms ~200x larger: float32 leaves 2-3e-5 of it either way
    # (against torch's float64 autograd: 3.1e-5 here, 2.2e-5 for mlstm_rule's; the others ~4e-6 both).
    check_forward_kernel(kernel, lambda *a: joined(*mlstm_rule(*a, 1e-6, 8)), args, (0,) * 6, monkeypatch,
                         grad_tol=5e-5)
    # each gradient against the float64 recurrence's central differences along a random direction
    c = np.random.default_rng(8).standard_normal((2, 3, 21, 11))
    loss64 = lambda xs: float(np.sum(c * np.concatenate([(o := mlstm64(*xs, 1e-6))[0], o[1][..., None]], -1)))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.asarray(c, jnp.float32) * kernel(*a)), tuple(range(6))))(*args)
    base = [np.asarray(x, np.float64) for x in args]
    for i, g in enumerate(grads):
        d = np.random.default_rng(20 + i).standard_normal(base[i].shape)
        eps = 1e-6
        step = lambda s: loss64([x + s * eps * d if j == i else x for j, x in enumerate(base)])
        assert abs(float(np.sum(np.asarray(g, np.float64) * d)) - (step(1) - step(-1)) / (2 * eps)) \
            <= 2e-5 * float(np.sum(np.abs(np.asarray(g, np.float64) * d))), i
    with pytest.raises(ValueError, match="log_f, log_i and m"):
        cpu.mlstm_scan(*args[:5], args[5][..., :1], eps=1e-6)


def test_the_xlstm_forward_takes_the_kernel_where_it_pays_off(monkeypatch):
    """``xlstm.block.recurrence`` lowers the kernel's call on CPU from ``SCAN_AUTO_MIN_FACTOR *
    AUTO_MIN_FACTOR_ELEMENTS`` state updates on (the chunk-wise XLA form below it, and in an export for
    an accelerator), with the same layer output, NaN marked as before."""
    from implicit_attn.families import xlstm
    from implicit_attn.registry import family

    spec = family("xlstm")
    cfg = spec.config.from_hf(spec.tiny)
    p = spec.init_params(cfg, jax.random.PRNGKey(0))["layers"][0]["mlstm_layer"]
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 12, cfg.hidden_size))
    updates = 12 * cfg.num_heads * cfg.qk_head_dim * cfg.v_dim // cfg.num_heads
    check_layer_takes_the_recurrence_kernel(lambda p, x: xlstm.block.mixer_forward(p, x, cfg), p, x, updates,
                                            monkeypatch)


# RWKV-4's WKV (the forward, kernels.cpu.wkv_scan) against the float64 softmax-weighted sum of its
# definition and the chunked XLA form (ops.wkv_chunked).
def wkv_inputs(B_, L, A, seed=0, strong=False):
    r = np.random.default_rng(seed)
    # strong (seed 0): decays down to e^-393 a step, whose products underflow float32, and keys up to +-39
    w = -np.exp(r.uniform(-3, 6 if strong else 1, A)).astype(np.float32)
    u = r.normal(size=A).astype(np.float32)
    scale = 10.0 if strong else 1.0
    k, v = (r.normal(size=(B_, L, A)).astype(np.float32) * s for s in (scale, 1.0))
    return w, u, k, v


def wkv64(w, u, k, v):
    """``wkv_i = sum_{j<=i} e^{l[i,j]} v_j / sum_{j<=i} e^{l[i,j]}``, ``l[i,j] = (i-1-j) w + k_j``
    (``j < i``), ``l[i,i] = u + k_i``, in float64, max-shifted per row."""
    w, u, k, v = (np.asarray(x, np.float64) for x in (w, u, k, v))
    out = np.zeros_like(k)
    for i in range(k.shape[1]):
        l = (i - 1 - np.arange(i))[None, :, None] * w + k[:, :i]
        l = np.concatenate([l, (u + k[:, i])[:, None]], axis=1)  # (B, i + 1, A)
        e = np.exp(l - l.max(1, keepdims=True))
        out[:, i] = (e * v[:, :i + 1]).sum(1) / e.sum(1)
    return out


@pytest.mark.parametrize("shape, strong", [((2, 37, 19), False), ((1, 1, 16), False), ((1, 70, 40), True)])
def test_wkv_kernel_matches_float64_and_xla(shape, strong):
    """A last block of fewer than 16 channels, L = 1, and decays and keys whose exponentials
    over- or underflow float32 without the running max."""
    from implicit_attn.ops import wkv_chunked

    args = wkv_inputs(*shape, strong=strong)
    got = np.asarray(jax.jit(cpu.wkv_scan)(*args))
    assert rel(got, wkv64(*args)) <= 1e-5
    assert rel(got, wkv_chunked(*map(jnp.asarray, args), chunk=8)) <= 1e-5


def test_wkv_kernel_gradients_vmap_threads_and_bad_shapes(monkeypatch):
    from implicit_attn.ops import wkv_chunked

    args = tuple(map(jnp.asarray, wkv_inputs(2, 23, 21, seed=1)))
    check_forward_kernel(cpu.wkv_scan, wkv_chunked, args, (None, None, 0, 0), monkeypatch)
    with pytest.raises(ValueError, match=r"wkv_scan: w, u must be \(A,\)"):
        cpu.wkv_scan(args[0][:-1], *args[1:])


def test_the_rwkv4_forward_takes_the_wkv_kernel_where_it_pays_off(monkeypatch):
    """``rwkv.block.wkv`` lowers the kernel's call on CPU from ``SCAN_AUTO_MIN_FACTOR *
    AUTO_MIN_FACTOR_ELEMENTS`` units of the chunked form's work on (``B L A`` times
    ``WKV_CHUNK_WORK``; the chunked XLA form below it, and in an export for an accelerator), with
    the same numbers, NaN kept causal as before."""
    from implicit_attn.families import rwkv

    w, u, k, v = map(jnp.asarray, wkv_inputs(1, 12, 5, seed=2))
    run = lambda *a: rwkv.block.wkv(*a)
    lowered = lambda *a: jax.jit(lambda *x: run(*x)).lower(*a).as_text()  # traced anew: the choice is made then
    work = 12 * 5 * cpu.WKV_CHUNK_WORK
    monkeypatch.setattr(cpu, "SCAN_AUTO_MIN_FACTOR", 1)
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", work)
    assert "implicit_attn_wkv_scan" in lowered(w, u, k, v)
    exported = jax.export.export(jax.jit(run), platforms=["cuda"])(w, u, k, v).mlir_module()
    assert "implicit_attn_wkv_scan" not in exported
    k = k.at[0, 7, 2].set(jnp.nan)  # a NaN key of channel 2 at t = 7: that channel NaN from t = 7 on
    fast = np.asarray(jax.jit(lambda *a: run(*a))(w, u, k, v))
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", work + 1)
    assert "implicit_attn_wkv_scan" not in lowered(w, u, k, v)
    slow = np.asarray(jax.jit(lambda *a: run(*a))(w, u, k, v))
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(slow))
    assert np.isnan(fast[0, 7:, 2]).all() and not np.isnan(fast[0, :7]).any() and not np.isnan(fast[0, :, 3]).any()
    assert rel(np.nan_to_num(fast), np.nan_to_num(slow)) <= 1e-6
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 0)


def test_fill_writes_every_element_on_every_thread_count(monkeypatch):
    """``kernels.cpu.fill`` (the benchmarks' write bound): every element of shapes that end inside a
    thread's 64 Ki-float part, span several parts or are empty, eager and under jit, with one and
    two threads, with and without huge pages; a negative dimension is named."""
    for threads, huge in (("1", "0"), ("2", "1")):
        monkeypatch.setenv("IMPLICIT_ATTN_CPU_THREADS", threads)
        monkeypatch.setenv("IMPLICIT_ATTN_HUGE_PAGES", huge)
        for shape, value in (((3, 5), -2.5), ((2, 3, 70001), 1.25), ((4, 0, 3), 7.0), ((), 3.0)):
            out = cpu.fill(shape, value)
            assert out.shape == shape and out.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(out), np.full(shape, value, np.float32))
        jitted = jax.jit(lambda: cpu.fill((3, 65537), 0.5))()
        np.testing.assert_array_equal(np.asarray(jitted), np.full((3, 65537), 0.5, np.float32))
    with pytest.raises(ValueError, match="negative dimension"):
        cpu.fill((2, -1))


def residual_tower(x, ws, boundary):
    """``x + tanh(layer_norm(x) @ w)`` for each ``w``, ``boundary`` applied after each layer."""
    for w in ws:
        mu = x.mean(-1, keepdims=True)
        x = boundary(x + jnp.tanh((x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) @ w))
    return x


def widest_fusion(compiled_text: str) -> int:
    """The most operands of any fusion in an optimized HLO module's text."""
    return max(len(re.sub(r"/\*index=\d+\*/", "", m.group(1)).split(","))
               for m in re.finditer(r" fusion\((.*?)\), kind=", compiled_text))


def test_cotangent_computed_once_keeps_values_and_bounds_the_backward_fusions(monkeypatch):
    """``kernels.cpu.cotangent_computed_once`` (``nn.hooks.between_layers``): values and forward-mode
    derivatives the identity's; reverse mode the same gradients, with one library copy of the
    cotangent per layer boundary, so the widest backward fusion no longer grows with depth (without
    it XLA formed each boundary's cotangent inside every consumer from the last layer down: 66
    operands at 8 layers of this tower against 10 with it, on jax 0.10.2); bfloat16, arrays below
    the kernels' size threshold, the switch off and an export for CUDA pass the cotangent through
    untouched."""
    g = np.random.default_rng(0)
    x = jnp.asarray(g.standard_normal((1, 64, 32)), jnp.float32)
    ws = [jnp.asarray(g.standard_normal((32, 32)) * 0.2, jnp.float32) for _ in range(8)]
    np.testing.assert_array_equal(np.asarray(jax.jit(between_layers)(x)), np.asarray(x))
    _, tangent = jax.jvp(cpu.cotangent_computed_once, (x,), (2 * x,))
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(2 * x))
    loss = lambda boundary, n: lambda x, ws: residual_tower(x, ws[:n], boundary)[:, -1].sum()
    grad = lambda boundary, n: jax.jit(jax.grad(loss(boundary, n), argnums=(0, 1)))
    plain, once = grad(lambda h: h, 8)(x, ws), grad(between_layers, 8)(x, ws)
    for a, b in zip(jax.tree_util.tree_leaves(once), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    texts = {n: grad(between_layers, n).lower(x, ws).compile().as_text() for n in (4, 8)}
    assert texts[8].count("implicit_attn_copy") >= 8
    assert widest_fusion(texts[8]) == widest_fusion(texts[4])
    stacked = jax.vmap(grad(between_layers, 8), in_axes=(0, None))(jnp.stack([x, 2 * x]), ws)
    np.testing.assert_allclose(np.asarray(stacked[0][1]), np.asarray(grad(between_layers, 8)(2 * x, ws)[0]),
                               rtol=1e-5, atol=1e-6)
    half = lambda x: jax.grad(lambda t: (cpu.cotangent_computed_once(t) ** 2).sum())(x)
    assert "implicit_attn_copy" not in jax.jit(half).lower(x.astype(jnp.bfloat16)).as_text()
    exported = jax.export.export(grad(between_layers, 8), platforms=["cuda"])(x, ws)
    assert "implicit_attn_copy" not in exported.mlir_module()
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", x.size + 1)  # small: no library build for it
    assert "implicit_attn_copy" not in grad(between_layers, 8).lower(x, ws).as_text()
    monkeypatch.undo()
    monkeypatch.setenv(cpu.KERNEL_REVERSE_ENV, "0")
    assert "implicit_attn_copy" not in grad(between_layers, 8).lower(x, ws).as_text()


def test_computed_once_is_the_identity_and_a_call_xla_keeps():
    """``kernels.cpu.computed_once``: the same values; derivatives the identity's in both modes;
    vmap; on the CPU the optimized program still holds the library's copy (XLA dropped
    ``optimization_barrier``, which is why it exists); bfloat16, and an export for CUDA, pass ``x``
    through without it."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu.computed_once)(x)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(jax.vmap(cpu.computed_once)(x)), np.asarray(x))
    table = lambda t: cpu.computed_once(jnp.cos(t[0]))[None] * t  # one table, read by every row
    assert "implicit_attn_copy" in jax.jit(table).lower(x).compile().as_text()
    g = jax.grad(lambda t: (cpu.computed_once(jnp.sin(t)) ** 2).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(2 * jnp.sin(x) * jnp.cos(x)), rtol=1e-6)
    _, tangent = jax.jvp(cpu.computed_once, (x,), (2 * x,))
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(2 * x))
    half = x.astype(jnp.bfloat16)
    assert "implicit_attn_copy" not in jax.jit(cpu.computed_once).lower(half).as_text()
    exported = jax.export.export(jax.jit(table), platforms=["cuda"])(jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert "implicit_attn_copy" not in exported.mlir_module()
