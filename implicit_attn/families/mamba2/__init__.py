"""Mamba-2 (HF ``Mamba2ForCausalLM``, ``model_type: "mamba2"``): Mamba's residual stack,
norm and checkpoint layout with the Mamba-2 mixer.

``config``, ``block`` (math and operator), ``modules`` (NNX), ``checkpoint`` (shape table,
HF mapping, init), ``naive`` (float64 reference for tests).
"""
import math

from ...nn import FamilySpec, perturb_parameters
from .block import (VARIANTS, gated_norm_scale, gated_rms_norm, head_matrices, lm_forward, mixer_forward,
                    mixer_inner, mixer_operator, mixer_parts, ssd)
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, Mamba2Block, Mamba2Mixer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: explicit SSM parameters varied per head (nothing depends on
    init order), then perturbed, with the conv bias and norm weights off their defaults."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.backbone.layers:
            m = layer.mixer
            H = m.num_heads
            m.A_log.copy_(torch.log(1 + 15 * torch.rand(H, generator=g)))
            dt = torch.exp(torch.rand(H, generator=g) * (math.log(0.5) - math.log(1e-2)) + math.log(1e-2))
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            m.D.copy_(1.0 + 0.5 * torch.randn(H, generator=g))
    perturb_parameters(model, torch, seed=seed)
    with torch.no_grad():
        for layer in model.backbone.layers:
            m = layer.mixer
            if m.conv1d.bias is not None:
                m.conv1d.bias.add_(0.3 * torch.randn(m.conv1d.bias.shape, generator=g))
            m.norm.weight.add_(0.3 * torch.randn(m.norm.weight.shape, generator=g))


SPEC = FamilySpec(
    model_type="mamba2", label="Mamba-2", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=("full", "no_conv"), to_params=to_params, from_params=from_params,
    expected_shapes=expected_shapes, init_params=init_params, naive_operator=naive_operator,
    hf_class="Mamba2ForCausalLM", hf_config_class="Mamba2Config",
    tiny=dict(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8, state_size=4, n_groups=1,
              num_hidden_layers=2, conv_kernel=4, expand=2, chunk_size=8, use_conv_bias=True,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    hf_setup=hf_setup, hf_mixer="backbone.layers.{i}.mixer", has_heads=True,
    bench={"full": dict(vocab_size=1024, hidden_size=768, num_heads=24, head_dim=64, state_size=128, n_groups=1,
                        num_hidden_layers=24, conv_kernel=4, expand=2, chunk_size=256),
           "quick": dict(vocab_size=256, hidden_size=64, num_heads=4, head_dim=32, state_size=32, n_groups=1,
                         num_hidden_layers=2, conv_kernel=4, expand=2, chunk_size=64)})

__all__ = ["SPEC", "Config", "LM", "Mamba2Mixer", "Mamba2Block", "VARIANTS", "init_params", "to_params",
           "from_params", "expected_shapes", "lm_forward", "mixer_forward", "mixer_inner", "mixer_operator",
           "mixer_parts", "ssd", "gated_norm_scale", "gated_rms_norm", "head_matrices", "naive_operator"]
