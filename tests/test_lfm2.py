"""LFM2, LFM2-MoE and LFM3 beyond the conformance suite: the released layouts scaled down, the
SwiGLU width rule and the RoPE frequencies against HF's modules, the short conv's operator
(bias offset, both variants, the band), the sliding window, config forms, and the
vision-language checkpoints' language model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hf_build import build_hf
from implicit_attn.families import lfm2
from conftest import torch_or_skip

# LFM2-1.2B: 16 layers, attention at 2, 5, 8, 10, 12, 14; here at width 32 with its legacy keys
LFM2_1B = dict(vocab_size=64, hidden_size=32, block_ff_dim=96, block_multiple_of=32, num_hidden_layers=16,
               num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[2, 5, 8, 10, 12, 14],
               tie_embedding=True, conv_L_cache=3)


def test_released_lfm2_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    cfg = lfm2.Config.from_hf(LFM2_1B)
    assert cfg.intermediate_size == 96 and cfg.ff_size(0) == 64 and cfg.tie_word_embeddings
    assert [i for i, k in enumerate(cfg.layer_types) if k == "attention"] == [2, 5, 8, 10, 12, 14]
    kw = {k: v for k, v in cfg.to_hf().items() if k not in ("model_type", "architectures")}
    ids = np.random.default_rng(1).integers(0, 64, (2, 13))
    report = assert_hf_parity("lfm2", kw, ids)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 16
    assert max(report["exactness"]["full"]) <= 1e-5


@pytest.mark.parametrize("kw", [dict(intermediate_size=48, block_multiple_of=16),
                                dict(intermediate_size=100, block_multiple_of=8, block_ffn_dim_multiplier=1.3),
                                dict(intermediate_size=30, block_auto_adjust_ff_dim=False)])
def test_swiglu_width_is_hfs(kw):
    tm = build_hf("lfm2", **kw)
    cfg = lfm2.Config.from_hf({**lfm2.SPEC.tiny, **kw})
    assert cfg.ff_size(0) == tm.model.layers[0].feed_forward.w1.weight.shape[0]


@pytest.mark.parametrize("rope", [None, {"full_attention": {"rope_type": "proportional", "rope_theta": 500.0,
                                                            "partial_rotary_factor": 0.25, "factor": 2.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 77.0}},
                                  {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}],
                         ids=["defaults", "proportional_factor", "default_full"])
def test_lfm3_rope_frequencies_are_hfs(rope):
    kw = dict(head_dim=16) if rope is None else dict(head_dim=16, rope_parameters=rope)
    tm = build_hf("lfm3", **kw)
    cfg = lfm2.Lfm3Config.from_hf({k: v for k, v in {**lfm2.LFM3_SPEC.tiny, **kw}.items()})
    for kind, hf in (("attention", "full_attention"), ("sliding", "sliding_attention")):
        np.testing.assert_allclose(cfg.rope_frequencies(kind), getattr(tm.model.rotary_emb, f"{hf}_inv_freq").numpy(),
                                   rtol=2e-7)  # numpy's and torch's float32 powers may differ in the last bit
    assert lfm2.Lfm3Config.from_hf(cfg.to_hf()) == cfg


def test_conv_operator_bias_variants_and_band():
    """``diag(c) M diag(b)`` on ``x`` plus ``c * bias``, and ``diag(c) M`` on ``b * x``: both give the
    block's output; ``H`` is zero outside the ``K``-wide band (float64 reference: conformance)."""
    cfg = lfm2.Config.from_hf(dict(lfm2.SPEC.tiny, conv_L_cache=4))
    params = lfm2.SPEC.init_params(cfg, __import__("jax").random.PRNGKey(0))
    model = lfm2.LM(cfg, params)
    x = np.random.default_rng(2).standard_normal((2, 11, cfg.hidden_size)).astype(np.float32)
    mixer = model.layers[0].mixer
    full, gated = mixer.as_operator(x), mixer.as_operator(x, "gated_values")
    p = mixer.arrays()
    c = (x @ np.asarray(p["in_proj.weight"]).T + np.asarray(p["in_proj.bias"]))[..., 16:32].transpose(0, 2, 1)
    np.testing.assert_allclose(full.offset, c * np.asarray(p["conv.bias"])[None, :, None], rtol=1e-6, atol=1e-6)
    assert np.abs(full.offset).max() > 0.05
    for op in (full, gated):
        assert op.relative_error() < 1e-5
    H = np.asarray(full.materialize())
    i, j = np.arange(11)[:, None], np.arange(11)[None, :]
    assert np.all(H[..., (i - j >= 4) | (j > i)] == 0) and np.all(H[..., (i - j >= 0) & (i - j < 4)] != 0)
    np.testing.assert_allclose(gated.output, full.output)


def test_sliding_window_masks_far_keys_and_matches_torch():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    kw = dict(lfm2.LFM3_SPEC.tiny, sliding_window=2, num_hidden_layers=2, layer_types=["sliding_attention", "conv"])
    ids = np.random.default_rng(3).integers(0, 64, (1, 9))
    report = assert_hf_parity("lfm3", kw, ids)
    assert report["logits"] <= 1e-4
    cfg = lfm2.Lfm3Config.from_hf(kw)
    import jax
    model = lfm2.Lfm3LM(cfg, lfm2.LFM3_SPEC.init_params(cfg, jax.random.PRNGKey(1)))
    P = np.asarray(model.operators(ids, layers=[0])[0].materialize())
    i, j = np.arange(9)[:, None], np.arange(9)[None, :]
    assert np.all(P[..., i - j >= 2] == 0) and np.all(P[..., (i - j >= 0) & (i - j < 2)] > 0)


def test_config_forms():
    """Legacy keys, HF's defaults (LFM2: every layer attention without ``layer_types``; LFM3: its
    pattern), the sandwich norms in the checkpoint, and what is refused by name."""
    assert lfm2.Config.from_hf(dict(vocab_size=8, hidden_size=8, num_hidden_layers=3, num_attention_heads=2,
                                    num_key_value_heads=1)).layer_types == ("attention",) * 3
    cfg = lfm2.Lfm3Config.from_hf(dict(vocab_size=8, hidden_size=8, num_hidden_layers=9, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-3))
    assert cfg.layer_types == ("conv", "conv", "attention", "conv", "sliding", "conv", "attention", "conv", "sliding")
    assert cfg.norm_eps == 1e-3 and cfg.rope_type == "proportional" and cfg.partial_rotary_factor == 0.5
    req, _ = lfm2.LFM3_SPEC.expected_shapes(cfg)
    assert "model.layers.0.post_operator_norm.weight" in req and "model.layers.2.self_attn.gate_proj.weight" in req
    req, _ = lfm2.LFM3_SPEC.expected_shapes(lfm2.Lfm3Config.from_hf(dict(cfg.to_hf(), use_sandwich_norm=False,
                                                                         use_attention_gate=False)))
    assert not any("post_" in k or "gate_proj" in k for k in req)
    d = lfm2.SPEC.tiny
    for bad, match in ((dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_type"),
                       (dict(rope_parameters={"rope_theta": 1.0, "partial_rotary_factor": 0.5}),
                        "partial_rotary_factor"),
                       (dict(block_ffn_dim_multiplier=None), "block_ffn_dim_multiplier"),
                       (dict(full_attn_idxs=[0], layer_types=["conv"] * 3), "full_attn_idxs"),
                       (dict(layer_types=["conv", "sliding_attention", "conv"]), "layer_types")):
        with pytest.raises(ValueError, match=match):
            lfm2.Config.from_hf({**d, **bad})
    with pytest.raises(ValueError, match="layer_types"):
        lfm2.MoeConfig.from_hf({k: v for k, v in lfm2.MOE_SPEC.tiny.items() if k != "layer_types"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        lfm2.MoeConfig.from_hf(dict(lfm2.MOE_SPEC.tiny, num_experts_per_tok=5))
    for bad, match in ((dict(sliding_window=None), "sliding_window"),
                       (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}), "rope_type"),
                       (dict(rope_parameters={"rope_theta": 1.0}), "rope_parameters")):
        with pytest.raises(ValueError, match=match):
            lfm2.Lfm3Config.from_hf({**lfm2.LFM3_SPEC.tiny, **bad})


# a one-block vision tower of each vision-language generation (its numbers are never read)
SIGLIP2 = dict(model_type="siglip2_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_patches=16, patch_size=2)
LFM3_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2)
VL_CASES = {"lfm2": ("Lfm2Vl", SIGLIP2), "lfm2_moe": ("Lfm2Vl", SIGLIP2), "lfm3": ("Lfm3Vl", LFM3_VISION)}


@pytest.mark.parametrize("text_type", list(VL_CASES))
def test_vision_language_checkpoints_load_their_language_model(text_type, tmp_path):
    """``Lfm2VlForConditionalGeneration`` (on LFM2 and on LFM2-MoE) and
    ``Lfm3VlForConditionalGeneration`` saved by transformers: ``ia.load`` gives the text family's
    model with HF's logits on text ids and exact operators. LFM2-VL is saved tied (no output head
    in the file) and its config.json then says ``tie_word_embeddings: false`` but
    ``tie_embedding: true``: HF's config lets the alias win, and so does the load (without it,
    the head would be missing). LFM3-VL is saved untied. Before 2026-12-02 these types were
    unknown."""
    torch, transformers = torch_or_skip()
    from implicit_attn.testing import assert_loads_as_language_model, hf_config_kwargs

    outer, vision = VL_CASES[text_type]
    tied = outer == "Lfm2Vl"
    text = {**hf_config_kwargs(text_type), "model_type": text_type, "tie_word_embeddings": not tied}
    cfg = getattr(transformers, outer + "Config")(text_config=text, vision_config=vision, projector_hidden_size=16,
                                                  tie_word_embeddings=tied)
    tm = getattr(transformers, outer + "ForConditionalGeneration")(cfg).eval()
    lfm2.hf_setup(tm, torch, 0)
    tm.save_pretrained(tmp_path)
    if tied:
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False,
                                                          "tie_embedding": True}))
        tm = getattr(transformers, outer + "ForConditionalGeneration").from_pretrained(tmp_path).eval()
        assert tm.config.tie_word_embeddings is True
    ids = np.random.default_rng(3).integers(0, text["vocab_size"], (2, 13))
    assert_loads_as_language_model(tm, tmp_path, text_type, tied, ids)


def test_a_vision_language_checkpoint_of_another_language_model_names_the_supported_ones():
    from implicit_attn.registry import checkpoint_family

    with pytest.raises(ValueError, match=r"lfm2_vl.* of model_type 'lfm3'; supported there: \['lfm2', 'lfm2_moe'\]"):
        checkpoint_family({"model_type": "lfm2_vl", "text_config": {"model_type": "lfm3"}})
    spec, container = checkpoint_family({"model_type": "lfm3_vl", "text_config": {"model_type": "lfm3"}})
    assert spec is lfm2.LFM3_SPEC and container.model_type == "lfm3_vl"
