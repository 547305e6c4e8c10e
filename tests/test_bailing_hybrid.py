"""Bailing-Hybrid (Ling 3.0) beyond the conformance suite: its layout scaled down with the bounded
forget gate at Ling's bound and with Kimi's unbounded one, and config forms (the MLA operator,
with RoPE on the shared key part, against HF's eager probabilities: ``test_kimi_linear``)."""
from __future__ import annotations

import numpy as np
import pytest

from implicit_attn.families import bailing_hybrid
from conftest import torch_or_skip

# Ling 3.0: 42 layers in groups of 6 (the sixth MLA), the first two dense, 512 experts in 8 groups
# (4 kept, 8 experts per token), one shared expert; KDA heads = attention heads; here 6 layers at
# width 64
LING_3 = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
              v_head_dim=8, head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=4, num_local_experts=16,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, num_mtp_layers=0)


# a query latent (``q_lora_rank``) with the bias HF gives it under ``attention_bias``, as Kimi's MLA
# has it; KDA sizes given in config.json apart from the MLA's (HF sets them after deriving them)
VARIANTS = {"bounded_gate": {}, "softplus_gate": {"kda_safe_gate": False},
            "q_latent": {"q_lora_rank": 12, "attention_bias": True},
            "kda_sizes_given": {"linear_head_dim": 6, "linear_num_heads": 2, "linear_conv_kernel_dim": 3}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_released_layout_matches_torch_and_is_exact(variant):
    """Until 2026-12-02 the two last variants were not read: the load failed on tensor shapes."""
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    kw = {**LING_3, **VARIANTS[variant]}
    safe_gate = kw.get("kda_safe_gate", True)
    cfg = bailing_hybrid.Config.from_hf(kw)
    assert cfg.layer_types == ("delta",) * 5 + ("attention",) and cfg.mlp_layer_types == ("mlp",) * 2 + ("moe",) * 4
    assert cfg.gate_lower_bound == (-5.0 if safe_gate else None)
    assert all(getattr(cfg, k) == v for k, v in VARIANTS[variant].items())
    ids = np.random.default_rng(1).integers(0, 64, (2, 17))
    report = assert_hf_parity("bailing_hybrid", kw, ids)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 6
    assert max(report["exactness"]["full"]) <= 1e-5


def test_config_forms():
    """HF's defaults (MLA closing every group of ``layer_group_size``, the first
    ``first_k_dense_replace`` layers dense), ``rope_parameters``, and the settings HF's Bailing
    cannot run as meant."""
    cfg = bailing_hybrid.Config.from_hf(dict(LING_3, num_hidden_layers=12, layer_group_size=4,
                                             first_k_dense_replace=3, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 1e5}))
    assert cfg.layer_types == ("delta", "delta", "delta", "attention") * 3 and cfg.mla_rope_theta == 1e5
    assert cfg.mlp_layer_types == ("mlp",) * 3 + ("moe",) * 9 and cfg.linear_num_heads == 4
    d = cfg.to_hf()
    assert d["q_lora_rank"] is None and d["linear_head_dim"] == 8 and d["rope_parameters"]["rope_theta"] == 1e5
    assert bailing_hybrid.Config.from_hf(d) == cfg
    for bad, match in ((dict(qk_rope_head_dim=4), "qk_rope_head_dim .* must equal head_dim"),
                       (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type"),
                       (dict(kda_lower_bound=1.0), "kda_lower_bound")):
        with pytest.raises(ValueError, match=match):
            bailing_hybrid.Config.from_hf({**d, **bad})
