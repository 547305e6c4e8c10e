"""Kimi-Linear (HF ``KimiLinearForCausalLM``, ``model_type: "kimi_linear"``): Kimi Delta Attention
layers (the gated delta rule with one decay per key dimension; its exact operator on
``ops.delta_rule``) and MLA attention layers without positional encoding, each followed by a
SwiGLU MLP or a sigmoid-routed mixture of experts with shared experts.

``config`` (HF fields and checkpoint forms), ``block`` (pure functions; the operator is
``qwen3_next.block.delta_operator`` on ``kda_parts``), ``modules`` (NNX), ``checkpoint`` (Bamba's
layout builder under Kimi-Linear's names), ``naive`` (float64 references).
"""
from ...nn import FamilySpec
from ..qwen3_next import hf_setup
from .block import EXACT_VARIANTS, VARIANTS, kda_operator, lm_forward, mixer_forward, mixer_operator
from .checkpoint import STATE_DICT_NAMES, expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, AttentionMixer, DeltaMixer, KimiLinearLayer
from .naive import naive_operator


SPEC = FamilySpec(
    model_type="kimi_linear", label="Kimi-Linear", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=EXACT_VARIANTS, to_params=to_params, from_params=from_params, expected_shapes=expected_shapes,
    init_params=init_params, naive_operator=naive_operator, hf_class="KimiLinearForCausalLM",
    hf_config_class="KimiLinearConfig",
    # layers: KDA + MLP, MLA + MoE, KDA + MoE; 2 KDA heads of 4; 4 expert groups of 2, 1 group kept
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, qk_rope_head_dim=2, v_head_dim=4,
              qk_nope_head_dim=4, n_group=2, topk_group=1, num_experts_per_tok=2, num_local_experts=4,
              routed_scaling_factor=2.0, linear_head_dim=4, linear_num_heads=2, pad_token_id=None, bos_token_id=None,
              eos_token_id=None, layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"]),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.self_attn", has_heads=True,
    # Kimi-Linear-48B-A3B's layout scaled down: MLA every fourth layer, the first layer dense
    bench={"full": dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128,
                        qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=1, topk_group=1,
                        num_experts_per_tok=4, num_local_experts=16, linear_head_dim=32, linear_num_heads=16,
                        pad_token_id=None, bos_token_id=None, eos_token_id=None),
           # five layers: the default pattern's first attention layer is the fifth (HF's cache needs one)
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                         qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1,
                         num_experts_per_tok=2, num_local_experts=4, linear_head_dim=16, linear_num_heads=4,
                         pad_token_id=None, bos_token_id=None, eos_token_id=None)},
    state_dict_names=STATE_DICT_NAMES)

__all__ = ["SPEC", "Config", "LM", "DeltaMixer", "AttentionMixer", "KimiLinearLayer", "VARIANTS", "EXACT_VARIANTS",
           "hf_setup", "to_params", "from_params", "expected_shapes", "init_params", "naive_operator", "lm_forward",
           "mixer_forward", "mixer_operator", "kda_operator"]
