"""Zamba (Zamba-v1, HF ``ZambaForCausalLM``, ``model_type: "zamba"``): Zamba2's layer structure
(Mamba layers; hybrid layers whose shared transformer block on ``[h, embeddings]`` feeds their
Mamba mixer's input; a hybrid layer is two of our layers) with one shared block, no adapters,
no RoPE, and a Mamba-1 mixer split into heads with their own ``x_proj`` / ``dt_proj`` (so their
own ``B`` and ``C``).

``config`` (HF fields, ``Config.mixer_config``), ``block`` (pure functions: the multi-head
mixer; the layers are ``zamba2.block.zamba_functions``), ``modules`` (Zamba2's classes),
``checkpoint`` (Zamba2's layout under Zamba's names), ``naive`` (float64 references).
"""
from ...nn import FamilySpec, move_off_initial_values, perturb_parameters
from ..zamba2 import hf_mixer_modules
from .block import VARIANTS, head_params, lm_forward, mamba_forward, mamba_operator, mixer_forward, mixer_operator
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config, MixerConfig
from .modules import LM, AttentionMixer, MambaLayer, MambaMixer, SharedAttentionLayer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, with every norm weight and the Mamba mixers' D and
    conv bias away from their initial values, and each head's ``x_proj`` (HF starts it at
    zero, so ``B = C = 0``) and ``dt_proj_bias`` drawn at useful scales."""
    perturb_parameters(model, torch, seed=seed)
    layers = model.model.layers
    mambas = [getattr(l, "mamba_decoder", l) for l in layers]
    shared = [l.shared_transf for l in layers if hasattr(l, "shared_transf")]
    norms = ([model.model.final_layernorm] + [m.input_layernorm for m in mambas]
             + [n for s in shared for n in (s.input_layernorm, s.pre_ff_layernorm)])
    move_off_initial_values(torch, norms, [m.mamba for m in mambas], seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for m in mambas:
            m.mamba.x_proj_weight.add_(0.3 * torch.randn(m.mamba.x_proj_weight.shape, generator=g))
            m.mamba.dt_proj_bias.add_(torch.randn(m.mamba.dt_proj_bias.shape, generator=g) - 1.0)


def hf_mixer_layers(hf_config) -> list[str]:
    """The HF module of each of our layers' token mixer (``zamba2.hf_mixer_modules`` under
    Zamba's ``shared_transf.``)."""
    return hf_mixer_modules(hf_config, "shared_transf.")


SPEC = FamilySpec(
    model_type="zamba", label="Zamba", config=Config, lm=LM, variants=VARIANTS, exact_variants=("full", "no_conv"),
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="ZambaForCausalLM", hf_config_class="ZambaConfig",
    # our layers: mamba, attention + mamba, attention + mamba; two Mamba heads; GQA
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
              layers_block_type=["mamba", "hybrid", "hybrid"], num_attention_heads=4, num_key_value_heads=2,
              n_mamba_heads=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.mamba", hf_mixer_layers=hf_mixer_layers,
    # Zamba-7B-v1's layout scaled down: HF's default pattern (a hybrid layer every sixth after
    # the first three), two Mamba heads, MLP 4x wide
    bench={"full": dict(vocab_size=1024, hidden_size=768, intermediate_size=3072, num_hidden_layers=13,
                        num_attention_heads=12, num_key_value_heads=12, n_mamba_heads=2, mamba_d_state=16),
           # two hybrid layers: HF ties the later ones' shared block to the first and refuses a lone one
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                         layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                         num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=16)})

__all__ = ["SPEC", "Config", "MixerConfig", "LM", "MambaMixer", "AttentionMixer", "SharedAttentionLayer",
           "MambaLayer", "VARIANTS", "to_params", "from_params", "expected_shapes", "init_params", "naive_operator",
           "head_params", "lm_forward", "mamba_forward", "mamba_operator", "mixer_forward", "mixer_operator",
           "hf_mixer_layers"]
