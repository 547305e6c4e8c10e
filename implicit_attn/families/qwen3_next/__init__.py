"""Qwen3-Next (HF ``Qwen3NextForCausalLM``, ``model_type: "qwen3_next"``): Gated DeltaNet layers
and gated full-attention layers (``layer_types``), each followed by a SwiGLU MLP or a mixture
of experts with a gated shared expert; zero-centred RMSNorms.

``config`` (HF fields), ``block`` (pure functions; the delta rule is ``ops.delta_rule`` and its
matrix ``operator.DeltaRuleCore``), ``modules`` (NNX), ``checkpoint`` (Bamba's layout builder
under Qwen3-Next's names, experts stacked), ``naive`` (float64 references).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (EXACT_VARIANTS, VARIANTS, attention_forward, attention_operator, delta_forward, delta_operator,
                    lm_forward, mixer_forward, mixer_operator)
from .checkpoint import STATE_DICT_NAMES, expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, AttentionMixer, DeltaMixer, Qwen3NextLayer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model of a delta-rule family (Qwen3-Next and the families built on its
    DeltaNet or Kimi's): perturbed, with the norm weights (zero-centred or not, the gated output
    norms included) and the routers moved off their initial values (HF starts routers at 0), the
    routers' correction biases drawn, and the decay rates ``exp(A_log)`` drawn in [0.02, 0.5]
    (HF's draw up to 16 makes the state forget within a step, and the delta rule's erasure then
    never shows)."""
    perturb_parameters(model, torch, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "mlp.gate.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.48 * torch.rand(p.shape, generator=g)))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def unread_tensors(config: dict) -> tuple[str, ...]:
    """The tensors HF's class does not read (its ``_keys_to_ignore_on_load_unexpected``): the
    multi-token-prediction head (``mtp.``) the released checkpoints carry."""
    return (r"^mtp.*",)


SPEC = FamilySpec(
    model_type="qwen3_next", label="Qwen3-Next", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=EXACT_VARIANTS, to_params=to_params, from_params=from_params, expected_shapes=expected_shapes,
    init_params=init_params, naive_operator=naive_operator, hf_class="Qwen3NextForCausalLM",
    hf_config_class="Qwen3NextConfig",
    # layers: delta + MoE, attention + MoE, delta + MLP; 2 key heads serve 4 value heads
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=4,
              linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12,
              layer_types=["linear_attention", "full_attention", "linear_attention"], mlp_only_layers=[2]),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.linear_attn|model.layers.{i}.self_attn", has_heads=True,
    # Qwen3-Next-80B-A3B's layout scaled down: attention every fourth layer, 16 key / 32 value heads
    bench={"full": dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_num_key_heads=8, linear_num_value_heads=16,
                        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                        shared_expert_intermediate_size=128),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)},
    unread_tensors=unread_tensors, state_dict_names=STATE_DICT_NAMES)

__all__ = ["SPEC", "Config", "LM", "DeltaMixer", "AttentionMixer", "Qwen3NextLayer", "VARIANTS", "EXACT_VARIANTS",
           "to_params", "from_params", "expected_shapes", "init_params", "naive_operator", "lm_forward",
           "mixer_forward", "mixer_operator", "delta_forward", "delta_operator", "attention_forward",
           "attention_operator", "unread_tensors"]
