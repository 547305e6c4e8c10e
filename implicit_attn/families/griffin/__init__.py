"""Griffin / RecurrentGemma (HF ``RecurrentGemmaForCausalLM``, ``model_type:
"recurrent_gemma"``): RG-LRU recurrent blocks and local attention blocks.

``config``, ``block`` (math and operators), ``modules`` (NNX), ``checkpoint`` (shape table,
HF mapping, init), ``naive`` (float64 references for tests).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (VARIANTS, attention_forward, attention_operator, check_segment_pos, document_conv,
                    layer_forward, lm_forward, mlp_forward, recurrent_forward, recurrent_inner, recurrent_operator,
                    recurrent_parts, rglru_gates, rglru_scan, rms_norm, segment_ids)
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import BLOCK_TYPES, Config
from .modules import LM, AttentionBlock, GriffinLayer, RecurrentBlock
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: eager attention, every parameter perturbed (zero biases and
    norm weights are HF's init), the conv bias well away from zero (the offset must count)."""
    model.config._attn_implementation = "eager"
    perturb_parameters(model, torch, scale=0.1, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            tb = layer.temporal_block
            if hasattr(tb, "conv_1d"):
                tb.conv_1d.bias.add_(0.3)


SPEC = FamilySpec(
    model_type="recurrent_gemma", label="Griffin", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=("full", "no_conv"), to_params=to_params, from_params=from_params,
    expected_shapes=expected_shapes, init_params=init_params, naive_operator=naive_operator,
    hf_class="RecurrentGemmaForCausalLM", hf_config_class="RecurrentGemmaConfig",
    tiny=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=1, lru_width=24, attention_window_size=5, conv1d_width=4, logits_soft_cap=30.0,
              rms_norm_eps=1e-6, block_types=["recurrent", "recurrent", "attention"], attention_bias=False,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.temporal_block",
    bench={"full": dict(vocab_size=1024, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=8, num_key_value_heads=1, lru_width=768, attention_window_size=2048),
           "quick": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, lru_width=64, attention_window_size=64)})

__all__ = ["SPEC", "Config", "LM", "RecurrentBlock", "AttentionBlock", "GriffinLayer", "VARIANTS", "BLOCK_TYPES",
           "init_params", "to_params", "from_params", "expected_shapes", "check_segment_pos", "segment_ids",
           "document_conv", "rglru_gates", "rglru_scan", "recurrent_parts", "recurrent_inner", "recurrent_forward",
           "recurrent_operator", "attention_forward", "attention_operator", "mlp_forward", "rms_norm",
           "layer_forward", "lm_forward", "naive_operator"]
