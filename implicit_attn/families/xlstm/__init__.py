"""xLSTM (transformers' ``xLSTMForCausalLM``, ``model_type: "xlstm"``; xLSTM-7B's mLSTM blocks): a
per-head matrix memory with one sigmoid forget gate and one exponential, soft-capped input gate per
head, a stabiliser and a normaliser, a multi-head layer norm and a sigmoid output gate.

``config`` (transformers' fields, refusals), ``block`` (math and operator), ``modules`` (NNX),
``checkpoint`` (shape table, transformers' layout), ``naive`` (float64 reference for tests).
"""
from ...nn import FamilySpec, perturb_parameters
from .block import (EXACT_VARIANTS, VARIANTS, block_forward, ffn_forward, lm_forward, mixer_forward, mixer_operator,
                    mixer_parts)
from .checkpoint import expected_shapes, from_params, init_params, to_params
from .config import Config
from .modules import LM, Block, FeedForward, MlstmLayer
from .naive import naive_operator


def hf_setup(model, torch, seed: int = 0):
    """Tiny torch test model: perturbed, then the input gates spread over ``-6 ... 0`` and the forget
    gates over ``0.5 ... 4`` (transformers starts them at -10 and 3 ... 6 with zero weights), norms
    moved off one. With these gates the normaliser's floor ``exp(-m)`` wins in most rows and
    ``|n . q|`` in the others, and the normaliser stays well conditioned (where ``|n . q|`` barely
    exceeds the floor after cancelling, float32 rounding is amplified: with input gates up to +3 the
    hooks tests' two compiled programs differed by 5e-6 in the logits)."""
    perturb_parameters(model, torch, scale=0.1, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    H = model.config.num_heads
    with torch.no_grad():
        for block in model.backbone.blocks:
            layer = block.mlstm_layer
            i_b, f_b = torch.linspace(-6.0, 0.0, H), torch.linspace(0.5, 4.0, H)
            if model.config.weight_mode == "single":
                layer.igate_preact.bias.copy_(i_b)
                layer.fgate_preact.bias.copy_(f_b)
            else:
                layer.ifgate_preact.bias.copy_(torch.cat([i_b, f_b]))
            for norm in (block.norm_mlstm, block.norm_ffn, layer.multihead_norm):
                norm.weight.add_(0.2 * torch.randn(norm.weight.shape, generator=g))


SPEC = FamilySpec(
    model_type="xlstm", label="xLSTM", config=Config, lm=LM, variants=VARIANTS, exact_variants=EXACT_VARIANTS,
    to_params=to_params, from_params=from_params, expected_shapes=expected_shapes, init_params=init_params,
    naive_operator=naive_operator, hf_class="xLSTMForCausalLM", hf_config_class="xLSTMConfig",
    # chunk_size 4: the test length 11 runs two chunks and a 3-step tail, as the torch forward does
    tiny=dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, ffn_proj_factor=1.5,
              ffn_round_up_to_multiple_of=16, chunk_size=4),
    hf_setup=hf_setup, hf_mixer="backbone.blocks.{i}.mlstm_layer", has_heads=True,
    # xLSTM-7B's shape scaled down: heads of 64 (q, k) and 128 (v) wide, chunks of 64; "single" weights
    # (transformers cannot build "fused" ones) and widths that are multiples of 64 (its cache, used by
    # a plain forward, takes the config's widths rounded up to 64)
    bench={"full": dict(vocab_size=1024, hidden_size=512, num_hidden_layers=12, num_heads=4),
           "quick": dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_heads=2, chunk_size=16)})

__all__ = ["SPEC", "Config", "LM", "MlstmLayer", "FeedForward", "Block", "VARIANTS", "EXACT_VARIANTS", "hf_setup",
           "to_params", "from_params", "expected_shapes", "init_params", "naive_operator", "mixer_parts",
           "mixer_forward", "mixer_operator", "ffn_forward", "block_forward", "lm_forward"]
