"""Nemotron-H beyond the conformance suite: the layouts of the released Nemotron-H-8B
(Mamba-2 and squared-ReLU MLP layers alternating, attention 1 in 4 mixers, 8 Mamba groups,
head_dim 128 with 32 heads and 8 KV heads) and Nemotron-3-Nano (Mamba-2 / attention layers
each followed by a mixture of experts with a shared expert, sigmoid routing scaled by
2.5) scaled down; our layers are HF's token-mixing layers with the MLP / MoE layers after
them; the ``time_step_limit`` clamp is seen by the parity test; the router equals HF's; the attention layers' operator is HF's softmax attention; hub configs
(``hybrid_override_pattern``, legacy names) load; bad config values are named."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import nemotron_h
from conftest import torch_or_skip

NEMOTRON_H_8B = dict(vocab_size=64, hidden_size=64, hybrid_override_pattern="M-M-M-M*-M-", num_attention_heads=4,
                     num_key_value_heads=1, head_dim=16, intermediate_size=336, ssm_state_size=16, mamba_num_heads=8,
                     mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=8)
NEMOTRON_3_NANO = dict(vocab_size=64, hidden_size=48, hybrid_override_pattern="MEMEM*EME", num_attention_heads=4,
                       num_key_value_heads=1, head_dim=16, ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=16, num_experts_per_tok=6,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1,
                       routed_scaling_factor=2.5, norm_topk_prob=True)


@pytest.mark.parametrize("config", [NEMOTRON_H_8B, NEMOTRON_3_NANO], ids=["8b", "nano"])
def test_released_layout_matches_torch_and_is_exact(config):
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(1).integers(0, 64, (2, 17))
    report = assert_hf_parity("nemotron_h", config, ids)
    assert report["logits"] <= 1e-4
    assert max(report["exactness"]["full"]) <= 1e-5 and max(report["exactness"]["no_conv"]) <= 1e-5


def test_layers_group_each_token_mixer_with_the_ffn_layers_after_it(tmp_path):
    cfg = nemotron_h.Config.from_hf(nemotron_h.SPEC.tiny)
    assert cfg.layers_block_type == ("mamba", "mlp", "moe", "attention", "moe", "mamba")
    assert cfg.blocks == ((0, 1, 2), (3, 4), (5,)) and cfg.layer_types == ("mamba", "attention", "mamba")
    params = nemotron_h.init_params(cfg, 0)
    assert [len(l["feed_forward"]) for l in params["layers"]] == [2, 1, 0]
    moe = params["layers"][0]["feed_forward"][1]["ffn"]
    assert moe["experts.up_proj"].shape == (4, 8, 8) and moe["fc1_latent_proj.weight"].shape == (8, 16)
    _, tensors = nemotron_h.from_params(cfg, params)
    np.testing.assert_array_equal(tensors["backbone.layers.2.mixer.experts.3.down_proj.weight"],
                                  np.asarray(moe["experts.down_proj"][3]))
    model = nemotron_h.LM(cfg, params)
    assert model.info()["hf_layers"] == [[0, 1, 2], [3, 4], [5]]
    ia.save(model, tmp_path)
    back = ia.load(tmp_path)
    for a, b in zip(params["layers"], back.params()["layers"]):
        for fa, fb in zip(a["feed_forward"], b["feed_forward"]):
            for k in fa["ffn"]:
                np.testing.assert_array_equal(np.asarray(fa["ffn"][k]), np.asarray(fb["ffn"][k]))
    ids = np.array([[1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(back(ids)))


def test_parity_sees_the_dt_clamp(tmp_path):
    """The tiny model's first Mamba head has ``dt_bias = -12`` (``softplus`` far below the tiny
    config's ``time_step_limit`` of ``(1e-3, inf)``): our model without the clamp misses torch's
    logits by more than the parity tolerance. (transformers 5.25 clamps to ``time_step_limit``;
    5.24 clamped below at ``time_step_min`` and ignored ``time_step_limit``.)"""
    torch_or_skip()
    from implicit_attn.testing import build_hf_model, torch_forward

    tm = build_hf_model("nemotron_h", None, path=tmp_path)
    model = ia.load(tmp_path)
    ids = np.random.default_rng(2).integers(0, 64, (2, 13))
    ref = torch_forward(tm, ids)[0]
    assert np.max(np.abs(np.asarray(model(ids)) - ref)) <= 1e-4
    assert model.config.time_step_limit == (1e-3, float("inf"))
    no_clamp = nemotron_h.LM(dataclasses.replace(model.config, time_step_limit=(0.0, float("inf"))), model.params())
    assert np.max(np.abs(np.asarray(no_clamp(ids)) - ref)) > 2e-4


@pytest.mark.parametrize("groups", [(1, 1, 8, 3, False), (4, 2, 16, 4, True)])
def test_router_matches_hf(groups):
    """``nn.moe.sigmoid_group_topk`` against HF's ``NemotronHTopkRouter`` (group-limited
    choice on the biased scores, weights from the unbiased ones) on random logits."""
    torch, transformers = torch_or_skip()
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from implicit_attn.nn.moe import sigmoid_group_topk

    n_group, topk_group, E, k, norm = groups
    cfg = transformers.NemotronHConfig(**{**nemotron_h.SPEC.tiny, "n_routed_experts": E, "n_group": n_group,
                                          "topk_group": topk_group, "num_experts_per_tok": k,
                                          "norm_topk_prob": norm, "routed_scaling_factor": 1.7})
    router = NemotronHTopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(E, generator=g))
    x = torch.randn(40, 16, generator=g)
    with torch.no_grad():
        logits, w_ref, idx_ref = router(x)
    w, idx = sigmoid_group_topk(logits.numpy(), router.e_score_correction_bias.numpy(), k, n_group, topk_group,
                                norm, 1.7)
    order, order_ref = np.argsort(np.asarray(idx), 1), np.argsort(idx_ref.numpy(), 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, 1),
                                  np.take_along_axis(idx_ref.numpy(), order_ref, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(w_ref.numpy(), order_ref, 1), rtol=1e-6)


def test_attention_layer_operator_is_the_softmax_attention(tmp_path):
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model

    tm = build_hf_model("nemotron_h", None, path=tmp_path)
    model = ia.load(tmp_path)
    ids = np.random.default_rng(3).integers(0, 64, (1, 9))
    tm.set_attn_implementation("eager")  # the path that returns the probabilities
    with torch.no_grad():
        out = tm(torch.as_tensor(ids), output_attentions=True, use_cache=False)
    want = [a.numpy() for a in out.attentions if a is not None]
    assert len(want) == 1
    H = np.asarray(model.operators(ids, layers=[1])[0].materialize())
    np.testing.assert_allclose(H.sum(-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(H, want[0], atol=1e-6)


def test_hub_config_forms_load():
    """Hub ``config.json`` files give the layers as ``hybrid_override_pattern`` and may use
    HF's legacy names (``mamba_n_groups``, ``mamba_d_conv``, ``num_local_experts``, ...)."""
    tiny = {k: v for k, v in nemotron_h.SPEC.tiny.items() if k not in ("n_groups", "conv_kernel", "n_routed_experts",
                                                                   "time_step_limit")}
    cfg = nemotron_h.Config.from_hf({**tiny, "mamba_n_groups": 2, "mamba_d_conv": 3, "num_local_experts": 4,
                                     "mamba_dt_limit": [0.01, 1.0]})
    assert (cfg.n_groups, cfg.conv_kernel, cfg.n_routed_experts) == (2, 3, 4)
    assert cfg.time_step_limit == cfg.mixer_config.time_step_limit == (0.01, 1.0)
    listed = nemotron_h.Config.from_hf({**nemotron_h.SPEC.tiny, "hybrid_override_pattern": None,
                                        "layers_block_type": ["mamba", "mlp", "moe", "attention", "moe", "mamba"]})
    assert listed == nemotron_h.Config.from_hf(nemotron_h.SPEC.tiny)
    assert nemotron_h.Config.from_hf(listed.to_hf()) == listed
    assert listed.to_hf()["layers_block_type"][:4] == ["linear_attention", "mlp", "moe", "full_attention"]


@pytest.mark.parametrize("bad, msg", [
    (dict(hybrid_override_pattern="-M*"), "must start with a token-mixing layer"),
    (dict(hybrid_override_pattern="MX*"), "hybrid_override_pattern"),
    (dict(n_routed_experts=3), "n_routed_experts"),
    (dict(topk_group=3), "topk_group"),
    (dict(num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act"),
    (dict(n_groups=3), "n_groups"),
    (dict(time_step_min=-1.0), "time_step_min"),
    (dict(head_dim=0), "head_dim"),
])
def test_bad_config_values_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        nemotron_h.Config.from_hf({**nemotron_h.SPEC.tiny, **bad})


@pytest.mark.parametrize("legacy", [False, True], ids=["text_config", "llm_config"])
def test_omni_checkpoints_load_their_language_model(legacy, tmp_path):
    """Nemotron-H Omni (``NemotronH_Omni_Reasoning_V3``, a one-layer RADIO vision tower, no audio)
    saved by transformers: ``ia.load`` reads the Nemotron-H ``*ForCausalLM`` under
    ``language_model.`` with HF's logits on text ids and exact operators; also with the text
    config under the released configs' name ``llm_config`` (HF reads that too)."""
    torch, transformers = torch_or_skip()
    from implicit_attn.testing import assert_loads_as_language_model, hf_config_kwargs

    text = {**hf_config_kwargs("nemotron_h"), "model_type": "nemotron_h"}
    vision = dict(model_type="radio", video_temporal_patch_size=2, hidden_size=16, num_hidden_layers=1,
                  num_attention_heads=2, patch_size=2, image_size=8, max_img_size=16)
    cfg = transformers.NemotronH_Omni_Reasoning_V3_Config(text_config=text, vision_config=vision,
                                                          projector_hidden_size=16, vision_hidden_size=16)
    tm = transformers.NemotronH_Omni_Reasoning_V3(cfg).eval()
    nemotron_h.SPEC.hf_setup(tm.language_model, torch, 0)
    tm.save_pretrained(tmp_path)
    if legacy:
        config = json.loads((tmp_path / "config.json").read_text())
        config["llm_config"] = config.pop("text_config")
        (tmp_path / "config.json").write_text(json.dumps(config))
        tm = transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(tmp_path).eval()
    ids = np.random.default_rng(6).integers(0, text["vocab_size"], (2, 9))
    assert_loads_as_language_model(tm, tmp_path, "nemotron_h", False, ids)
