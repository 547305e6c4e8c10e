"""LaraMini (HF ``LaraMiniForCausalLM``, ``model_type: "lara_mini"``, Translated's Lara-4-Mini):
Qwen3.5's Gated DeltaNet layers, sliding-window attention layers with RoPE and full attention
layers without positional encoding (Qwen3's attention: per-head q/k norms, no output gate), each
followed by a softmax top-k mixture of SwiGLU experts with an ungated shared expert; RMSNorms
with a plain weight.

``config`` (HF fields), ``block`` (pure functions: the DeltaNet is ``qwen3_next.block``'s, the
attention ``lfm2.block``'s), ``modules`` (NNX), ``checkpoint`` (Bamba's layout builder under the
released names: one fused ``in_proj`` per DeltaNet, experts stacked), ``naive`` (float64
references).
"""
from ...nn import FamilySpec
from ..qwen3_next import SPEC as QWEN3_NEXT
from ..qwen3_next import hf_setup
from .block import EXACT_VARIANTS, VARIANTS, lm_forward, mixer_forward, mixer_operator, moe_forward
from .checkpoint import expected_shapes, from_params, init_params, standard_form, to_params
from .config import Config
from .modules import LM, AttentionMixer, DeltaMixer, LaraMiniLayer, SlidingAttentionMixer
from .naive import naive_operator

SPEC = FamilySpec(
    model_type="lara_mini", label="LaraMini", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=EXACT_VARIANTS, to_params=to_params, from_params=from_params, expected_shapes=expected_shapes,
    init_params=init_params, naive_operator=naive_operator, hf_class="LaraMiniForCausalLM",
    hf_config_class="LaraMiniConfig",
    # HF's pattern: DeltaNet, sliding (window 3 < the tests' length), DeltaNet, full, sliding; 2 key
    # heads serve 4 value heads; tied embeddings as released
    tiny=dict(vocab_size=64, hidden_size=16, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, sliding_window=3, linear_conv_kernel_dim=4, linear_key_head_dim=4, linear_value_head_dim=6,
              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=8, shared_expert_intermediate_size=12, eos_token_id=None),
    hf_setup=hf_setup, hf_mixer=QWEN3_NEXT.hf_mixer, has_heads=True,
    # Lara-4-Mini's layout scaled down: HF's period-5 pattern over 10 layers, 8 key / 16 value heads
    bench={"full": dict(vocab_size=1024, hidden_size=512, num_hidden_layers=10, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=64, sliding_window=128, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_num_key_heads=8, linear_num_value_heads=16, num_experts=16,
                        num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                        eos_token_id=None),
           "quick": dict(vocab_size=256, hidden_size=128, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, sliding_window=64, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                         eos_token_id=None)})

__all__ = ["SPEC", "Config", "LM", "DeltaMixer", "AttentionMixer", "SlidingAttentionMixer", "LaraMiniLayer",
           "VARIANTS", "EXACT_VARIANTS", "to_params", "from_params", "expected_shapes", "init_params", "standard_form",
           "naive_operator", "lm_forward", "mixer_forward", "mixer_operator", "moe_forward"]
