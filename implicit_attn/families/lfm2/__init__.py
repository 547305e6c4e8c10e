"""LFM2 (HF ``Lfm2ForCausalLM``, ``model_type: "lfm2"``), LFM2-MoE (``Lfm2MoeForCausalLM``,
``"lfm2_moe"``) and LFM3 (``Lfm3ForCausalLM``, ``"lfm3"``), Liquid AI's hybrids: gated short
convolutions ``y = c * conv(b * x)`` (exact operator ``diag(c) M diag(b)`` per channel,
``operator.ShortConvCore``) and GQA attention layers (LFM3: also sliding-window, gated heads,
sandwich norms), with SwiGLU MLPs or (LFM2-MoE) sigmoid-routed experts.

``config`` (HF fields), ``block`` (pure functions on Bamba's layer and LM functions),
``modules`` (NNX), ``checkpoint`` (Bamba's layout builder under LFM's names), ``naive``
(float64 references).
"""
from ...nn import FamilySpec, perturb_parameters
from ...nn.checkpoint import vision_language
from .block import EXACT_VARIANTS, VARIANTS, conv_forward, conv_operator, lm_forward, mixer_forward, mixer_operator
from .checkpoint import CHECKPOINT, LFM3_CHECKPOINT, LFM3_STATE_DICT_NAMES, MOE_CHECKPOINT, MOE_STATE_DICT_NAMES
from .config import Config, Lfm3Config, MoeConfig
from .modules import LM, AttentionMixer, ConvMixer, Lfm2Layer, Lfm3LM, MoeLM, SlidingAttentionMixer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model of an LFM generation: perturbed, with the norm weights and routers
    moved further off their initial values and the routers' expert biases (buffers) drawn."""
    perturb_parameters(model, torch, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "feed_forward.gate.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


# the vision-language checkpoints (LFM2-VL on LFM2 or LFM2-MoE, LFM3-VL): their vision tower and
# projector are not read; LFM2-VL's config may name the tie ``tie_embedding``
NOT_READ = ("model.vision_tower.", "model.multi_modal_projector.")
LFM2_VL = vision_language("lfm2_vl", NOT_READ, tied=True, aliases=("tie_embedding",))
LFM3_VL = vision_language("lfm3_vl", NOT_READ, tied=True)


def spec(model_type, label, config, lm, checkpoint, hf_class, tiny, bench, containers,
         state_dict_names=None) -> FamilySpec:
    """The ``FamilySpec`` of one LFM generation (they share everything but these)."""
    return FamilySpec(
        model_type=model_type, label=label, config=config, lm=lm, variants=VARIANTS, exact_variants=EXACT_VARIANTS,
        to_params=checkpoint.to_params, from_params=checkpoint.from_params,
        expected_shapes=checkpoint.expected_shapes, init_params=checkpoint.init_params,
        naive_operator=naive_operator, hf_class=hf_class, hf_config_class=hf_class.replace("ForCausalLM", "Config"),
        tiny=tiny, hf_setup=hf_setup, hf_mixer="model.layers.{i}.conv|model.layers.{i}.self_attn",
        bench=bench, containers=containers, state_dict_names=state_dict_names)


# LFM2-1.2B's layout scaled down: 16 layers, attention at 2, 5, 8, 10, 12, 14 (of 16)
LFM2_PATTERN = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv"]

SPEC = spec(
    "lfm2", "LFM2", Config, LM, CHECKPOINT, "Lfm2ForCausalLM",
    # conv, attention, conv; biases on the convs; the SwiGLU width adjusted (2/3 of 48, rounded to 16)
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=48, block_multiple_of=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, conv_bias=True,
              layer_types=["conv", "full_attention", "conv"]),
    bench={"full": dict(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=2, layer_types=LFM2_PATTERN),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, layer_types=LFM2_PATTERN[:4])},
    containers=(LFM2_VL,))

MOE_SPEC = spec(
    "lfm2_moe", "LFM2-MoE", MoeConfig, MoeLM, MOE_CHECKPOINT, "Lfm2MoeForCausalLM",
    # conv + MLP, attention + MoE, conv + MoE; 4 experts, 2 per token, scaled weights
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=4,
              num_experts_per_tok=2, routed_scaling_factor=1.5, layer_types=["conv", "full_attention", "conv"]),
    bench={"full": dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, num_dense_layers=2,
                        num_experts=16, num_experts_per_tok=4, layer_types=LFM2_PATTERN),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1,
                         num_experts=4, num_experts_per_tok=2, layer_types=LFM2_PATTERN[:4])},
    containers=(LFM2_VL,), state_dict_names=MOE_STATE_DICT_NAMES)

LFM3_SPEC = spec(
    "lfm3", "LFM3", Lfm3Config, Lfm3LM, LFM3_CHECKPOINT, "Lfm3ForCausalLM",
    # conv, sliding (window 3), attention (proportional RoPE on 2 of 4 frequencies); biases
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, sliding_window=3, attention_bias=True, pad_token_id=None,
              bos_token_id=None, eos_token_id=None,
              layer_types=["conv", "sliding_attention", "full_attention"]),
    # LFM3-1.7B's layout scaled down: the default pattern over 8 layers
    bench={"full": dict(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, pad_token_id=None,
                        bos_token_id=None, eos_token_id=None),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=None,
                         bos_token_id=None, eos_token_id=None)},
    containers=(LFM3_VL,), state_dict_names=LFM3_STATE_DICT_NAMES)

__all__ = ["SPEC", "MOE_SPEC", "LFM3_SPEC", "Config", "MoeConfig", "Lfm3Config", "LM", "MoeLM", "Lfm3LM",
           "ConvMixer", "AttentionMixer", "SlidingAttentionMixer", "Lfm2Layer", "VARIANTS", "EXACT_VARIANTS",
           "hf_setup", "naive_operator", "lm_forward", "mixer_forward", "mixer_operator", "conv_forward",
           "conv_operator"]
