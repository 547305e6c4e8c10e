"""GraniteMoeHybrid beyond the conformance suite: the layout of the released
Granite-4.0-H-Small (Mamba-2 layers with one attention layer in ten, GQA 4:1, NoPE, a MoE of
small experts beside a shared MLP, the muP multipliers, tied embeddings, legacy layer-type
names in config.json) scaled down; a dense model (no experts) with RoPE; the attention
operator is the softmax attention HF computes with Granite's logit scale; and the MoE
matches a dense float64 sum over the experts."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import granite
from implicit_attn.nn.moe import experts_forward, gated_act, topk_then_softmax
from conftest import torch_or_skip

# granite-4.0-h-small: hidden 4096, 40 layers (attention at 4 of them), 32 heads / 8 KV,
# 72 experts of width 768 (10 per token), shared MLP 1536, Mamba-2 d_state 128, expand 2,
# tied, "nope". Scaled: hidden 64, expert 12, shared 24, 8 experts (2 per token).
RELEASED_RATIOS = dict(vocab_size=64, hidden_size=64, intermediate_size=12, shared_intermediate_size=24,
                       num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"],
                       num_attention_heads=4, num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2,
                       mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                       mamba_chunk_size=8, position_embedding_type="nope", embedding_multiplier=12.0,
                       residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
                       tie_word_embeddings=True)


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(1).integers(0, 64, (2, 19))
    report = assert_hf_parity("granitemoehybrid", RELEASED_RATIOS, ids)
    assert report["logits"] <= 1e-4
    assert max(report["exactness"]["full"]) <= 1e-5 and max(report["exactness"]["no_conv"]) <= 1e-5


def test_dense_model_with_rope_matches_torch():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    cfg = {**granite.SPEC.tiny, "num_local_experts": 0, "position_embedding_type": "rope",
           "layer_types": ["attention", "mamba"], "num_hidden_layers": 2, "tie_word_embeddings": False}
    report = assert_hf_parity("granitemoehybrid", cfg, np.random.default_rng(2).integers(0, 64, (1, 13)))
    assert report["logits"] <= 1e-4


def test_legacy_layer_names_and_alias_load(tmp_path):
    """Released config.json files say "mamba"/"attention" (HF remaps them), some use the
    ``layers_block_type`` alias; both load to the same layer kinds."""
    cfg = granite.Config.from_hf(granite.SPEC.tiny)
    ia.save(granite.LM(cfg, granite.init_params(cfg, 0)), tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["layer_types"] == ["linear_attention", "full_attention", "linear_attention"]
    d["layer_types"] = ["mamba", "attention", "mamba"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ia.load(tmp_path).config.layer_types == ("mamba", "attention", "mamba")
    d["layers_block_type"] = d.pop("layer_types")
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ia.load(tmp_path).config.layer_types == ("mamba", "attention", "mamba")


@pytest.mark.parametrize("bad, msg", [
    (dict(layer_types=["mamba", "moe", "mamba"]), "layer_types"),
    (dict(layer_types=["mamba", "attention"]), "layer_types has 2 entries"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(position_embedding_type="alibi"), "position_embedding_type"),
    (dict(logits_scaling=0.0), "logits_scaling"),
    (dict(num_local_experts=-1), "num_local_experts"),
])
def test_bad_config_values_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        granite.Config.from_hf({**granite.SPEC.tiny, **bad})


def test_attention_layer_operator_is_the_softmax_attention(tmp_path):
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model

    tm = build_hf_model("granitemoehybrid", None, path=tmp_path)
    model = ia.load(tmp_path)
    assert isinstance(model, granite.LM) and model.config.rotary_dim == model.config.head_dim
    ids = np.random.default_rng(3).integers(0, 64, (1, 9))
    tm.set_attn_implementation("eager")  # the path that returns the probabilities
    with torch.no_grad():
        out = tm(torch.as_tensor(ids), output_attentions=True, use_cache=False)
    (want,) = [a.numpy() for a in out.attentions if a is not None]
    H = np.asarray(model.operators(ids, layers=[1])[0].materialize())
    np.testing.assert_allclose(H.sum(-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(H, want, atol=1e-6)


def test_grouped_experts_match_a_dense_float64_sum():
    """``nn.moe``: routing by top-k then softmax, experts grouped with ``ragged_dot``, equal
    to summing every chosen expert in float64; a NaN token stays in its own row."""
    g = np.random.default_rng(0)
    T, D, F, E, k = 13, 6, 5, 4, 2
    x = g.standard_normal((T, D)).astype(np.float32)
    w_in, w_out = g.standard_normal((E, 2 * F, D)), g.standard_normal((E, D, F))
    router = g.standard_normal((E, D))
    weights, experts = topk_then_softmax(x @ router.T.astype(np.float32), k)
    got = np.asarray(experts_forward(x, weights, experts, w_in.astype(np.float32), w_out.astype(np.float32),
                                     gated_act(jax.nn.silu)))
    logits = x.astype(np.float64) @ router.T
    want = np.zeros((T, D))
    for t in range(T):
        top = np.argsort(-logits[t])[:k]
        p = np.exp(logits[t, top] - logits[t, top].max())
        p /= p.sum()
        for e, w in zip(top, p):
            u = w_in[e] @ x[t]
            a = u[:F] / (1 + np.exp(-u[:F])) * u[F:]
            want[t] += w * (w_out[e] @ a)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    x[4, 0] = np.nan
    weights, experts = topk_then_softmax(x @ router.T.astype(np.float32), k)
    out = np.asarray(experts_forward(x, weights, experts, w_in.astype(np.float32), w_out.astype(np.float32),
                                     gated_act(jax.nn.silu)))
    bad = np.isnan(out).any(-1)
    assert bad[4] and not bad[np.arange(T) != 4].any()


@pytest.mark.parametrize("route", ["skewed", "one_expert", "uniform"])
def test_experts_any_routing_and_block_size(route):
    """``nn.moe.experts_forward`` on CPU pads each expert's group to whole blocks and loops only
    over the filled ones: equal to a float64 loop over the chosen experts for routings that
    leave experts empty, send every copy to one expert (groups many blocks long) or spread
    them, with blocks shorter and longer than the groups."""
    g = np.random.default_rng(1)
    T, D, F, E, k = 11, 5, 3, 4, 2
    x = g.standard_normal((T, D)).astype(np.float32)
    w_in, w_out = g.standard_normal((E, 2 * F, D)), g.standard_normal((E, D, F))
    experts = {"skewed": np.stack([np.zeros(T, int), g.integers(1, 3, T)], 1),
               "one_expert": np.full((T, k), 3), "uniform": g.integers(0, E, (T, k))}[route]
    weights = g.random((T, k)).astype(np.float32)
    want = np.zeros((T, D))
    for t in range(T):
        for e, w in zip(experts[t], weights[t]):
            u = w_in[e] @ x[t]
            want[t] += w * (w_out[e] @ (u[:F] / (1 + np.exp(-u[:F])) * u[F:]))
    for block in (1, 3, 64):
        got = experts_forward(x, weights, experts.astype(np.int32), w_in.astype(np.float32),
                              w_out.astype(np.float32), gated_act(jax.nn.silu), block=block)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
