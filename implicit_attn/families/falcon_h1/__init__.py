"""Falcon-H1 (HF ``FalconH1ForCausalLM``, ``model_type: "falcon_h1"``): every layer runs a
Mamba-2 mixer and full causal attention with RoPE in parallel on the same normed input,
sums them with muP multipliers, then a SwiGLU MLP.

``config`` (HF fields; ``Config.mixer_config`` is the Mamba-2 config of the Mamba path),
``block`` (pure functions; the layer operator puts both paths' channels side by side),
``modules`` (NNX), ``checkpoint`` (Bamba's layout with both mixers in every layer),
``naive`` (float64 reference). The mixer math is ``mamba2.block``'s and ``nn.attention``'s.
"""
from ...nn import FamilySpec, move_off_initial_values, perturb_parameters
from .block import VARIANTS, decoder_layer, lm_forward, mixer_forward, mixer_operator, mlp_forward
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config, MixerConfig
from .modules import LM, FalconH1Layer, ParallelMixer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, with every norm weight, the Mamba paths' D and conv
    bias away from their initial values."""
    perturb_parameters(model, torch, seed=seed)
    layers = model.model.layers
    mixers = [l.mamba for l in layers]
    norms = ([model.model.final_layernorm] + [n for l in layers for n in (l.input_layernorm, l.pre_ff_layernorm)]
             + ([m.norm for m in mixers] if model.config.mamba_rms_norm else []))
    move_off_initial_values(torch, norms, mixers, seed)


def hf_mixer_output(hf_config, outputs):
    """HF's layer output before the residual from its Mamba and attention modules' outputs."""
    mamba, attention = outputs
    return mamba * hf_config.ssm_out_multiplier + attention * hf_config.attention_out_multiplier


SPEC = FamilySpec(
    model_type="falcon_h1", label="Falcon-H1", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=("full", "no_conv"), to_params=to_params, from_params=from_params,
    expected_shapes=expected_shapes, init_params=init_params, naive_operator=naive_operator,
    hf_class="FalconH1ForCausalLM", hf_config_class="FalconH1Config",
    # mamba_d_ssm 24 != mamba_expand * hidden_size; every multiplier away from 1
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, mamba_d_ssm=24, mamba_n_heads=4, mamba_n_groups=2,
              mamba_d_state=4, mamba_d_conv=4, mamba_chunk_size=4, mamba_rms_norm=True,
              mamba_norm_before_gate=True, embedding_multiplier=2.0, lm_head_multiplier=0.5,
              mlp_multipliers=[0.9, 1.1], key_multiplier=0.7, attention_in_multiplier=1.2,
              attention_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], ssm_in_multiplier=1.3,
              ssm_out_multiplier=0.6),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.mamba+model.layers.{i}.self_attn", hf_mixer_output=hf_mixer_output,
    # Falcon-H1-0.5B's proportions at width 768: Mamba width 1.5 d, 24 heads of 48, 8 attention heads of 64 (GQA 4:1)
    bench={"full": dict(vocab_size=1024, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, mamba_d_ssm=1152,
                        mamba_n_heads=24, mamba_d_state=64, mamba_chunk_size=64),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=192, mamba_n_heads=8,
                         mamba_d_state=16, mamba_chunk_size=64)})

__all__ = ["SPEC", "Config", "MixerConfig", "LM", "ParallelMixer", "FalconH1Layer", "VARIANTS", "to_params",
           "from_params", "expected_shapes", "init_params", "naive_operator", "decoder_layer", "lm_forward",
           "mixer_forward", "mixer_operator", "mlp_forward", "hf_mixer_output"]
