"""Bamba (HF ``BambaForCausalLM``, ``model_type: "bamba"``): Mamba-2 layers and full
causal attention layers (``attn_layer_indices``), each followed by a SwiGLU MLP.

``config`` (HF fields; ``Config.mixer_config`` is the Mamba-2 config of the Mamba layers),
``block`` (pure functions), ``modules`` (NNX), ``checkpoint`` (shape table, HF mapping,
init), ``naive`` (float64 references for tests). The mixer math is ``mamba2.block``'s and
``nn.attention``'s.
"""
from ...nn import FamilySpec, move_off_initial_values, perturb_parameters
from .block import VARIANTS, decoder_layer, lm_forward, mixer_forward, mixer_operator, mlp_forward
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, AttentionMixer, BambaLayer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, with the norm weights and the Mamba layers' D and
    conv bias away from their initial values."""
    perturb_parameters(model, torch, seed=seed)
    layers = model.model.layers
    mixers = [l.mamba for l in layers if getattr(l, "mamba", None) is not None]
    norms = [n for l in layers for n in (l.input_layernorm, l.pre_ff_layernorm)] + [m.norm for m in mixers]
    move_off_initial_values(torch, norms, mixers, seed, norm_scale=0.1)


SPEC = FamilySpec(
    model_type="bamba", label="Bamba", config=Config, lm=LM, variants=VARIANTS, exact_variants=("full", "no_conv"),
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="BambaForCausalLM", hf_config_class="BambaConfig",
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=1, attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=4,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.mamba|model.layers.{i}.self_attn", has_heads=True,
    bench={"full": dict(vocab_size=1024, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                        num_attention_heads=12, num_key_value_heads=4, attn_layer_indices=[3, 7], mamba_n_heads=24,
                        mamba_d_state=64, mamba_chunk_size=64),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
                         mamba_d_state=16, mamba_chunk_size=64)})

__all__ = ["SPEC", "Config", "LM", "AttentionMixer", "BambaLayer", "VARIANTS", "to_params", "from_params",
           "expected_shapes", "init_params", "naive_operator", "decoder_layer", "lm_forward", "mixer_forward",
           "mixer_operator", "mlp_forward"]
