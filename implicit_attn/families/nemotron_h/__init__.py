"""Nemotron-H (HF ``NemotronHForCausalLM``, ``model_type: "nemotron_h"``): one mixer per HF
layer, ``h + mixer(rms_norm(h))``, each a Mamba-2 mixer, full causal attention without
positional encoding, a squared-ReLU MLP or a mixture of squared-ReLU experts with a shared
expert (``hybrid_override_pattern`` ``M`` / ``*`` / ``-`` / ``E``). Our layer ``k`` is HF's
``k``-th token-mixing layer with the MLP / MoE layers after it (``Config.blocks``).

``config`` (HF fields; ``Config.mixer_config`` is the Mamba-2 config of the Mamba layers),
``block`` (pure functions), ``modules`` (NNX), ``checkpoint`` (shape table, ``backbone.``
names, per-expert tensors, init), ``naive`` (float64 references). The mixer math is
``mamba2.block``'s and ``nn.attention``'s.

``nemotron_h_omni`` checkpoints (Nemotron-H Omni, ``NemotronH_Omni_Reasoning_V3``: vision,
audio and a Nemotron-H ``*ForCausalLM`` under ``language_model.``) load as their language model
(``OMNI``).
"""
from ...nn import FamilySpec, move_off_initial_values, perturb_parameters
from ...nn.checkpoint import Container
from .block import VARIANTS, decoder_layer, ffn_forward, lm_forward, mixer_forward, mixer_operator, moe_forward
from .checkpoint import STATE_DICT_NAMES, expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, AttentionMixer, FeedForwardLayer, NemotronLayer
from .naive import naive_operator

TOKEN_MIXING = ("linear_attention", "full_attention")


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, with every norm weight, the Mamba layers' D and conv
    bias away from their initial values, a random router correction bias (a buffer HF
    starts at zero), and one head's ``dt_bias`` far below zero so the lower ``time_step_limit``
    clamp (the tiny config's 1e-3) is active."""
    perturb_parameters(model, torch, seed=seed)
    layers = model.model.layers
    mixers = [l.mixer for l in layers if l.block_type == "linear_attention"]
    move_off_initial_values(torch, [model.model.norm_f] + [l.norm for l in layers] + [m.norm for m in mixers],
                            mixers, seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for mixer in mixers:
            mixer.dt_bias[0] = -12.0
        for layer in layers:
            if layer.block_type == "moe":
                bias = layer.mixer.gate.e_score_correction_bias
                bias.copy_(0.3 * torch.randn(bias.shape, generator=g))


def hf_mixer_layers(hf_config) -> list[int]:
    """The HF index of each of our layers' token mixer."""
    return [i for i, t in enumerate(hf_config.layers_block_type) if t in TOKEN_MIXING]


def unread_tensors(config: dict) -> tuple[str, ...]:
    """The tensors HF's class does not read (its ``_keys_to_ignore_on_load_unexpected``, found
    anywhere in the name as HF searches it): the multi-token-prediction layers (``mtp``)."""
    return (r"mtp.*",)


# the whole NemotronHForCausalLM under language_model.; its own text config ties (or not) the head;
# released configs name that config llm_config; the vision tower, projector and audio are not read
OMNI = Container(model_type="nemotron_h_omni", config_key="text_config", legacy_config_key="llm_config",
                 prefix="language_model.", target="", skipped=("vision_model.", "mlp1.", "audio_tower."))

SPEC = FamilySpec(
    model_type="nemotron_h", label="Nemotron-H", config=Config, lm=LM, variants=VARIANTS,
    exact_variants=("full", "no_conv"), to_params=to_params, from_params=from_params,
    expected_shapes=expected_shapes, init_params=init_params, naive_operator=naive_operator,
    hf_class="NemotronHForCausalLM", hf_config_class="NemotronHConfig",
    # our layers: mamba + MLP + MoE, attention + MoE, mamba; head_dim * heads != hidden_size
    tiny=dict(vocab_size=64, hidden_size=16, hybrid_override_pattern="M-E*EM", num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=32, ssm_state_size=4, mamba_num_heads=4,
              mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=8, moe_shared_expert_intermediate_size=12, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, moe_latent_size=8, time_step_limit=[1e-3, float("inf")]),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.mixer", hf_mixer_layers=hf_mixer_layers, has_heads=True,
    # Nemotron-H-8B's layout scaled down: Mamba-2 and MLP layers alternating, attention 1 in 4
    bench={"full": dict(vocab_size=1024, hidden_size=768, hybrid_override_pattern="M-M-M*-M-M-M*-",
                        num_attention_heads=6, num_key_value_heads=2, head_dim=128, intermediate_size=3072,
                        ssm_state_size=64, mamba_num_heads=24, mamba_head_dim=64, n_groups=8, chunk_size=64),
           "quick": dict(vocab_size=256, hidden_size=128, hybrid_override_pattern="M-*E", num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, ssm_state_size=16,
                         mamba_num_heads=8, mamba_head_dim=16, n_groups=2, chunk_size=64, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64)},
    containers=(OMNI,), unread_tensors=unread_tensors, state_dict_names=STATE_DICT_NAMES)

__all__ = ["SPEC", "Config", "LM", "AttentionMixer", "FeedForwardLayer", "NemotronLayer", "VARIANTS",
           "to_params", "from_params", "expected_shapes", "init_params", "naive_operator", "decoder_layer",
           "lm_forward", "mixer_forward", "mixer_operator", "moe_forward", "ffn_forward", "hf_mixer_layers", "OMNI",
           "unread_tensors"]
