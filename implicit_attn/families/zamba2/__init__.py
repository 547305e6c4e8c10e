"""Zamba2 (HF ``Zamba2ForCausalLM``, ``model_type: "zamba2"``): Mamba-2 layers and hybrid
layers whose shared transformer block (attention on ``[h, embeddings]``, then an MLP, with
per-layer low-rank adapters) feeds the input of their Mamba-2 mixer. Our layers are the token
mixers in the order they run: a hybrid layer is its shared attention, then its Mamba layer
(``Config.layer_types``, ``Config.hf_layers``).

``config`` (HF fields, our layer list, ``Config.mixer_config``), ``block`` (pure functions),
``modules`` (NNX), ``checkpoint`` (shape table, tied shared blocks, adapters, init),
``naive`` (float64 references). The mixer math is ``mamba2.block``'s and ``nn.attention``'s.
"""
from ...nn import FamilySpec, move_off_initial_values, perturb_parameters
from .block import VARIANTS, lm_forward, mamba_layer, mixer_forward, mixer_operator, mlp_forward, shared_layer
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, AttentionMixer, MambaLayer, SharedAttentionLayer, SharedBlock
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, with every norm weight (the shared blocks' too) and
    the Mamba mixers' D and conv bias away from their initial values, and one head's
    ``dt_bias`` far below zero so the ``time_step_min`` clamp is active."""
    perturb_parameters(model, torch, seed=seed)
    layers = model.model.layers
    mambas = [getattr(l, "mamba_decoder", l) for l in layers]
    shared = [l.shared_transformer for l in layers if hasattr(l, "shared_transformer")]
    norms = ([model.model.final_layernorm] + [m.input_layernorm for m in mambas] + [m.mamba.norm for m in mambas]
             + [n for s in shared for n in (s.input_layernorm, s.pre_ff_layernorm)])
    move_off_initial_values(torch, norms, [m.mamba for m in mambas], seed)
    with torch.no_grad():
        for m in mambas:
            m.mamba.dt_bias[0] = -12.0


def hf_mixer_modules(hf_config, shared: str = "shared_transformer.") -> list[str]:
    """The HF module of each of our layers' token mixer: ``model.layers.{i}.mamba`` for a Mamba
    layer, ``...{shared}self_attn`` then ``...mamba_decoder.mamba`` for a hybrid."""
    out = []
    for i, t in enumerate(hf_config.layers_block_type):
        p = f"model.layers.{i}."
        out += [p + shared + "self_attn", p + "mamba_decoder.mamba"] if t == "hybrid" else [p + "mamba"]
    return out


SPEC = FamilySpec(
    model_type="zamba2", label="Zamba2", config=Config, lm=LM, variants=VARIANTS, exact_variants=("full", "no_conv"),
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="Zamba2ForCausalLM", hf_config_class="Zamba2Config",
    # our layers: mamba, attention + mamba, attention + mamba; both hybrids use the one
    # shared block, each with its own q/k/v and MLP adapters; RoPE
    tiny=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
              layers_block_type=["mamba", "hybrid", "hybrid"], num_attention_heads=4, mamba_d_state=4, mamba_d_conv=4,
              mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=4, num_mem_blocks=1,
              use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.mamba", hf_mixer_layers=hf_mixer_modules, has_heads=True,
    # Zamba2-2.7B's layout scaled down: a hybrid layer every sixth, two shared blocks in turn
    bench={"full": dict(vocab_size=1024, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        layers_block_type=["mamba"] * 5 + ["hybrid"] + ["mamba"] * 5 + ["hybrid"],
                        num_attention_heads=12, mamba_d_state=64, n_mamba_heads=24, chunk_size=64, num_mem_blocks=2,
                        use_shared_attention_adapter=True, adapter_rank=32, use_mem_rope=True),
           "quick": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         layers_block_type=["mamba", "hybrid"], num_attention_heads=4, mamba_d_state=16,
                         n_mamba_heads=8, chunk_size=64, use_shared_attention_adapter=True, adapter_rank=8)})

__all__ = ["SPEC", "Config", "LM", "SharedBlock", "AttentionMixer", "SharedAttentionLayer", "MambaLayer", "VARIANTS",
           "to_params", "from_params", "expected_shapes", "init_params", "naive_operator", "lm_forward",
           "mixer_forward", "mixer_operator", "mlp_forward", "shared_layer", "mamba_layer", "hf_mixer_modules"]
