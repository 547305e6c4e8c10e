"""The Pallas kernels lower for GPU and TPU, checked from this CPU machine.

For every core type with a kernel (the test fails if one is added without a builder
here), both entry points (``materialize`` and the fused ``reduce``) are exported with
``jax.export`` for ``cuda`` (Triton) and ``tpu`` (Mosaic) at several shapes, and the
exported module must hold the compiled kernel calls (a Triton or ``tpu_custom_call``
per ``pallas_call``), not interpreted ops. The kernel is chosen by the lowering platform
(``jax.lax.platform_dependent``), so the same traced function gives the CPU interpreter
here and the compiled kernel in the export.

Lowering is what a CPU machine can check; that the Triton kernels also compile and match
XLA was measured on an H100 (README), and Mosaic's own compile runs only on a TPU.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from implicit_attn.kernels import pallas
from implicit_attn.kernels.pallas.plans import PLANS
from kernel_cores import BUILDERS

# Exporting a Triton call is allowed only with this check off (Triton IR has no
# serialization guarantee across versions).
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
# Per pallas_call: the tile kernels come twice, plain and NaN-safe under one lax.cond
# (kernels.pallas.calls.nan_safe_call), except RWKV-4's, attention's (LaS's too) and the short conv's,
# whose tiles have no matmul to spread a NaN; all but the last run a row-statistics kernel first.
CALLS = {"rwkv": 2, "attention": 2, "las": 2, "short_conv": 1}
# ParallelCores run each part through its kernel: the module holds a part's calls in one function,
# called once per part (Zamba's two Mamba-1 heads share it, as ViM's two directions do); Falcon-H1:
# Mamba-2's 2, attention's 2.
CALLS.update(falcon_h1=4)
PARTS_WITH_KERNELS = {"zamba": 2, "falcon_h1": 2, "vim": 2}
# The head-matrix kernels (delta rule, DPLR) are the chunk recurrence giving every head's (Lp, Lp)
# matrix; their O(L C) chunk factors (exps of in-chunk decays) are XLA, so exps outside the call
# are expected.
HEAD_MATRIX_KERNELS = {"delta", "kda", "dplr", "dplr_before"}
# (B, L): batch 2 with a single position, and with a ragged last tile (37 is no multiple
# of 32 or 128).
SHAPES = [(2, 1), (2, 37)]
# conftest.xdist_group: `ops` builds every core once; the tests named after a family stay with the file
ONE_WORKER = True


@pytest.fixture(scope="module")
def ops():
    return {(name, B, L): build(L_=L, B=B) for name, build in BUILDERS.items() for B, L in SHAPES}


def test_every_kernel_core_type_has_a_builder():
    built = set()
    for name, build in BUILDERS.items():
        core = build(L_=3, B=1).core
        built.add(type(core))
        for inner in (getattr(core, "inner", None), *getattr(core, "parts", ())):
            built.add(type(inner))
    assert set(PLANS) | set(pallas.BACKEND.cores) <= built, (set(PLANS) | set(pallas.BACKEND.cores)) - built


def kernel_calls(text: str, platform: str) -> int:
    """Number of compiled kernel calls in an exported StableHLO module."""
    return len(re.findall(re.escape(KERNEL_CALL[platform]), text))


def calls_of_kernel_functions(text: str, platform: str) -> int:
    """How often the module calls the functions that hold its compiled kernel calls."""
    holders, current = set(), None
    for line in text.splitlines():
        m = re.match(r"\s*func\.func (?:private |public )?@(\w+)", line)
        current = m[1] if m else current
        if KERNEL_CALL[platform] in line:
            holders.add(current)
    return sum(len(re.findall(rf"call @{h}\(", text)) for h in holders)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("what", ["materialize", "reduce"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_kernel_exports_as_a_compiled_call(ops, name, what, platform):
    for B, L in SHAPES:
        op = ops[(name, B, L)]
        if what == "materialize":
            f = lambda o: o.materialize(impl="pallas")
            shape = (B, op.shape[1], L, L)
        else:
            w = jax.random.normal(jax.random.PRNGKey(0), (B, op.shape[1], L))
            f = lambda o: o.reduce("weighted", weights=w, key_weights=w + 1, impl="pallas")
            shape = (B, L, L)
        exp = export.export(jax.jit(f), platforms=[platform], disabled_checks=[TRITON])(op)
        text = exp.mlir_module()
        assert exp.platforms == (platform,)
        assert exp.out_avals[0].shape == shape
        assert kernel_calls(text, platform) == CALLS.get(name, 1 if name in HEAD_MATRIX_KERNELS else 2), (name, B, L)
        if name in PARTS_WITH_KERNELS:
            assert calls_of_kernel_functions(text, platform) == PARTS_WITH_KERNELS[name], (name, B, L)
        if name in HEAD_MATRIX_KERNELS:  # the call itself returns the (B, H, Lp, Lp) matrices
            calls = [line for line in text.splitlines() if KERNEL_CALL[platform] in line]
            out = re.search(rf"-> tensor<{B}x{op.core.num_heads}x(\d+)x(\d+)xf32>", calls[0])
            assert out and out[1] == out[2] and int(out[1]) >= L, calls[0][-200:]
        else:  # no interpreted tile math left in the HLO: every exp is inside the kernel calls
            assert "stablehlo.exponential" not in text
        other = "tpu" if platform == "cuda" else "cuda"
        assert kernel_calls(text, other) == 0


CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu", reason="runs the interpreter on this CPU machine")


@CPU_ONLY
def test_interpret_flag_is_per_lowering_platform(ops):
    """Traced once, the same function runs the interpreter on CPU (and equals XLA) while
    its cuda export holds the Triton kernel."""
    op = ops[("mamba2", 2, 37)]
    f = jax.jit(lambda o: o.materialize([0, 3], impl="pallas"))
    out = f(op)
    ref = op.materialize([0, 3], impl="xla")
    assert float(jnp.max(jnp.abs(out - ref))) <= 1e-5 * float(jnp.max(jnp.abs(ref)))
    text = export.export(f, platforms=["cuda"], disabled_checks=[TRITON])(op).mlir_module()
    assert kernel_calls(text, "cuda") == 2  # plain and NaN-safe tiles
    cpu_text = f.lower(op).as_text()
    assert kernel_calls(cpu_text, "cuda") == 0 and kernel_calls(cpu_text, "tpu") == 0
    assert "stablehlo.exponential" in cpu_text  # the interpreter's tile math


@pytest.mark.parametrize("what", ["materialize", "reduce"])
def test_vmapped_kernels_keep_one_branch_for_the_batch(ops, what):
    """Under ``jax.vmap`` the choice between the plain and the NaN-safe tiles stays a branch:
    one predicate for the whole batch (``ops.any_in_batch``), where a batched predicate made
    ``lax.cond`` a select that ran both kernels. The cuda export of the mapped call has as many
    branch ops as the unmapped one; on this CPU the interpreter's mapped numbers equal XLA's,
    with a NaN in the keys of one example only (that example takes the NaN-safe tiles' NaNs,
    the other keeps its numbers)."""
    op = ops[("mamba2", 2, 37)]
    if what == "materialize":
        f = lambda o: o.materialize(impl="pallas")
        ref_f = lambda o: o.materialize(impl="xla")
    else:
        f = lambda o: o.reduce("weighted", weights=o.values, key_weights=o.values, impl="pallas")
        ref_f = lambda o: o.reduce("weighted", weights=o.values, key_weights=o.values, impl="xla")
    two = jax.tree.map(lambda a: jnp.stack([a, a]), op)
    single = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[TRITON])(op).mlir_module()
    mapped = export.export(jax.jit(jax.vmap(f)), platforms=["cuda"], disabled_checks=[TRITON])(two).mlir_module()
    assert kernel_calls(mapped, "cuda") == 2
    assert mapped.count("stablehlo.case") == single.count("stablehlo.case") > 0
    if jax.default_backend() == "cpu":
        core = dataclasses.replace(two.core, k=two.core.k.at[1, 0, 1, 5].set(jnp.nan))  # example 1, key 5
        bad = dataclasses.replace(two, core=core)
        out, ref = np.asarray(jax.jit(jax.vmap(f))(bad)), np.asarray(jax.vmap(ref_f)(bad))
        assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.isnan(out[1]).any() and not np.isnan(out[0]).any()
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(np.nanmax(np.abs(ref))))


def test_interpreted_export_is_told_apart(ops):
    """The check above can fail: an interpret-mode export has the tile math as HLO and
    no kernel call."""
    op = ops[("mamba", 2, 37)]
    f = jax.jit(lambda c: pallas.pallas_dense(c, np.arange(2), interpret=True))
    text = export.export(f, platforms=["cuda"])(op.core).mlir_module()
    assert kernel_calls(text, "cuda") == 0 and "stablehlo.exponential" in text


@CPU_ONLY
def test_compiled_kernel_on_cpu_fails_loudly(ops):
    op = ops[("griffin", 2, 37)]
    with pytest.raises(Exception, match="interpret"):
        jax.block_until_ready(pallas.pallas_dense(op.core, np.arange(2), interpret=False))
