"""RWKV-7 ("Goose") in flash-linear-attention's Hugging Face layout (``RWKV7ForCausalLM``,
``model_type: "rwkv7"``): the generalised delta rule, a per-head state with a diagonal-plus-low-rank
transition ``Diag(w_t) - kk_t (kk_t a_t)^T`` read after the update, and a value residual from layer 0.

``config`` (fla's fields), ``block`` (math and operator), ``modules`` (NNX), ``checkpoint`` (shape
table; RWKV-6's builder), ``naive`` (float64 reference for tests).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (EXACT_VARIANTS, VARIANTS, block_forward, channel_mix_forward, lm_forward, time_mix_forward,
                    time_mix_operator, time_mix_parts)
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, Block, ChannelMix, TimeMix
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, then decay biases spread (per-step decays from ~0.99 to
    ~0.55) and ``r_k`` moved off its initial value."""
    perturb_parameters(model, torch, scale=0.1, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.attn.w_lora.lora[2].bias
            bias.copy_(torch.linspace(-4.0, 4.0, bias.numel()))
            layer.attn.r_k.add_(0.3 * torch.randn(layer.attn.r_k.shape, generator=g))


def hf_mixer_input(torch, module, args, kwargs):
    """The torch time mix's input as ours, ``[x, v_first] (B, L, C + V)``: fla calls it with
    ``hidden_states`` and ``v_first``; layer 0 (no ``v_lora``) makes its own, so its part is zeros
    of the value width (fla passes zeros of the hidden width)."""
    x = args[0] if args else kwargs["hidden_states"]
    if not hasattr(module, "v_lora"):
        return torch.cat([x, x.new_zeros(x.shape[:-1] + (module.v_proj.weight.shape[0],))], dim=-1)
    v_first = args[1] if len(args) > 1 else kwargs["v_first"]
    return torch.cat([x, v_first.to(x.dtype)], dim=-1)


SPEC = FamilySpec(
    model_type="rwkv7", label="RWKV-7", config=Config, lm=LM, variants=VARIANTS, exact_variants=EXACT_VARIANTS,
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="RWKV7ForCausalLM", hf_config_class="RWKV7Config",
    tiny=dict(vocab_size=64, hidden_size=16, num_hidden_layers=3, head_dim=8, decay_low_rank_dim=4,
              gate_low_rank_dim=6, a_low_rank_dim=4, v_low_rank_dim=3, intermediate_size=24),
    hf_setup=hf_setup, hf_mixer="model.layers.{i}.attn", has_heads=True, hf_mixer_input=hf_mixer_input,
    # RWKV-7 0.1B's shape (heads of 64; ranks 64/64/32/128), fewer layers and a small vocabulary
    bench={"full": dict(vocab_size=1024, hidden_size=768, num_hidden_layers=12, head_dim=64, decay_low_rank_dim=64,
                        a_low_rank_dim=64, v_low_rank_dim=32, gate_low_rank_dim=128, intermediate_size=3072),
           "quick": dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, head_dim=64, decay_low_rank_dim=8,
                         a_low_rank_dim=8, v_low_rank_dim=4, gate_low_rank_dim=16, intermediate_size=256)})

__all__ = ["SPEC", "Config", "LM", "TimeMix", "ChannelMix", "Block", "VARIANTS", "EXACT_VARIANTS", "hf_setup",
           "hf_mixer_input", "to_params", "from_params", "expected_shapes", "init_params", "naive_operator",
           "time_mix_parts", "time_mix_forward", "time_mix_operator", "channel_mix_forward", "block_forward",
           "lm_forward"]
