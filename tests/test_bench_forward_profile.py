"""The forward profile's parts (``benchmarks.forward_profile``): each operation's kind and FLOPs
read from compiled HLO text (against counts written out by hand), a traced program's products,
and a mixture-of-experts model's profile (the grouped kernels' routed FLOPs from its config)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks.forward_profile import family_rows, hlo_operations, operation_kind, profile_compiled, shared_time

# Lines as XLA:CPU prints a compiled module: a fused product, a plain fusion, XLA's TopK (a tuple
# shape), the grouped expert kernel, a product left unfused, a sort.
HLO = """HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[8,6]{1,0})->f32[8,5]{1,0}}

%fused_computation.1 (param_0.1: f32[8,6], param_1.1: f32[10,6]) -> f32[8,10] {
  %param_0.1 = f32[8,6]{1,0} parameter(0)
  %param_1.1 = f32[10,6]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,10]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%fused_computation.2 (param_0.2: f32[8,10]) -> f32[8,10] {
  %param_0.2 = f32[8,10]{1,0} parameter(0)
  ROOT %tanh.1 = f32[8,10]{1,0} tanh(%param_0.2)
}

ENTRY %main.3 (x.1: f32[8,6], w.1: f32[10,6], v.1: f32[3,10,5], e.1: f32[4,7,6], i.1: s32[12]) -> f32[8,5] {
  %x.1 = f32[8,6]{1,0} parameter(0)
  %w.1 = f32[10,6]{1,0} parameter(1)
  %v.1 = f32[3,10,5]{2,1,0} parameter(2)
  %e.1 = f32[4,7,6]{2,1,0} parameter(3)
  %i.1 = s32[12]{0} parameter(4)
  %c.1 = s32[8,2]{1,0} broadcast(%i.1), dimensions={}
  %o.1 = s32[3]{0} broadcast(%i.1), dimensions={}
  %ynn_fusion.1 = f32[8,10]{1,0} fusion(%x.1, %w.1), kind=kCustom, calls=%fused_computation.1
  %tanh_fusion.1 = f32[8,10]{1,0} fusion(%ynn_fusion.1), kind=kLoop, calls=%fused_computation.2
  %custom-call.1 = (f32[8,2]{1,0}, s32[8,2]{1,0}) custom-call(%tanh_fusion.1), custom_call_target="TopK"
  %ffi.1 = f32[3,7,32]{2,1,0} custom-call(%x.1,%c.1,%o.1,%e.1), custom_call_target="implicit_attn_grouped_from_tokens"
  %dot.2 = f32[3,8,5]{2,1,0} dot(%tanh_fusion.1, %v.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %sort.1 = s32[12]{0} sort(%i.1), dimensions={0}, is_stable=true, to_apply=%region_0.1
  ROOT %bitcast.1 = f32[8,5]{1,0} bitcast(%dot.2)
}
"""


def test_operations_by_kind_and_their_flops_are_counted_by_hand():
    comps, entry = hlo_operations(HLO)
    assert entry == "main.3"
    assert set(comps) == {"fused_computation.1", "fused_computation.2", "main.3"}
    want = {
        "ynn_fusion.1": ("products (XLA)", 2 * 8 * 10 * 6),  # (8, 6) x (10, 6)^T
        "tanh_fusion.1": ("fusion", 0),
        "custom-call.1": ("custom call TopK", 0),
        "ffi.1": ("kernel grouped_from_tokens", 2 * 8 * 2 * 7 * 6),  # T = 8 tokens, k = 2, R = 7, K = 6
        "dot.2": ("products (XLA)", 2 * (3 * 8 * 5) * 10),  # contracted over the 10 of (8, 10)
        "sort.1": ("sort", 0),
    }
    assert {n: operation_kind(comps, n, entry) for n in want} == want


def test_hlo_text_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_operations(HLO.replace("ENTRY ", ""))


def test_overlapping_operations_share_their_stretch_of_time():
    """Split by hand: a runs alone for 2, beside b for 2 (1 each), b alone for 2; an empty interval
    takes nothing (and leaves no operation running after it); the shares add up to the 6 any ran."""
    got = shared_time([(0.0, 4.0, "a"), (2.0, 6.0, "b"), (6.0, 6.0, "c"), (7.0, 8.0, "a")])
    assert got == {"a": 4.0, "b": 3.0}


def test_a_traced_program_sums_its_products_and_their_time():
    """A compiled function with two products (XLA fuses them): the profile's products carry
    exactly their FLOPs, and the kinds' times add up to the traced call."""
    def f(x, w1, w2):
        return jax.nn.softmax(jnp.tanh(x @ w1.T) @ w2, axis=-1)

    args = (jnp.ones((64, 32)), jnp.ones((48, 32)), jnp.ones((48, 16)))
    p = profile_compiled(jax.jit(f).lower(*args).compile(), args, calls=2)
    products = p["kinds"]["products (XLA)"]
    assert products["gflop"] * 1e9 == pytest.approx(2 * 64 * 32 * 48 + 2 * 64 * 48 * 16, rel=1e-12)
    assert products["ms"] > 0 and p["forward_s"] > 0
    assert p["traced_s"] == pytest.approx(sum(k["ms"] for k in p["kinds"].values()) / 1e3)
    assert p["overlap"] >= 1 - 1e-9
    with pytest.raises(ValueError, match="calls must be at least 1"):
        profile_compiled(jax.jit(f).lower(*args).compile(), args, calls=0)


def test_a_mixture_of_experts_forward_profile_counts_the_routed_expert_work():
    """Qwen3.5-MoE's quick benchmark model: the grouped kernels' FLOPs are the routed copies'
    (L = 128 tokens, k experts each) through the experts' gate-up and down products, in every
    layer (each has experts)."""
    from benchmarks.forward import bench_shape

    cfg = bench_shape("qwen3_5_moe_text", quick=True)
    rows = {r["kind"]: r for r in family_rows("qwen3_5_moe_text", quick=True, calls=2)}
    copies = cfg["num_hidden_layers"] * 128 * cfg["num_experts_per_tok"]
    d, m = cfg["hidden_size"], cfg["moe_intermediate_size"]
    assert rows["kernel grouped_from_tokens"]["gflop"] * 1e9 == pytest.approx(2 * copies * d * 2 * m, rel=1e-12)
    assert rows["kernel grouped_to_tokens"]["gflop"] * 1e9 == pytest.approx(2 * copies * m * d, rel=1e-12)
    for kernel in ("grouped_from_tokens", "grouped_to_tokens"):  # one call per layer
        assert rows["kernel " + kernel]["ops"] == cfg["num_hidden_layers"]
    assert rows["products (XLA)"]["gflops"] > 0
    assert sum(r["share"] for k, r in rows.items() if k != "total") == pytest.approx(1.0)
    assert rows["total"]["forward_s"] > 0
