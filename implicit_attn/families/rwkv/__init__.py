"""RWKV-4 (HF ``RwkvForCausalLM``, ``model_type: "rwkv"``), eval mode with HF's
``rescale_every``.

``config``, ``block`` (math and operator), ``modules`` (NNX), ``checkpoint`` (shape table,
HF mapping, init), ``naive`` (float64 reference for tests).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (VARIANTS, block_forward, channel_mix_forward, layer_norm, lm_forward, time_mix_forward,
                    time_mix_inner, time_mix_operator, time_mix_parts, token_shift, wkv)
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, RwkvBlock, RwkvFeedForward, RwkvSelfAttention
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model (saved before any forward, i.e. in HF's training-form weights):
    perturbed, decays and bonus spread so that fast and slow channels occur."""
    perturb_parameters(model, torch, scale=0.1, seed=seed)
    with torch.no_grad():
        for b in model.rwkv.blocks:
            a = b.attention
            a.time_decay.copy_(torch.linspace(-3.0, 1.5, a.time_decay.numel()))
            a.time_first.add_(torch.randn(a.time_first.shape) * 0.5)


SPEC = FamilySpec(
    model_type="rwkv", label="RWKV", config=Config, lm=LM, variants=VARIANTS, exact_variants=("full",),
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="RwkvForCausalLM", hf_config_class="RwkvConfig",
    tiny=dict(vocab_size=64, hidden_size=16, num_hidden_layers=5, attention_hidden_size=12, intermediate_size=24,
              rescale_every=2, context_length=64, tie_word_embeddings=False),
    hf_setup=hf_setup, hf_mixer="rwkv.blocks.{i}.attention",
    bench={"full": dict(vocab_size=1024, hidden_size=1024, attention_hidden_size=1024, intermediate_size=4096,
                        num_hidden_layers=24, rescale_every=6),
           "quick": dict(vocab_size=256, hidden_size=64, attention_hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, rescale_every=6)})

__all__ = ["SPEC", "Config", "LM", "RwkvSelfAttention", "RwkvFeedForward", "RwkvBlock", "VARIANTS", "init_params",
           "to_params", "from_params", "expected_shapes", "layer_norm", "token_shift", "time_mix_parts",
           "time_mix_inner", "time_mix_forward", "channel_mix_forward", "time_mix_operator", "wkv", "block_forward",
           "lm_forward", "naive_operator"]
