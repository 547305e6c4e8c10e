"""OLMo-Hybrid (HF ``OlmoHybridForCausalLM``, ``model_type: "olmo_hybrid"``): Gated DeltaNet
layers (pre-norm; Qwen3-Next's mixer with one projection per input and write strengths in
[0, 2]) and OLMo-3 attention layers (post-norm; q/k norms over all heads, RoPE or none), each
with a SwiGLU MLP.

``config`` (HF fields), ``block`` (pure functions; the DeltaNet is ``qwen3_next.block``'s),
``modules`` (NNX), ``checkpoint`` (the names HF writes; HF's other forms accepted), ``naive``
(float64 references).
"""
from ...nn import FamilySpec
from ..qwen3_next import SPEC as QWEN3_NEXT
from ..qwen3_next import hf_setup, unread_tensors
from .block import EXACT_VARIANTS, VARIANTS, lm_forward, mixer_forward, mixer_operator
from .checkpoint import expected_shapes, from_params, init_params, standard_form, to_params
from .config import Config
from .modules import LM, AttentionMixer, DeltaMixer, OlmoHybridLayer
from .naive import naive_operator

SPEC = FamilySpec(
    model_type="olmo_hybrid", label="OLMo-Hybrid", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=EXACT_VARIANTS, to_params=to_params, from_params=from_params, expected_shapes=expected_shapes,
    init_params=init_params, naive_operator=naive_operator, hf_class="OlmoHybridForCausalLM",
    hf_config_class="OlmoHybridConfig",
    # DeltaNet, attention, DeltaNet; 2 key heads serve 4 value heads (HF's token ids default past this vocabulary)
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, linear_conv_kernel_dim=4, linear_key_head_dim=4, linear_value_head_dim=6,
              linear_num_key_heads=2, linear_num_value_heads=4, pad_token_id=None, eos_token_id=None,
              layer_types=["linear_attention", "full_attention", "linear_attention"]),
    hf_setup=hf_setup, hf_mixer=QWEN3_NEXT.hf_mixer, has_heads=True,
    # OLMo-Hybrid-7B's layout scaled down: attention every fourth layer, HF's default DeltaNet widths
    bench={"full": dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                        num_attention_heads=8, pad_token_id=None, eos_token_id=None),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, pad_token_id=None, eos_token_id=None)},
    unread_tensors=unread_tensors)

__all__ = ["SPEC", "Config", "LM", "DeltaMixer", "AttentionMixer", "OlmoHybridLayer", "VARIANTS", "EXACT_VARIANTS",
           "to_params", "from_params", "expected_shapes", "init_params", "standard_form", "naive_operator",
           "lm_forward", "mixer_forward", "mixer_operator"]
