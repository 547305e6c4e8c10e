"""GraniteMoeHybrid (HF ``GraniteMoeHybridForCausalLM``, Granite-4.0-H): the block math
as pure functions.

Decoder layer: ``h + r * mixer(rms_norm(h))``, then ``h + r * (moe(x) + shared_mlp(x))`` with
``x = rms_norm(h)`` and ``r = residual_multiplier``; the embeddings are scaled by
``embedding_multiplier`` and the logits divided by ``logits_scaling``. The mixers are
Bamba's (``bamba.block``): HF's Mamba-2 mixer, or full causal GQA attention whose logits
are scaled by ``attention_multiplier`` (RoPE only with ``position_embedding_type="rope"``).

Operators: the residual multiplier scales the mixer's contribution after ``out_proj`` /
``o_proj``, so, like those projections, it is outside ``H``; the operators are Bamba's.
"""
from __future__ import annotations

import jax

from ...nn.moe import experts_forward, gated_act, topk_then_softmax
from ...ops import linear
from ..bamba.block import hybrid_functions, mixer_forward, mixer_operator
from ..mamba2 import VARIANTS
from .config import Config


def shared_mlp_forward(p: dict, x):
    """HF ``GraniteMoeHybridMLP``: ``output_linear(silu(a) * b)``, ``[a, b] = input_linear(x)``.
    ``(..., D) -> (..., D)``."""
    return linear(gated_act(jax.nn.silu)(linear(x, p["shared_mlp.input_linear.weight"])),
                  p["shared_mlp.output_linear.weight"])


def moe_forward(p: dict, x, cfg: Config):
    """HF ``GraniteMoeHybridMoE``: the top ``num_experts_per_tok`` of the router logits,
    weighted by their softmax, each a SwiGLU expert. ``(B, L, D) -> (B, L, D)``."""
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    weights, experts = topk_then_softmax(linear(t, p["block_sparse_moe.router.layer.weight"]),
                                         cfg.num_experts_per_tok)
    out = experts_forward(t, weights.astype(x.dtype), experts, p["block_sparse_moe.input_linear.weight"],
                          p["block_sparse_moe.output_linear.weight"], gated_act(jax.nn.silu))
    return out.reshape(B, L, D)


def ffn_forward(p: dict, x, cfg: Config):
    """The feed-forward part of a layer: ``moe(x) + shared_mlp(x)`` (the shared MLP alone
    when ``num_local_experts == 0``). ``(B, L, D) -> (B, L, D)``."""
    out = shared_mlp_forward(p, x)
    return moe_forward(p, x, cfg) + out if cfg.num_local_experts else out


# HF ``GraniteMoeHybridDecoderLayer`` / ``GraniteMoeHybridForCausalLM``: the MoE and shared
# MLP, ``residual_multiplier``, ``embedding_multiplier`` (``hook_embed`` is before it) and
# ``logits_scaling``.
FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, ffn_forward, lambda c: c.residual_multiplier,
                             lambda c: c.embedding_multiplier, lambda c: c.logits_scaling)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit

__all__ = ["VARIANTS", "shared_mlp_forward", "moe_forward", "ffn_forward", "decoder_layer", "layer_forward",
           "lm_forward", "lm_forward_jit", "layer_forward_jit", "mixer_forward", "mixer_operator"]
