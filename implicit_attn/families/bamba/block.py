"""Bamba (HF ``BambaForCausalLM``): the block math as pure functions.

Decoder layer: ``h + mixer(rms_norm(h))``, then ``h + mlp(rms_norm(h))`` (SwiGLU); the
mixer is HF's Mamba-2 mixer (``mamba2.block``, run with ``Config.mixer_config``) or full
causal GQA softmax attention with partial RoPE (``nn.attention``). Operators: the Mamba-2
operator of each Mamba layer (every Mamba-2 variant), the explicit attention operator
(channels = heads) of each attention layer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...nn.attention import attention_forward, attention_operator
from ...nn.hooks import ForwardHooks, layer_tap, no_hook, out_hook
from ...ops import embed, full_precision, linear
from ..mamba.block import rms_norm
from ..mamba2 import VARIANTS
from ..mamba2.block import mixer_forward as mamba_forward
from ..mamba2.block import mixer_operator as mamba_operator
from .config import Config

f32 = jnp.float32


def positions(B: int, L: int):
    """``(B, L)`` int32 positions ``0..L-1`` (one document per row)."""
    return jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))


def mlp_forward(p: dict, h):
    """HF ``BambaMLP``: ``down(silu(gate(h)) * up(h))`` (biases if ``mlp_bias``). ``(B, L, D)``."""
    g = jax.nn.silu(linear(h, p["gate_proj.weight"], p.get("gate_proj.bias")))
    return linear(g * linear(h, p["up_proj.weight"], p.get("up_proj.bias")), p["down_proj.weight"],
                  p.get("down_proj.bias"))


def mixer_forward(p: dict, h, cfg: Config, kind: str, hook=None):
    """Layer kind ``kind``'s token mixer: ``(B, L, d_model) -> (B, L, d_model)``. ``hook``:
    optional function of the operator's output layout (``(B, C, L)`` Mamba, ``(B, H, L, d)``
    attention; ``mixer.hook_out``)."""
    if kind == "mamba":
        return mamba_forward(p, h, cfg.mixer_config, hook)
    return attention_forward(p, h, positions(*h.shape[:2]), cfg, hook)


def mixer_operator(p: dict, h, cfg: Config, kind: str, variant: str = "full"):
    """Layer kind ``kind``'s operator for mixer input ``h (B, L, d_model)``: the Mamba-2
    operator (``mamba2.block.mixer_operator``; channels = heads * head_dim) or the attention
    operator (channels = heads; ``variant`` ignored: attention has no ablations)."""
    if kind == "mamba":
        return mamba_operator(p, h, cfg.mixer_config, variant)
    return attention_operator(p, h, positions(*h.shape[:2]), cfg)


def decoder_layer(layer: dict, h, cfg: Config, kind: str, hook=None):
    """HF ``BambaDecoderLayer``.

    Args:
      layer: ``{"input_layernorm", "pre_ff_layernorm", "mixer", "feed_forward"}``;
      h: ``(B, L, d_model)`` residual stream; kind: ``"mamba"`` or ``"attention"``;
      hook: optional ``(point, x) -> x`` called at the layer's hook points (``nn.hooks``).
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the layer output and the mixer input.
    """
    hook = hook or no_hook
    h = hook("hook_resid_pre", h)
    hn = hook("mixer.hook_in", rms_norm(h, layer["input_layernorm"], cfg.rms_norm_eps))
    h = hook("hook_resid_mid", h + mixer_forward(layer["mixer"], hn, cfg, kind, out_hook(hook)))
    h = h + mlp_forward(layer["feed_forward"], rms_norm(h, layer["pre_ff_layernorm"], cfg.rms_norm_eps))
    return hook("hook_resid_post", h), hn


def layer_forward(layer: dict, h, cfg: Config, kind: str, tap=None):
    """``decoder_layer`` with an optional ``tap`` added to the mixer's operator output."""
    return decoder_layer(layer, h, cfg, kind, layer_tap(tap))


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """Full ``BambaForCausalLM``: ``ids (B, L) -> (logits (B, L, vocab) float32, captured)``
    (``capture`` / ``adds`` / ``sets``: hook names and edits, see ``nn.hooks.ForwardHooks``)."""
    hooks = ForwardHooks(capture, adds, sets)
    emb = params["embed_tokens"]
    h = hooks("hook_embed", embed(emb, ids))
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
        h, _ = decoder_layer(layer, h, cfg, kind, hooks.layer(i))
    h = rms_norm(h, params["final_layernorm"], cfg.rms_norm_eps)
    head = emb if params.get("lm_head") is None else params["lm_head"]
    return (h.astype(head.dtype) @ head.T).astype(f32), hooks.captured


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
layer_forward_jit = jax.jit(full_precision(layer_forward), static_argnames=("cfg", "kind"))
mixer_forward_jit = jax.jit(full_precision(mixer_forward), static_argnames=("cfg", "kind"))
mixer_operator_jit = jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "kind", "variant"))

__all__ = ["VARIANTS", "positions", "mlp_forward", "mixer_forward", "mixer_operator", "decoder_layer",
           "layer_forward", "lm_forward", "lm_forward_jit", "layer_forward_jit", "mixer_forward_jit",
           "mixer_operator_jit"]
