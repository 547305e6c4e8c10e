"""Qwen3.5 and Qwen3.5-MoE beyond the conformance suite: the fields HF's Qwen3.5 configs delete
(a config.json may still carry them; HF ignores them, and so do we), and Qwen3.5-35B-A3B's layout
scaled down against torch."""
from __future__ import annotations

import numpy as np

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
