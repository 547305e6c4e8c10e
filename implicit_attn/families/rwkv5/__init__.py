"""RWKV-5 ("Eagle") in the RWKV team's Hugging Face layout (``Rwkv5ForCausalLM``, ``model_type:
"rwkv5"``, the remote code of RWKV/rwkv-5-world-* and RWKV/v5-Eagle-7B-HF): transformers'
RWKV-4 layout and block with a per-head matrix-valued state, one constant decay per key
dimension, read before the update plus a bonus, and a gated group norm on the output.

``config`` (the HF fields), ``block`` (the time mix and its operator; the block and LM are
RWKV-4's), ``modules`` (NNX), ``checkpoint`` (shape table; RWKV-4's builder), ``naive``
(float64 reference for tests).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (EXACT_VARIANTS, VARIANTS, block_forward, channel_mix_forward, lm_forward, time_mix_forward,
                    time_mix_inner, time_mix_operator, time_mix_parts)
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, Rwkv5Block, Rwkv5SelfAttention
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model (saved before any forward, in its training-form weights):
    perturbed, then decays spread over fast and slow channels in every head and the bonus moved
    off its initial value."""
    perturb_parameters(model, torch, scale=0.1, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in model.rwkv.blocks:
            a = block.attention
            H, S = a.time_decay.shape
            a.time_decay.copy_(torch.linspace(-5.0, 1.0, S).repeat(H, 1))
            a.time_faaaa.add_(0.5 * torch.randn(a.time_faaaa.shape, generator=g))


SPEC = FamilySpec(
    model_type="rwkv5", label="RWKV-5", config=Config, lm=LM, variants=VARIANTS, exact_variants=EXACT_VARIANTS,
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="Rwkv5ForCausalLM", hf_config_class="Rwkv5Config",
    # 3 blocks, R = 2 (rescaled only in half precision)
    tiny=dict(vocab_size=64, hidden_size=16, num_hidden_layers=3, head_size=8, intermediate_size=24,
              rescale_every=2),
    hf_setup=hf_setup, hf_mixer="rwkv.blocks.{i}.attention", has_heads=True,
    # RWKV-5 World 0.4B's heads (64) and channel-mix ratio, narrower, fewer layers, a small vocabulary
    bench={"full": dict(vocab_size=1024, hidden_size=512, num_hidden_layers=12, head_size=64,
                        intermediate_size=1792, rescale_every=6),
           "quick": dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, head_size=64, intermediate_size=448,
                         rescale_every=6)})

__all__ = ["SPEC", "Config", "LM", "Rwkv5SelfAttention", "Rwkv5Block", "VARIANTS", "EXACT_VARIANTS", "hf_setup",
           "to_params", "from_params", "expected_shapes", "init_params", "naive_operator", "time_mix_parts",
           "time_mix_inner", "time_mix_forward", "time_mix_operator", "channel_mix_forward", "block_forward",
           "lm_forward"]
