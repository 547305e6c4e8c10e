"""OLMo-Hybrid beyond the conformance suite: OLMo-Hybrid-7B's layout scaled down (NoPE, write
strengths in [0, 2]), write strengths pushed to 0 and 2 (at 2 the transition ``I - 2 k kᵀ`` is a
reflection), HF's other checkpoint forms (its module names, one joined conv) and bad ones."""
from __future__ import annotations

import numpy as np
import pytest

from implicit_attn.families import olmo_hybrid
from implicit_attn.nn import CheckpointError
from conftest import torch_or_skip

# OLMo-Hybrid-7B: 32 layers, attention at every fourth, no RoPE (rope_theta null), 30 heads,
# DeltaNet key width 0.75 d / heads and value width twice that; here 8 layers at width 64
OLMO_HYBRID_7B = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                      pad_token_id=None, eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": None})


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    cfg = olmo_hybrid.Config.from_hf(OLMO_HYBRID_7B)
    assert cfg.rotary_dim == 0 and cfg.linear_key_head_dim == 12 and cfg.linear_value_head_dim == 24
    assert cfg.layer_types == ("delta", "delta", "delta", "attention") * 2
    ids = np.random.default_rng(1).integers(0, 64, (2, 17))
    report = assert_hf_parity("olmo_hybrid", OLMO_HYBRID_7B, ids)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 8
    assert max(report["exactness"]["full"]) <= 1e-5


def test_write_strengths_near_zero_and_two_match_torch_and_float64():
    """``b_proj`` scaled by 300 so that ``2 sigmoid(b)`` sits within 1e-3 of 0 or of 2 at most
    (head, token) pairs: the model still matches torch and the operator the float64 recurrence."""
    torch, _ = torch_or_skip()
    from implicit_attn.testing import assert_hf_parity, build_hf_model, load_jax_from_hf

    tm = build_hf_model("olmo_hybrid", None)
    with torch.no_grad():
        for i in (0, 2):
            tm.model.layers[i].linear_attn.b_proj.weight.mul_(300.0)
    ids = np.random.default_rng(5).integers(0, 64, (2, 20))
    model = load_jax_from_hf(tm)
    report = assert_hf_parity(tm, None, ids, jax_model=model)
    assert report["logits"] <= 1e-4 and max(report["exactness"]["full"]) <= 1e-5
    xs = model.mixer_inputs(ids)
    mixer = model.layers[0].mixer
    b = np.asarray(xs[0]) @ np.asarray(mixer.arrays()["b_proj.weight"]).T
    beta = 1.0 + np.tanh(b / 2)  # 2 sigmoid(b)
    assert (beta > 2 - 1e-3).mean() > 0.25 and (beta < 1e-3).mean() > 0.25
    H = np.asarray(mixer.as_operator(xs[0]).materialize())
    ref = olmo_hybrid.naive_operator(mixer.arrays(), np.asarray(xs[0]), model.config, 0)
    assert np.abs(H - ref).max() <= 1e-5 * np.abs(ref).max()


def test_hf_module_names_and_a_joined_conv_load_the_same(tmp_path):
    """HF reads the norms under its module names and one ``conv1d.weight``; so do we, into the
    same parameters. Convs that do not add up to q, k and v are a named error."""
    cfg = olmo_hybrid.Config.from_hf(olmo_hybrid.SPEC.tiny)
    model = olmo_hybrid.LM(cfg, olmo_hybrid.init_params(cfg, 0))
    config, tensors = olmo_hybrid.from_params(cfg, model.params())
    assert tensors["model.layers.0.linear_attn.q_conv1d.weight"].shape == (8, 1, 4)  # q, k, v as stored
    p = "model.layers.0."
    other = dict(tensors)
    other[p + "input_layernorm.weight"] = other.pop(p + "attention_layer_norm.weight")
    other[p + "post_attention_layernorm.weight"] = other.pop(p + "feedforward_layer_norm.weight")
    other["model.layers.1.post_attention_layernorm.weight"] = other.pop("model.layers.1.feedforward_layer_norm.weight")
    convs = [other.pop(p + f"linear_attn.{n}_conv1d.weight") for n in "qkv"]
    other[p + "linear_attn.conv1d.weight"] = np.concatenate(convs)
    _, back = olmo_hybrid.to_params(config, other)
    _, again = olmo_hybrid.from_params(cfg, back)
    assert set(again) == set(tensors)
    for k in tensors:
        np.testing.assert_array_equal(again[k], tensors[k])
    bad = dict(tensors)
    bad[p + "linear_attn.v_conv1d.weight"] = bad[p + "linear_attn.v_conv1d.weight"][:-1]
    with pytest.raises(CheckpointError, match=r"layer 0's conv tensor .* has shape \(39, 1, 4\), expected \(40, 1, 4\)"):
        olmo_hybrid.to_params(config, bad)


def test_config_forms():
    """HF's defaults for the DeltaNet sizes and layer kinds; NoPE from a null ``rope_theta``;
    ``to_hf`` keeps the token ids (HF's defaults are past a small vocabulary) and reads back equal."""
    cfg = olmo_hybrid.Config.from_hf(dict(vocab_size=64, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                          pad_token_id=None, eos_token_id=[1, 2]))
    assert cfg.layer_types == ("delta", "delta", "attention") and cfg.linear_num_value_heads == 4
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.rotary_dim, cfg.beta_scale) == (9, 18, 12, 2.0)
    d = cfg.to_hf()
    assert d["pad_token_id"] is None and d["eos_token_id"] == [1, 2] and olmo_hybrid.Config.from_hf(d) == cfg
    assert olmo_hybrid.Config.from_hf({**d, "rope_theta": None}).rotary_dim == 0
    for bad, match in ((dict(layer_types=["linear_attention"] * 3), "at least one"),
                       (dict(pad_token_id=64), "pad_token_id"), (dict(linear_num_value_heads=3), "linear_num_value_heads")):
        with pytest.raises(ValueError, match=match):
            olmo_hybrid.Config.from_hf({**d, **bad})
