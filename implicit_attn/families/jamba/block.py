"""Jamba (HF ``JambaForCausalLM``): the block math as pure functions.

Decoder layer (Bamba's, ``bamba.block.hybrid_layer``): ``h + mixer(rms_norm(h))``, then
``h + ffn(rms_norm(h))``. The mixer is Mamba's S6 block with weighted RMSNorms on ``dt``,
``B`` and ``C`` (``mamba.block`` with ``Config.mixer_config``) or full causal GQA softmax
attention without positional encoding (``nn.attention``). The feed-forward part is a SwiGLU
MLP or, on the expert layers, a mixture of SwiGLU experts routed by the top
``num_experts_per_tok`` of the softmax over all experts (not renormalised). Operators: the
Mamba operator of each Mamba layer (every Mamba variant), the explicit attention operator
(channels = heads) of each attention layer.
"""
from __future__ import annotations

import jax

from ...nn.moe import experts_forward, gated_act, softmax_then_topk
from ...ops import linear
from ..bamba.block import hybrid_functions, hybrid_mixers, mlp_forward
from ..mamba import VARIANTS
from ..mamba.block import mixer_forward as mamba_forward
from ..mamba.block import mixer_operator as mamba_operator
from .config import Config


def moe_forward(p: dict, x, cfg: Config):
    """HF ``JambaSparseMoeBlock``: ``(B, L, D) -> (B, L, D)`` with ``p`` holding
    ``router.weight (E, D)``, ``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj (E, D, I)``."""
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    weights, experts = softmax_then_topk(linear(t, p["router.weight"]), cfg.num_experts_per_tok)
    out = experts_forward(t, weights.astype(x.dtype), experts, p["experts.gate_up_proj"], p["experts.down_proj"],
                          gated_act(jax.nn.silu))
    return out.reshape(B, L, D)


def ffn_forward(p: dict, x, cfg: Config):
    """The layer's feed-forward part: the MoE if its params have a router, else the MLP."""
    return moe_forward(p, x, cfg) if "router.weight" in p else mlp_forward(p, x)


# Mamba's mixer (channels = the inner width) on the Mamba layers, attention on the others.
mixer_forward, mixer_operator = hybrid_mixers(mamba_forward, mamba_operator)


# HF ``JambaMambaDecoderLayer`` / ``JambaAttentionDecoderLayer`` / ``JambaForCausalLM``.
FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, ffn_forward)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "moe_forward", "ffn_forward", "mixer_forward", "mixer_operator", "decoder_layer",
           "layer_forward", "lm_forward", "lm_forward_jit", "layer_forward_jit", "mixer_forward_jit",
           "mixer_operator_jit"]
