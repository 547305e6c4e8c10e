"""GraniteMoeHybrid (HF ``GraniteMoeHybridForCausalLM``, ``model_type: "granitemoehybrid"``,
the Granite-4.0-H models): Mamba-2 layers and full causal attention layers (``layer_types``),
each followed by a top-k mixture of SwiGLU experts plus a shared SwiGLU MLP, with muP
multipliers on the embeddings, residual branches, attention logits and output logits.

``config`` (HF fields), ``block`` (pure functions), ``modules`` (NNX, Bamba's classes with
Granite's functions), ``checkpoint`` (shape table, HF mapping, init), ``naive`` (float64
references). The mixers are Bamba's: ``mamba2.block`` and ``nn.attention``.
"""
from ...nn import FamilySpec, move_off_initial_values, perturb_parameters
from .block import VARIANTS, decoder_layer, ffn_forward, lm_forward, mixer_forward, mixer_operator, moe_forward
from .checkpoint import STATE_DICT_NAMES, expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, AttentionMixer, GraniteLayer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, with the norm weights, the Mamba layers' D and conv
    bias away from their initial values."""
    perturb_parameters(model, torch, seed=seed)
    layers = model.model.layers
    mixers = [l.mamba for l in layers if l.mamba is not None]
    norms = ([model.model.norm] + [n for l in layers for n in (l.input_layernorm, l.post_attention_layernorm)]
             + [m.norm for m in mixers])
    move_off_initial_values(torch, norms, mixers, seed, norm_scale=0.1)


SPEC = FamilySpec(
    model_type="granitemoehybrid", label="GraniteMoeHybrid", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=("full", "no_conv"), to_params=to_params, from_params=from_params,
    expected_shapes=expected_shapes, init_params=init_params, naive_operator=naive_operator,
    hf_class="GraniteMoeHybridForCausalLM", hf_config_class="GraniteMoeHybridConfig",
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=8, shared_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=1, layer_types=["mamba", "attention", "mamba"],
              num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=4,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4, position_embedding_type="rope",
              embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.2),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.mamba|model.layers.{i}.self_attn", has_heads=True,
    bench={"full": dict(vocab_size=1024, hidden_size=768, intermediate_size=256, shared_intermediate_size=1024,
                        num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                        layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
                        num_local_experts=16, num_experts_per_tok=4, mamba_n_heads=24, mamba_d_state=64,
                        mamba_chunk_size=64, embedding_multiplier=12.0, logits_scaling=6.0,
                        residual_multiplier=0.22, attention_multiplier=0.0078125),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=64, shared_intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         layer_types=["mamba", "attention"], num_local_experts=8, num_experts_per_tok=2,
                         mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=64)},
    state_dict_names=STATE_DICT_NAMES)

__all__ = ["SPEC", "Config", "LM", "AttentionMixer", "GraniteLayer", "VARIANTS", "to_params", "from_params",
           "expected_shapes", "init_params", "naive_operator", "decoder_layer", "lm_forward", "mixer_forward",
           "mixer_operator", "moe_forward", "ffn_forward"]
