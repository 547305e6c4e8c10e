"""Qwen3.5 and Qwen3.5-MoE beyond the conformance suite: the fields HF's Qwen3.5 configs delete
(a config.json may still carry them; HF ignores them, and so do we), Qwen3.5-35B-A3B's layout
scaled down against torch, and the vision-language checkpoints' language model."""
from __future__ import annotations

import json

import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import qwen3_5
from conftest import torch_or_skip


def test_deleted_fields_are_ignored_and_not_written():
    cfg = qwen3_5.Config.from_hf({**qwen3_5.SPEC.tiny, "num_experts": 4, "mlp_only_layers": [0]})
    assert cfg.ffn_kinds == ("mlp",) * 3
    d = cfg.to_hf()
    assert d["architectures"] == ["Qwen3_5ForCausalLM"] and d["model_type"] == "qwen3_5_text"
    assert not {"num_experts", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob"} & set(d)
    assert qwen3_5.Config.from_hf(d) == cfg
    moe = qwen3_5.MoeConfig.from_hf({**qwen3_5.MOE_SPEC.tiny, "norm_topk_prob": False, "mlp_only_layers": [1],
                                     "decoder_sparse_step": 2})
    assert moe.ffn_kinds == ("moe",) * 3 and moe.norm_topk_prob
    assert "intermediate_size" not in moe.to_hf() and qwen3_5.MoeConfig.from_hf(moe.to_hf()) == moe
    shapes = qwen3_5.SPEC.expected_shapes(cfg)[0]
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 2 * 4 + 4 * 6, 16)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" not in shapes


def test_moe_layout_matches_torch_where_hf_ignores_the_layer_rules():
    """Qwen3.5-35B-A3B's pattern (three DeltaNets then attention, a mixture of experts in every
    layer) scaled down, with the Qwen3-Next layer rules HF's Qwen3.5-MoE ignores set to values that
    would change the model if they were read."""
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    kw = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
              head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
              shared_expert_intermediate_size=8, norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=2)
    ids = np.random.default_rng(4).integers(0, 64, (2, 15))
    report = assert_hf_parity("qwen3_5_moe_text", kw, ids)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 4
    assert max(report["exactness"]["full"]) <= 1e-5


# the released checkpoints' type: the text model of test_moe_layout... scaled down, a one-block
# vision tower, and the text config's RoPE with the multimodal sections the released configs carry
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, patch_size=2, num_position_embeddings=16)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0],
        "mrope_interleaved": True}


def saved_vision_language_model(text_type: str, path, tie: bool | None = None):
    """``(torch model, text config dict)`` of a tiny ``Qwen3_5ForConditionalGeneration`` (the MoE
    one for ``"qwen3_5_moe_text"``) with the released configs' RoPE sections and a one-layer vision
    tower, saved by transformers to ``path``. ``tie``: the outer config's ``tie_word_embeddings``
    (the text config then says the opposite); None leaves both at their defaults."""
    torch, transformers = torch_or_skip()
    from implicit_attn.testing import hf_config_kwargs

    ties = {} if tie is None else {"tie_word_embeddings": tie}
    text = {**hf_config_kwargs(text_type), "head_dim": 8, "rope_parameters": ROPE,
            **({} if tie is None else {"tie_word_embeddings": not tie})}
    outer = "Qwen3_5MoeConfig" if "moe" in text_type else "Qwen3_5Config"
    torch.manual_seed(0)
    cfg = getattr(transformers, outer)(text_config=text, vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
                                       **ties)
    tm = getattr(transformers, outer.replace("Config", "ForConditionalGeneration"))(cfg).eval()
    (qwen3_5.MOE_SPEC if "moe" in text_type else qwen3_5.SPEC).hf_setup(tm, torch, 0)
    tm.save_pretrained(path)
    return tm, text


@pytest.mark.parametrize("text_type, tie", [("qwen3_5_text", False), ("qwen3_5_moe_text", True)])
def test_vision_language_checkpoints_load_their_language_model(text_type, tie, tmp_path):
    """``Qwen3_5ForConditionalGeneration`` (and the MoE one), saved by transformers with an
    ``mtp.`` tensor added: ``ia.load`` gives the text family's model with HF's logits on text ids
    and exact operators. The outer config's ``tie_word_embeddings`` decides the tie (the text
    config says the opposite here); before 2026-12-02 the type was unknown."""
    from safetensors.numpy import load_file, save_file

    from implicit_attn.testing import assert_loads_as_language_model

    tm, text = saved_vision_language_model(text_type, tmp_path, tie)
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in tensors)
    save_file({**tensors, "mtp.fc.weight": np.ones((4, 4), np.float32)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    ids = np.random.default_rng(3).integers(0, text["vocab_size"], (2, 13))
    assert_loads_as_language_model(tm, tmp_path, text_type, tie, ids)


def test_a_vision_language_config_without_its_text_config_is_an_error(tmp_path):
    ia.save(qwen3_5.LM(cfg := qwen3_5.Config.from_hf(qwen3_5.SPEC.tiny), qwen3_5.SPEC.init_params(cfg, 0)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5"}))
    with pytest.raises(ia.CheckpointError, match="no 'text_config' object"):
        ia.load(tmp_path)


# OpenBMB's vision-language models on Qwen3.5's text model, with a two-layer vision tower
MINICPM_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                      patch_size=2, insert_layer_id=1)


@pytest.mark.parametrize("name", ["MiniCPMV4_6", "MiniCPMV4_7", "MiniCPMOcr"])
def test_minicpm_checkpoints_load_their_language_model(name, tmp_path):
    """MiniCPM-V 4.6 / 4.7 (untied by default) and MiniCPM-OCR (tied) saved by transformers load
    as ``qwen3_5_text`` with HF's logits on text ids and exact operators."""
    torch, transformers = torch_or_skip()
    from implicit_attn.testing import assert_loads_as_language_model, hf_config_kwargs

    text = {**hf_config_kwargs("qwen3_5_text"), "model_type": "qwen3_5_text"}
    cfg = getattr(transformers, name + "Config")(text_config=text, vision_config=MINICPM_VISION, insert_layer_id=1,
                                                 image_size=8)
    tm = getattr(transformers, name + "ForConditionalGeneration")(cfg).eval()
    qwen3_5.SPEC.hf_setup(tm, torch, 0)
    tm.save_pretrained(tmp_path)
    ids = np.random.default_rng(5).integers(0, text["vocab_size"], (2, 9))
    assert_loads_as_language_model(tm, tmp_path, "qwen3_5_text", name == "MiniCPMOcr", ids)


@pytest.mark.parametrize("text_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_text_checkpoint_with_the_vision_language_names_loads(text_type, tmp_path):
    """A ``qwen3_5_text`` / ``qwen3_5_moe_text`` config with its tensors under
    ``model.language_model.`` (transformers reads it by a prefix change): HF's logits."""
    torch, _ = torch_or_skip()
    from safetensors.numpy import load_file, save_file

    from implicit_attn.testing import build_hf_model, reference_class

    build_hf_model(text_type).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({"model.language_model." + k[6:] if k.startswith("model.") else k: v for k, v in tensors.items()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    tm = reference_class(qwen3_5.SPEC.hf_class if text_type == "qwen3_5_text" else qwen3_5.MOE_SPEC.hf_class)
    tm = tm.from_pretrained(tmp_path).eval()
    ids = np.random.default_rng(7).integers(0, 64, (1, 9))
    with torch.no_grad():
        ref = tm(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ia.load(tmp_path)(ids)) - ref).max() <= 1e-4
