"""Mamba (HF ``MambaForCausalLM``, ``model_type: "mamba"``).

``config`` (HF fields), ``block`` (math and operator as pure functions), ``modules`` (NNX),
``checkpoint`` (shape table, HF mapping, init), ``naive`` (float64 reference for tests).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (VARIANTS, lm_forward, mixer_forward, mixer_inner, mixer_operator, mixer_parts, rms_norm,
                    selective_scan)
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, MambaBlock, MambaMixer
from .naive import naive_operator



def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, with D and the conv bias away from their defaults."""
    perturb_parameters(model, torch, seed=seed)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.D.add_(0.5)
            if layer.mixer.conv1d.bias is not None:
                layer.mixer.conv1d.bias.add_(0.3)


SPEC = FamilySpec(
    model_type="mamba", label="Mamba", config=Config, lm=LM, variants=VARIANTS, exact_variants=("full", "no_conv"),
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="MambaForCausalLM", hf_config_class="MambaConfig",
    tiny=dict(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=4, expand=2,
              use_conv_bias=True, time_step_rank=4),
    hf_setup=hf_setup, hf_mixer="backbone.layers.{i}.mixer",
    bench={"full": dict(vocab_size=1024, hidden_size=768, state_size=16, num_hidden_layers=24, conv_kernel=4),
           "quick": dict(vocab_size=256, hidden_size=128, state_size=16, num_hidden_layers=2, conv_kernel=4)})

__all__ = ["SPEC", "Config", "LM", "MambaMixer", "MambaBlock", "VARIANTS", "hf_setup", "init_params", "to_params",
           "from_params", "expected_shapes", "lm_forward", "mixer_forward", "mixer_inner", "mixer_operator",
           "mixer_parts", "selective_scan", "rms_norm", "naive_operator"]
