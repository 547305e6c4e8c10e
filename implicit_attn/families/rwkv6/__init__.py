"""RWKV-6 ("Finch") in flash-linear-attention's Hugging Face layout (``RWKV6ForCausalLM``,
``model_type: "rwkv6"``): per-head matrix-valued state with one data-dependent decay per key
dimension, read before the update plus a bonus for the current token.

``config`` (fla's fields), ``block`` (math and operator), ``modules`` (NNX), ``checkpoint`` (shape
table, the fla layout; RWKV-7 reuses the builder), ``naive`` (float64 reference for tests).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (EXACT_VARIANTS, VARIANTS, block_forward, channel_mix_forward, head_operator, lm_forward,
                    time_mix_forward, time_mix_operator, time_mix_parts)
from .checkpoint import expected_shapes, from_params, init_params, rwkv_checkpoint, to_params
from .config import Config
from .modules import LM, Block, ChannelMix, TimeMix
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, then decays spread over fast and slow channels and the
    bonus and norms moved off their initial values."""
    perturb_parameters(model, torch, scale=0.1, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.attn.w_proj.linear.lora[2].bias
            bias.copy_(torch.linspace(-5.0, 1.0, bias.numel()))
            layer.attn.bonus.add_(0.5 * torch.randn(layer.attn.bonus.shape, generator=g))


SPEC = FamilySpec(
    model_type="rwkv6", label="RWKV-6", config=Config, lm=LM, variants=VARIANTS, exact_variants=EXACT_VARIANTS,
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="RWKV6ForCausalLM", hf_config_class="RWKV6Config",
    tiny=dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_heads=2, expand_k=1.0, expand_v=1.0,
              proj_low_rank_dim=4, gate_low_rank_dim=6, intermediate_size=24),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.attn", has_heads=True,
    # RWKV-6-World 1.6B's shape scaled down: heads of 64, expand 1
    bench={"full": dict(vocab_size=1024, hidden_size=512, num_hidden_layers=12, num_heads=8, expand_k=1.0,
                        expand_v=1.0, proj_low_rank_dim=32, gate_low_rank_dim=64, intermediate_size=1792),
           "quick": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2, expand_k=1.0,
                         expand_v=1.0, proj_low_rank_dim=8, gate_low_rank_dim=16, intermediate_size=224)})

__all__ = ["SPEC", "Config", "LM", "TimeMix", "ChannelMix", "Block", "VARIANTS", "EXACT_VARIANTS", "hf_setup",
           "to_params", "from_params", "expected_shapes", "init_params", "rwkv_checkpoint", "naive_operator",
           "time_mix_parts", "time_mix_forward", "time_mix_operator", "head_operator", "channel_mix_forward",
           "block_forward", "lm_forward"]
