"""Jamba (HF ``JambaForCausalLM``, ``model_type: "jamba"``): Mamba layers with weighted
RMSNorms on ``dt``, ``B`` and ``C``, and full causal attention layers without positional
encoding (one in ``attn_layer_period``), each followed by a SwiGLU MLP or, one layer in
``expert_layer_period``, a mixture of SwiGLU experts.

``config`` (HF fields; ``Config.mixer_config`` is the Mamba config of the Mamba layers),
``block`` (pure functions), ``modules`` (NNX, Bamba's classes with Mamba's mixer),
``checkpoint`` (shape table, HF mapping with per-expert tensors, init), ``naive`` (float64
references). The mixer math is ``mamba.block``'s and ``nn.attention``'s.
"""
from ...nn import FamilySpec, move_off_initial_values, perturb_parameters
from .block import VARIANTS, decoder_layer, ffn_forward, lm_forward, mixer_forward, mixer_operator, moe_forward
from .checkpoint import STATE_DICT_NAMES, expected_shapes, from_params, init_params, to_params
from .config import Config, MixerConfig
from .modules import LM, AttentionMixer, JambaLayer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, with every norm weight (the dt/B/C norms included)
    and the Mamba layers' D and conv bias away from their initial values."""
    perturb_parameters(model, torch, seed=seed)
    layers = model.model.layers
    mixers = [l.mamba for l in layers if getattr(l, "mamba", None) is not None]
    norms = ([model.model.final_layernorm] + [n for l in layers for n in (l.input_layernorm, l.pre_ff_layernorm)]
             + [n for m in mixers for n in (m.dt_layernorm, m.b_layernorm, m.c_layernorm)])
    move_off_initial_values(torch, norms, mixers, seed)


SPEC = FamilySpec(
    model_type="jamba", label="Jamba", config=Config, lm=LM, variants=VARIANTS, exact_variants=("full", "no_conv"),
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="JambaForCausalLM", hf_config_class="JambaConfig",
    # layers: mamba + MoE, attention + MLP, mamba + MLP, attention + MoE (every combination)
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=3,
              expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4,
              mamba_expand=2, mamba_dt_rank=4),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.mamba|model.layers.{i}.self_attn",
    bench={"full": dict(vocab_size=1024, hidden_size=768, intermediate_size=1024, num_hidden_layers=8,
                        num_attention_heads=12, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4,
                        mamba_d_state=16),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                         mamba_d_state=16)},
    state_dict_names=STATE_DICT_NAMES)

__all__ = ["SPEC", "Config", "MixerConfig", "LM", "AttentionMixer", "JambaLayer", "VARIANTS", "to_params",
           "from_params", "expected_shapes", "init_params", "naive_operator", "decoder_layer", "lm_forward",
           "mixer_forward", "mixer_operator", "moe_forward", "ffn_forward"]
