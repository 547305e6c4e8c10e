"""impl="auto" never crashes because of a kernel: on an accelerator it picks a compiled
kernel only where one is verified for the platform, and a kernel that fails under auto
warns once and falls back to XLA. Simulated on CPU by switching the Pallas backend on."""
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit_attn.families import mamba
from implicit_attn.kernels import cpu, pallas
from implicit_attn.operator import ParallelCore, dispatch, resolve_impl
from traced import assert_full_float32_products
from kernel_cores import (NoKernelCore, delta_op, dplr_op, falcon_h1_op, kda_op, las_op, local_attention_op, mlstm_op,
                          rwkv_op, scalar_lowrank_op, short_conv_op)


@pytest.fixture(scope="module")
def op():
    cfg = mamba.Config(vocab_size=8, hidden_size=4, state_size=4, num_hidden_layers=1, conv_kernel=4)
    model = mamba.LM(cfg, mamba.init_params(cfg, 0))
    return model.operators(np.arange(6)[None] % 8)[0]


@pytest.fixture
def on_accelerator(monkeypatch):
    """Pallas active as on a GPU, the CPU kernel inactive; failures forgotten afterwards."""
    monkeypatch.setattr(pallas.BACKEND, "auto", lambda: True)
    monkeypatch.setattr(cpu.BACKEND, "auto", lambda: False)
    dispatch.clear_failed_kernels()
    yield
    dispatch.clear_failed_kernels()


def test_auto_uses_no_unverified_kernel(op, on_accelerator):
    assert not pallas.trusted(op.core)  # Mamba-1's kernel is slower than XLA on an H100
    assert resolve_impl("auto", op.core) == "xla"


@pytest.mark.parametrize("platform, want", [("cuda", "pallas"), ("tpu", "xla"), ("rocm", "xla")])
def test_auto_uses_kernels_verified_for_the_platform(op, on_accelerator, monkeypatch, platform, want):
    monkeypatch.setattr(pallas, "default_platform", lambda: platform)
    assert resolve_impl("auto", scalar_lowrank_op().core) == want
    assert resolve_impl("auto", rwkv_op(L_=4, B=1).core) == want
    assert resolve_impl("auto", op.core) == "xla"


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_parallel_core_is_trusted_where_its_kernel_parts_are(op, on_accelerator, monkeypatch, platform):
    """``auto`` takes a ``ParallelCore``'s kernels where every part that has one is verified:
    Falcon-H1's Mamba-2 and attention parts are not (XLA there); the verified RG-LRU-like core
    beside a core no backend has a kernel for (XLA either way) is on cuda."""
    monkeypatch.setattr(pallas, "default_platform", lambda: platform)
    falcon = falcon_h1_op(L_=4, B=1).core
    assert pallas.has_kernel(falcon) and not pallas.trusted(falcon)
    assert resolve_impl("auto", falcon) == "xla"
    mixed = ParallelCore(parts=(scalar_lowrank_op(L_=4, B=1).core, NoKernelCore(scale=jnp.ones((2,)), L=4)),
                         repeats=(1, 1))
    assert pallas.trusted(mixed) == (platform == "cuda")
    assert resolve_impl("auto", mixed) == ("pallas" if platform == "cuda" else "xla")


@pytest.mark.parametrize("make", [delta_op, kda_op, dplr_op, mlstm_op, local_attention_op, short_conv_op, las_op],
                         ids=["delta", "kda", "dplr", "mlstm", "attention", "short_conv", "las"])
def test_unverified_kernels_take_the_cpu_kernel_on_cpu_and_xla_on_accelerators(make, monkeypatch):
    """The README's Limitations: the delta-rule, DPLR, mLSTM, attention, short-conv and LaS Pallas kernels are
    verified on no platform, so ``auto`` computes them with XLA on a GPU or TPU; on CPU it takes
    the fused CPU kernel (the suite's size threshold is 0)."""
    core = make(L_=6, B=1).core
    if jax.default_backend() == "cpu":
        monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 0)
        assert resolve_impl("auto", core) == "cpu"
    monkeypatch.setattr(pallas.BACKEND, "auto", lambda: True)
    monkeypatch.setattr(cpu.BACKEND, "auto", lambda: False)
    for platform in ("cuda", "tpu"):
        monkeypatch.setattr(pallas, "default_platform", lambda: platform)
        assert pallas.has_kernel(core) and not pallas.trusted(core)
        assert resolve_impl("auto", core) == "xla"


def test_a_failing_kernel_under_auto_warns_once_and_falls_back(op, on_accelerator, monkeypatch):
    want_H = np.asarray(op.materialize(impl="xla"))
    want_R = np.asarray(op.reduce("abs_mean", impl="xla"))

    def broken(*args, **kwargs):
        raise RuntimeError("simulated: the kernel does not compile for this GPU")

    monkeypatch.setattr(pallas.BACKEND, "trusted", lambda core: True)
    monkeypatch.setattr(pallas.BACKEND, "dense", broken)
    monkeypatch.setattr(pallas.BACKEND, "reduce", broken)
    assert resolve_impl("auto", op.core) == "pallas"
    with pytest.warns(UserWarning, match="simulated: the kernel does not compile"):
        H = op.materialize()
    np.testing.assert_array_equal(np.asarray(H), want_H)
    assert (("pallas", type(op.core)) in dispatch.failed_kernels())
    assert resolve_impl("auto", op.core) == "xla"  # not picked again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        np.testing.assert_array_equal(np.asarray(op.reduce("abs_mean")), want_R)
    with pytest.raises(RuntimeError, match="simulated"):  # an explicit request raises
        op.materialize(impl="pallas")


def test_a_failing_fused_reduce_under_auto_falls_back(op, on_accelerator, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated reduce failure")

    monkeypatch.setattr(pallas.BACKEND, "trusted", lambda core: True)
    monkeypatch.setattr(pallas.BACKEND, "reduce", broken)
    with pytest.warns(UserWarning, match="simulated reduce failure"):
        R = op.reduce("mean")
    np.testing.assert_allclose(np.asarray(R), np.asarray(op.reduce("mean", impl="xla")), rtol=1e-6)


def test_entry_points_trace_full_float32_products(op):
    """GPUs run default float32 matmuls in TF32 (on an H100: logits 7e-4 off torch, Mamba-2
    operators 1.7e-4 from their block); the library's entry points ask for HIGHEST."""
    from implicit_attn.families import mamba2

    cfg = mamba2.Config(vocab_size=8, hidden_size=8, num_heads=2, head_dim=4, state_size=4, chunk_size=4)
    p = mamba2.init_params(cfg, 0)
    ids = np.arange(6)[None] % 8
    for fn in (lambda: mamba2.block.lm_forward_jit(p, ids, cfg=cfg),
               lambda: mamba2.block.mixer_operator_jit(p["layers"][0]["mixer"], np.ones((1, 6, 8), np.float32),
                                                      cfg=cfg, variant="full").materialize(impl="xla"),
               lambda: op.reduce("abs_mean", impl="xla")):
        assert_full_float32_products(fn)  # each traces products


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="impl=\"auto\" picks the CPU kernels on CPU only")
def test_auto_skips_the_cpu_kernels_below_their_size_and_never_builds_for_a_small_operator(op, monkeypatch):
    """On CPU, ``impl="auto"`` takes the fused kernels only from ``AUTO_MIN_FACTOR_ELEMENTS``
    factor elements up: a small operator resolves to XLA without asking whether the library
    is built (``ready`` would compile it, seconds on a first run); at the threshold the
    kernel is picked again, and an explicit ``impl="cpu"`` ignores the size."""
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", 1 << 16)
    asked = []
    monkeypatch.setattr(cpu.BACKEND, "ready", lambda: asked.append(1) or True)
    size = sum(int(x.size) for x in jax.tree.leaves(op.core))
    assert 0 < size < 1 << 16 and not cpu.pays_off(op.core)
    assert resolve_impl("auto", op.core) == "xla" and not asked
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", size)
    assert cpu.pays_off(op.core)
    assert resolve_impl("auto", op.core) == "cpu" and asked
    monkeypatch.setattr(cpu, "AUTO_MIN_FACTOR_ELEMENTS", size + 1)
    assert resolve_impl("cpu", op.core) == "cpu"
    np.testing.assert_allclose(np.asarray(op.materialize(impl="auto")), np.asarray(op.materialize(impl="cpu")),
                               rtol=1e-5, atol=1e-6)


def test_a_bad_auto_threshold_is_named(monkeypatch):
    """``$IMPLICIT_ATTN_CPU_AUTO_MIN`` that is not a non-negative integer stops the import with
    an error naming the variable (never silently replaced by the default)."""
    for bad in ("abc", "-1", "1e5", "1.5"):
        monkeypatch.setenv("IMPLICIT_ATTN_CPU_AUTO_MIN", bad)
        with pytest.raises(ValueError, match=re.escape(f"IMPLICIT_ATTN_CPU_AUTO_MIN='{bad}' is not a non-negative")):
            cpu.auto_min_from_env()
    for good, want in (("", 1 << 16), (" 7 ", 7), ("0", 0)):
        monkeypatch.setenv("IMPLICIT_ATTN_CPU_AUTO_MIN", good)
        assert cpu.auto_min_from_env() == want
    # the import reads it: one bad value stops the import
    env = dict(os.environ, IMPLICIT_ATTN_CPU_AUTO_MIN="abc")
    p = subprocess.run([sys.executable, "-c", "import implicit_attn"], env=env, capture_output=True, text=True)
    assert p.returncode != 0 and "IMPLICIT_ATTN_CPU_AUTO_MIN='abc' is not a non-negative integer" in p.stderr
