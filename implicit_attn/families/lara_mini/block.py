"""LaraMini (HF ``LaraMiniForCausalLM``): the block math as pure functions.

Decoder layer (Bamba's, ``bamba.block.hybrid_layer``): ``h + mixer(norm(h))``, then
``h + moe(norm(h))``, RMSNorms with a plain weight (``w x / rms(x)``). Mixers:

* Gated DeltaNet (HF ``LaraMiniGatedDeltaNet``, Qwen3.5's): ``qwen3_next.block.delta_forward`` /
  ``delta_operator`` (same exact operator and variants) with the input projections read from
  the one stored ``in_proj`` (rows ``[q | k | v | z | b | a]``, ``Config.projections = "fused"``)
  and the gated norm's weight from ``out_norm``.
* Attention (HF ``LaraMiniAttention``, Qwen3's): GQA with an RMSNorm over each head's queries
  and keys, no output gate; sliding-window layers with RoPE over the whole head, full layers
  without positional encoding (``lfm2.block``'s attention functions, which read
  ``Config.window`` and ``Config.rope_frequencies``). Operator: the explicit attention
  (channels = heads).

FFN: a softmax top-k mixture of SwiGLU experts (router logits in float32, top-k weights
renormalised if ``norm_topk_prob``) plus a shared SwiGLU expert added without a gate.

The RMSNorms apply their weight in float32 before the cast back, as HF's do
(``Config.norm_weight_in_float32``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...nn.moe import experts_forward, gated_act, softmax_then_topk
from ...ops import linear
from ..bamba.block import hybrid_functions, mlp_forward
from ..bamba.checkpoint import sub
from ..lfm2.block import attention_forward, attention_operator
from ..qwen3_next.block import EXACT_VARIANTS, VARIANTS, delta_forward, delta_operator
from .config import Config

f32 = jnp.float32


def mixer_forward(p: dict, h, cfg: Config, kind: str, hook=None):
    """Layer kind ``kind``'s token mixer (``"delta"``, ``"sliding"``, ``"attention"``): ``(B, L, D)
    -> (B, L, D)``. ``hook``: optional on the operator output (``(B, C, L)`` DeltaNet, ``(B, H, L,
    d)`` attention)."""
    return delta_forward(p, h, cfg, hook) if kind == "delta" else attention_forward(p, h, cfg, kind, hook)


def mixer_operator(p: dict, h, cfg: Config, kind: str, variant: str = "full"):
    """Layer kind ``kind``'s operator (attention ignores ``variant``)."""
    return delta_operator(p, h, cfg, variant) if kind == "delta" else attention_operator(p, h, cfg, kind)


def moe_forward(p: dict, x, cfg: Config):
    """HF ``LaraMiniSparseMoeBlock``: ``(B, L, D) -> (B, L, D)``; experts stacked as stored,
    ``experts.gate_up_proj (E, 2I, D)`` (gate rows, then up), ``experts.down_proj (E, D, I)``."""
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    weights, experts = softmax_then_topk(linear(t.astype(f32), p["gate.weight"].astype(f32)), cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    routed = experts_forward(t, weights.astype(t.dtype), experts, p["experts.gate_up_proj"], p["experts.down_proj"],
                             gated_act(jax.nn.silu))
    return (routed + mlp_forward(sub(p, "shared_expert."), t)).reshape(B, L, D)


FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, moe_forward)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "EXACT_VARIANTS", "mixer_forward", "mixer_operator", "moe_forward", "FUNCTIONS",
           "decoder_layer", "layer_forward", "lm_forward", "lm_forward_jit", "layer_forward_jit", "mixer_forward_jit",
           "mixer_operator_jit"]
