"""Bamba (HF ``BambaForCausalLM``): the block math as pure functions.

Decoder layer: ``h + mixer(rms_norm(h))``, then ``h + mlp(rms_norm(h))`` (SwiGLU); the
mixer is HF's Mamba-2 mixer (``mamba2.block``, run with ``Config.mixer_config``) or full
causal GQA softmax attention with partial RoPE (``nn.attention``). Operators: the Mamba-2
operator of each Mamba layer (every Mamba-2 variant), the explicit attention operator
(channels = heads) of each attention layer.
"""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp

from ...nn.attention import attention_forward, attention_operator
from ...nn.hooks import ForwardHooks, between_layers, layer_tap, no_hook, out_hook
from ...ops import embed, full_precision, linear, rounded
from ..mamba.block import rms_norm
from ..mamba2 import VARIANTS
from ..mamba2.block import mixer_forward as mamba_forward
from ..mamba2.block import mixer_operator as mamba_operator

f32 = jnp.float32


def positions(B: int, L: int):
    """``(B, L)`` int32 positions ``0..L-1`` (one document per row)."""
    return jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))


def mlp_forward(p: dict, h):
    """HF ``BambaMLP``: ``down(silu(gate(h)) * up(h))`` (biases if ``mlp_bias``). ``(B, L, D)``."""
    g = jax.nn.silu(linear(h, p["gate_proj.weight"], p.get("gate_proj.bias")))
    return linear(g * linear(h, p["up_proj.weight"], p.get("up_proj.bias")), p["down_proj.weight"],
                  p.get("down_proj.bias"))


def hybrid_mixers(mamba_forward, mamba_operator):
    """The per-kind mixer functions of a hybrid whose Mamba layers run ``mamba_forward(p, h,
    mixer_cfg, hook)`` / ``mamba_operator(p, h, mixer_cfg, variant)`` with ``cfg.mixer_config``
    and whose attention layers are ``nn.attention``'s full causal attention: returns
    ``(mixer_forward, mixer_operator)``."""
    def mixer_forward(p: dict, h, cfg, kind: str, hook=None):
        """Layer kind ``kind``'s token mixer: ``(B, L, d_model) -> (B, L, d_model)``. ``hook``:
        optional function of the operator's output layout (``(B, C, L)`` Mamba,
        ``(B, H, L, d)`` attention; ``mixer.hook_out``)."""
        if kind == "mamba":
            return mamba_forward(p, h, cfg.mixer_config, hook)
        return attention_forward(p, h, positions(*h.shape[:2]), cfg, hook)

    def mixer_operator(p: dict, h, cfg, kind: str, variant: str = "full"):
        """Layer kind ``kind``'s operator for mixer input ``h (B, L, d_model)``: the Mamba
        operator, or the attention operator (channels = heads; ``variant`` ignored: attention
        has no ablations)."""
        if kind == "mamba":
            return mamba_operator(p, h, cfg.mixer_config, variant)
        return attention_operator(p, h, positions(*h.shape[:2]), cfg)

    return mixer_forward, mixer_operator


# Bamba's: the Mamba-2 mixer (channels = heads * head_dim) and attention.
mixer_forward, mixer_operator = hybrid_mixers(mamba_forward, mamba_operator)


def hybrid_layer(layer: dict, h, cfg, kind: str, hook, mixer_fn, ffn_fn, residual_scale=None):
    """The decoder layer of Bamba and its relatives: ``h + s * mixer(rms_norm(h))``, then
    ``h + s * ffn(rms_norm(h))`` (``s = residual_scale``, none if ``None``); where ``layer`` has
    ``"post_mixer_norm"`` / ``"post_ffn_norm"`` weights (LFM3's sandwich norms), the mixer's /
    feed-forward part's output is RMS-normed with them before it joins the residual stream.

    Args:
      layer: ``{"input_layernorm", "pre_ff_layernorm", "mixer", "feed_forward"}`` (and the
        optional post norms);
      h: ``(B, L, d_model)`` residual stream; kind: the layer's mixer kind;
      hook: optional ``(point, x) -> x`` called at the layer's hook points (``nn.hooks``);
      mixer_fn: ``(p, h, cfg, kind, out_hook) -> (B, L, d_model)``;
      ffn_fn: ``(p, x, cfg) -> (B, L, d_model)``.
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the layer output and the mixer input.
    """
    hook = hook or no_hook
    scale = (lambda t: t) if residual_scale is None else (lambda t: t * jnp.asarray(residual_scale, t.dtype))

    def post(name, t):
        return t if name not in layer else rms_norm(t, layer[name], cfg.rms_norm_eps, cfg.norm_weight_in_float32)

    h = hook("hook_resid_pre", h)
    hn = hook("mixer.hook_in", rms_norm(h, layer["input_layernorm"], cfg.rms_norm_eps, cfg.norm_weight_in_float32))
    h = hook("hook_resid_mid", h + scale(post("post_mixer_norm", mixer_fn(layer["mixer"], hn, cfg, kind,
                                                                         out_hook(hook)))))
    x = rms_norm(h, layer["pre_ff_layernorm"], cfg.rms_norm_eps, cfg.norm_weight_in_float32)
    h = h + scale(post("post_ffn_norm", ffn_fn(layer["feed_forward"], x, cfg)))
    return hook("hook_resid_post", h), hn


def hybrid_lm(params: dict, ids, cfg, layer_fn, capture=(), adds=None, sets=None, embedding_scale=None,
              logits_divisor=None, logits_multiplier=None):
    """The LM of Bamba and its relatives: embeddings (times ``embedding_scale``; ``hook_embed``
    is before it), ``layer_fn(layer, h, cfg, kind, hook) -> (h, hn)`` per layer, the final
    RMSNorm, the head (tied to the embeddings if ``lm_head`` is None), logits divided by
    ``logits_divisor`` and multiplied by ``logits_multiplier``. ``ids (B, L) -> (logits (B, L,
    vocab) float32, captured)``."""
    hooks = ForwardHooks(capture, adds, sets)
    emb = params["embed_tokens"]
    h = hooks("hook_embed", embed(emb, ids))
    if embedding_scale is not None:
        h = rounded(h * jnp.asarray(embedding_scale, h.dtype))  # HF's is a stored tensor
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
        h = between_layers(layer_fn(layer, h, cfg, kind, hooks.layer(i))[0])
    h = rms_norm(h, params["final_layernorm"], cfg.rms_norm_eps, cfg.norm_weight_in_float32)
    head = emb if params.get("lm_head") is None else params["lm_head"]
    logits = h.astype(head.dtype) @ head.T
    if logits_divisor is not None:
        logits = logits / jnp.asarray(logits_divisor, logits.dtype)
    if logits_multiplier is not None:
        logits = logits * jnp.asarray(logits_multiplier, logits.dtype)
    return logits.astype(f32), hooks.captured


def mlp_ffn(p: dict, x, cfg):
    """``mlp_forward`` as a ``hybrid_layer`` feed-forward function."""
    return mlp_forward(p, x)


def hybrid_functions(mixer_forward, mixer_operator, ffn_fn, residual_scale=None, embedding_scale=None,
                     logits_divisor=None, layer_fn=hybrid_layer, logits_multiplier=None) -> SimpleNamespace:
    """A hybrid family's entry points from its mixer functions (``hybrid_mixers``), its
    feed-forward function ``(p, x, cfg) -> (B, L, d_model)``, its scales, each ``cfg ->
    float`` or None (``hybrid_layer``'s ``residual_scale``, ``hybrid_lm``'s ``embedding_scale``,
    ``logits_divisor`` and ``logits_multiplier``), and its decoder layer (``hybrid_layer``'s signature).

    Returns a namespace of ``decoder_layer(layer, h, cfg, kind, hook=None) -> (h_next, hn)``,
    ``layer_forward(layer, h, cfg, kind, tap=None) -> (h_next, hn)`` (``tap`` added to the
    mixer's operator output), ``lm_forward(params, ids, cfg, capture=(), adds=None, sets=None)
    -> (logits (B, L, vocab) float32, captured)``, and the jitted ``lm_forward_jit``,
    ``layer_forward_jit``, ``mixer_forward_jit``, ``mixer_operator_jit``.
    """
    scale = lambda f, cfg: None if f is None else f(cfg)

    def decoder_layer(layer: dict, h, cfg, kind: str, hook=None):
        """One decoder layer (``layer_fn``, default ``bamba.block.hybrid_layer``): ``(h_next,
        mixer input)``, both ``(B, L, d_model)``."""
        return layer_fn(layer, h, cfg, kind, hook, mixer_forward, ffn_fn, scale(residual_scale, cfg))

    def layer_forward(layer: dict, h, cfg, kind: str, tap=None):
        """``decoder_layer`` with an optional ``tap`` added to the mixer's operator output."""
        return decoder_layer(layer, h, cfg, kind, layer_tap(tap))

    def lm_forward(params: dict, ids, cfg, capture: tuple[str, ...] = (), adds=None, sets=None):
        """The full LM (``bamba.block.hybrid_lm``): ``ids (B, L) -> (logits (B, L, vocab)
        float32, captured)`` (``capture`` / ``adds`` / ``sets``: ``nn.hooks.ForwardHooks``)."""
        return hybrid_lm(params, ids, cfg, decoder_layer, capture, adds, sets, scale(embedding_scale, cfg),
                         scale(logits_divisor, cfg), scale(logits_multiplier, cfg))

    return SimpleNamespace(
        decoder_layer=decoder_layer, layer_forward=layer_forward, lm_forward=lm_forward,
        lm_forward_jit=jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture")),
        layer_forward_jit=jax.jit(full_precision(layer_forward), static_argnames=("cfg", "kind")),
        mixer_forward_jit=jax.jit(full_precision(mixer_forward), static_argnames=("cfg", "kind")),
        mixer_operator_jit=jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "kind", "variant")))


# HF ``BambaDecoderLayer`` / ``BambaForCausalLM``: the SwiGLU MLP, no scales.
FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, mlp_ffn)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "positions", "mlp_forward", "mlp_ffn", "hybrid_mixers", "hybrid_layer", "hybrid_lm",
           "hybrid_functions", "FUNCTIONS", "mixer_forward", "mixer_operator", "decoder_layer", "layer_forward",
           "lm_forward", "lm_forward_jit", "layer_forward_jit", "mixer_forward_jit", "mixer_operator_jit"]
