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
import jax.numpy as jnp

from ...nn.hooks import ForwardHooks, layer_tap, no_hook, out_hook
from ...nn.moe import experts_forward, gated_act, topk_then_softmax
from ...ops import embed, full_precision, linear
from ..bamba.block import mixer_forward, mixer_operator
from ..mamba.block import rms_norm
from ..mamba2 import VARIANTS
from .config import Config

f32 = jnp.float32


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


def decoder_layer(layer: dict, h, cfg: Config, kind: str, hook=None):
    """HF ``GraniteMoeHybridDecoderLayer``.

    Args:
      layer: ``{"input_layernorm", "pre_ff_layernorm" (HF post_attention_layernorm), "mixer",
        "feed_forward" (HF block_sparse_moe.* and shared_mlp.*)}``;
      h: ``(B, L, d_model)`` residual stream; kind: ``"mamba"`` or ``"attention"``;
      hook: optional ``(point, x) -> x`` called at the layer's hook points (``nn.hooks``).
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the layer output and the mixer input.
    """
    hook = hook or no_hook
    r = jnp.asarray(cfg.residual_multiplier, h.dtype)
    h = hook("hook_resid_pre", h)
    hn = hook("mixer.hook_in", rms_norm(h, layer["input_layernorm"], cfg.rms_norm_eps))
    h = hook("hook_resid_mid", h + mixer_forward(layer["mixer"], hn, cfg, kind, out_hook(hook)) * r)
    h = h + ffn_forward(layer["feed_forward"], rms_norm(h, layer["pre_ff_layernorm"], cfg.rms_norm_eps), cfg) * r
    return hook("hook_resid_post", h), hn


def layer_forward(layer: dict, h, cfg: Config, kind: str, tap=None):
    """``decoder_layer`` with an optional ``tap`` added to the mixer's operator output."""
    return decoder_layer(layer, h, cfg, kind, layer_tap(tap))


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """Full ``GraniteMoeHybridForCausalLM``: ``ids (B, L) -> (logits (B, L, vocab) float32,
    captured)`` (``capture`` / ``adds`` / ``sets``: hook names and edits, ``nn.hooks.ForwardHooks``;
    ``hook_embed`` is the embedding before ``embedding_multiplier``)."""
    hooks = ForwardHooks(capture, adds, sets)
    emb = params["embed_tokens"]
    h = hooks("hook_embed", embed(emb, ids)) * jnp.asarray(cfg.embedding_multiplier, emb.dtype)
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
        h, _ = decoder_layer(layer, h, cfg, kind, hooks.layer(i))
    h = rms_norm(h, params["final_layernorm"], cfg.rms_norm_eps)
    head = emb if params.get("lm_head") is None else params["lm_head"]
    logits = h.astype(head.dtype) @ head.T
    return (logits / jnp.asarray(cfg.logits_scaling, logits.dtype)).astype(f32), hooks.captured


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
layer_forward_jit = jax.jit(full_precision(layer_forward), static_argnames=("cfg", "kind"))

__all__ = ["VARIANTS", "shared_mlp_forward", "moe_forward", "ffn_forward", "decoder_layer", "layer_forward",
           "lm_forward", "lm_forward_jit", "layer_forward_jit", "mixer_forward", "mixer_operator"]
