"""Jamba beyond the conformance suite: the layout of the released Jamba-v0.1 / Jamba-1.5
(attention at layer 4 of every 8, experts on every odd layer, GQA 4:1, MLP 3.5x, dt rank
d/16, untied) scaled down to 8 layers; the per-expert checkpoint tensors round-trip through
the stacked params; the attention layers' operator is HF's softmax attention without
positional encoding; bad config values are named."""
from __future__ import annotations

import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import jamba
from conftest import torch_or_skip

RELEASED_RATIOS = dict(vocab_size=64, hidden_size=64, intermediate_size=224, num_hidden_layers=8,
                       attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1,
                       num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=1,
                       mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto",
                       tie_word_embeddings=False)


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(1).integers(0, 64, (2, 17))
    report = assert_hf_parity("jamba", RELEASED_RATIOS, ids)
    assert report["logits"] <= 1e-4
    assert max(report["exactness"]["full"]) <= 1e-5 and max(report["exactness"]["no_conv"]) <= 1e-5


def test_layer_pattern_and_expert_round_trip(tmp_path):
    cfg = jamba.Config.from_hf(jamba.SPEC.tiny)
    assert cfg.layer_types == ("mamba", "attention", "mamba", "attention")
    assert [cfg.is_moe(i) for i in range(4)] == [True, False, False, True]
    params = jamba.init_params(cfg, 0)
    assert params["layers"][0]["feed_forward"]["experts.gate_up_proj"].shape == (4, 64, 16)
    _, tensors = jamba.from_params(cfg, params)
    assert tensors["model.layers.3.feed_forward.experts.2.up_proj.weight"].shape == (32, 16)
    np.testing.assert_array_equal(tensors["model.layers.3.feed_forward.experts.2.up_proj.weight"],
                                  np.asarray(params["layers"][3]["feed_forward"]["experts.gate_up_proj"][2, 32:]))
    ia.save(jamba.LM(cfg, params), tmp_path)
    back = ia.load(tmp_path).params()
    for a, b in zip(params["layers"], back["layers"]):
        for k in a["feed_forward"]:
            np.testing.assert_array_equal(np.asarray(a["feed_forward"][k]), np.asarray(b["feed_forward"][k]))


def test_attention_layer_operator_is_the_softmax_attention(tmp_path):
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model

    tm = build_hf_model("jamba", None, path=tmp_path)
    model = ia.load(tmp_path)
    assert isinstance(model, jamba.LM) and model.config.rotary_dim == 0
    ids = np.random.default_rng(3).integers(0, 64, (1, 9))
    tm.set_attn_implementation("eager")  # the path that returns the probabilities
    with torch.no_grad():
        out = tm(torch.as_tensor(ids), output_attentions=True, use_cache=False)
    want = [a.numpy() for a in out.attentions if a is not None]
    assert len(want) == 2
    for layer, w in zip((1, 3), want):
        H = np.asarray(model.operators(ids, layers=[layer])[0].materialize())
        np.testing.assert_allclose(H.sum(-1), 1.0, atol=1e-6)
        np.testing.assert_allclose(H, w, atol=1e-6)


@pytest.mark.parametrize("bad, msg", [
    (dict(attn_layer_offset=2, attn_layer_period=2), "attn_layer_offset"),
    (dict(expert_layer_offset=3), "expert_layer_offset"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(mamba_dt_rank=0), "mamba_dt_rank"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_bad_config_values_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        jamba.Config.from_hf({**jamba.SPEC.tiny, **bad})
