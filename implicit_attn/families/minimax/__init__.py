"""MiniMax (HF ``MiniMaxForCausalLM``, ``model_type: "minimax"``; MiniMax-Text-01): lightning
attention layers (linear attention with one constant decay per head, scaled by the layer's depth,
an RMSNorm over all heads and a sigmoid output gate) and softmax attention layers
(``layer_types``), each followed by a mixture of SwiGLU experts; the residual is taken after each
norm, with per-kind factors.

``config`` (HF fields), ``block`` (pure functions; the lightning operator is ``operator.Mamba2Core``
with ``dt = 1``, ``D = 0``, ``A_h = -s_h``), ``modules`` (NNX, Bamba's classes), ``checkpoint``
(Bamba's layout under MiniMax's names, experts stacked, HF's decay buffers optional), ``naive``
(float64 references).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (EXACT_VARIANTS, VARIANTS, lightning_forward, lightning_operator, lm_forward, mixer_forward,
                    mixer_operator, moe_forward, slope_rates)
from .checkpoint import STATE_DICT_NAMES, expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, AttentionMixer, LightningMixer, MiniMaxLayer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, every norm weight (the lightning output norm included)
    moved off 1, and the lightning ``qkv_proj`` scaled up so that ``q . k`` and the decay matter."""
    perturb_parameters(model, torch, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("qkv_proj.weight"):
                p.mul_(8.0)


SPEC = FamilySpec(
    model_type="minimax", label="MiniMax", config=Config, lm=LM, variants=VARIANTS, exact_variants=EXACT_VARIANTS,
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="MiniMaxForCausalLM", hf_config_class="MiniMaxConfig",
    # layers: lightning, attention, lightning; head_dim 6 (not hidden_size / heads); HF's blocks of 4
    # positions (tests run L = 11: two whole blocks and a partial one); every residual factor set
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=6, num_local_experts=4, num_experts_per_tok=2, block_size=4,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              full_attn_alpha_factor=1.5, full_attn_beta_factor=0.8, linear_attn_alpha_factor=1.2,
              linear_attn_beta_factor=0.7, mlp_alpha_factor=1.3, mlp_beta_factor=0.9),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.self_attn", has_heads=True,
    # MiniMax-Text-01's layout scaled down: softmax attention every eighth layer, 8 experts, top 2
    bench={"full": dict(vocab_size=1024, hidden_size=512, intermediate_size=256, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                        num_experts_per_tok=2, block_size=256,
                        layer_types=["linear_attention"] * 7 + ["full_attention"]),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                         num_experts_per_tok=2, block_size=64, layer_types=["linear_attention", "full_attention"])},
    state_dict_names=STATE_DICT_NAMES)

__all__ = ["SPEC", "Config", "LM", "LightningMixer", "AttentionMixer", "MiniMaxLayer", "VARIANTS", "EXACT_VARIANTS",
           "hf_setup", "to_params", "from_params", "expected_shapes", "init_params", "naive_operator", "slope_rates",
           "lm_forward", "mixer_forward", "mixer_operator", "lightning_forward", "lightning_operator", "moe_forward"]
