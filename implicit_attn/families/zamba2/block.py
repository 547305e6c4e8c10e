"""Zamba2 (HF ``Zamba2ForCausalLM``): the block math as pure functions.

HF runs, per layer: a Mamba layer ``h + mamba(rms_norm(h))``; a hybrid layer
``t = linear(mlp(rms_norm(attention(rms_norm([h, e])))))`` with ``e`` the token embeddings and
the attention and MLP those of the shared block it uses (plus its own low-rank adapters),
then ``h + mamba(rms_norm(h + t))``: ``t`` enters the Mamba mixer's input, not the residual
stream. Our layers split a hybrid layer in two (``Config.layer_types``): its shared attention
(mixer input ``rms_norm([h, e])`` of ``2 * d_model`` features; the residual stream passes
through unchanged and ``t`` is handed to the next layer) and its Mamba layer.

Operators: the Mamba-2 operator of each Mamba layer (every Mamba-2 variant), the explicit
attention operator (channels = heads, values with the adapters applied) of each shared
attention layer.
"""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp

from ...nn.attention import projection
from ...nn.hooks import ForwardHooks, between_layers, layer_tap, no_hook, out_hook
from ...ops import embed, full_precision, linear
from ..bamba.block import hybrid_mixers
from ..mamba.block import rms_norm
from ..mamba2 import VARIANTS
from ..mamba2.block import mixer_forward as mamba_forward
from ..mamba2.block import mixer_operator as mamba_operator

f32 = jnp.float32

# ``mixer_forward(p, x, cfg, kind, hook)`` / ``mixer_operator(p, x, cfg, kind, variant)``: the
# Mamba-2 mixer with ``cfg.mixer_config``, or the shared attention (``x (B, L, 2 d_model)``).
mixer_forward, mixer_operator = hybrid_mixers(mamba_forward, mamba_operator)


def mlp_forward(p: dict, adapters: dict, x):
    """HF ``Zamba2MLP`` of a shared block with one hybrid layer's adapter:
    ``down(gelu(g) * u)``, ``[g, u] = gate_up(x) + B A x``. ``(B, L, D) -> (B, L, D)``.

    Args:
      p: ``gate_up_proj.weight (2F, D)``, ``down_proj.weight (D, F)`` (biases if any);
      adapters: ``gate_up_proj.lora_a (r, D)``, ``gate_up_proj.lora_b (2F, r)``.
    """
    g, u = jnp.split(projection({**p, **adapters}, x, "gate_up_proj"), 2, axis=-1)
    return linear(jax.nn.gelu(g, approximate=False) * u, p["down_proj.weight"], p.get("down_proj.bias"))


def attention_params(block: dict, layer: dict) -> dict:
    """The shared attention's tensors as one hybrid layer uses them: the block's
    ``{q,k,v,o}_proj.weight`` and the layer's ``{q,k,v}_proj.lora_{a,b}`` (if any)."""
    return {**block["self_attn"], **layer["attention_adapters"]}


def zamba_functions(mixer_forward, mixer_operator, mlp_fn=mlp_forward) -> SimpleNamespace:
    """The layer and LM functions of a Zamba-like family from its mixer functions
    (``bamba.block.hybrid_mixers``: ``kind`` ``"mamba"`` or ``"attention"``) and its shared MLP
    ``mlp_fn(feed_forward params, adapters, x) -> (B, L, D)``. Returns a namespace of
    ``shared_layer``, ``mamba_layer``, ``lm_forward``, ``shared_layer_forward``,
    ``mamba_layer_forward`` (below) and the jitted ``lm_forward_jit``,
    ``shared_layer_forward_jit``, ``mamba_layer_forward_jit``, ``mixer_forward_jit``,
    ``mixer_operator_jit``."""

    def shared_layer(block: dict, layer: dict, h, emb, cfg, hook=None):
        """Our shared-attention layer (the first half of an HF hybrid layer).

        Args:
          block: the shared block ``{"input_layernorm" (2D,), "pre_ff_layernorm" (D,),
            "self_attn", "feed_forward"}``; layer: this hybrid layer's ``{"attention_adapters",
            "mlp_adapters", "linear" (D, D)}``.
          h: ``(B, L, D)`` residual stream; emb: ``(B, L, D)`` token embeddings.
          hook: optional ``(point, x) -> x`` (``hook_resid_pre``, ``mixer.hook_in`` of ``(B, L, 2D)``,
            ``mixer.hook_out`` of ``(B, heads, L, head_dim)``, ``hook_resid_post``).
        Returns:
          ``(h (B, L, D) unchanged, t (B, L, D) the block's output for the next Mamba layer's
          input, x (B, L, 2D) the attention's input)``.
        """
        hook = hook or no_hook
        h = hook("hook_resid_pre", h)
        x = hook("mixer.hook_in", rms_norm(jnp.concatenate([h, emb], axis=-1), block["input_layernorm"],
                                           cfg.rms_norm_eps))
        a = mixer_forward(attention_params(block, layer), x, cfg, "attention", out_hook(hook))
        a = rms_norm(a, block["pre_ff_layernorm"], cfg.rms_norm_eps)
        t = linear(mlp_fn(block["feed_forward"], layer["mlp_adapters"], a), layer["linear"])
        return hook("hook_resid_post", h), t, x

    def mamba_layer(layer: dict, h, shared, cfg, hook=None):
        """A Mamba layer: ``h + mamba(rms_norm(h + shared))`` (``shared``: the ``t`` of the
        hybrid layer it belongs to, or None).

        Args:
          layer: ``{"input_layernorm" (D,), "mixer"}`` (HF mixer names); h: ``(B, L, D)``.
        Returns:
          ``(h_next (B, L, D), x (B, L, D) the mixer input)``.
        """
        hook = hook or no_hook
        h = hook("hook_resid_pre", h)
        x = hook("mixer.hook_in", rms_norm(h if shared is None else h + shared, layer["input_layernorm"],
                                           cfg.rms_norm_eps))
        h = h + mixer_forward(layer["mixer"], x, cfg, "mamba", out_hook(hook))
        return hook("hook_resid_post", h), x

    def lm_forward(params: dict, ids, cfg, capture: tuple[str, ...] = (), adds=None, sets=None):
        """The full LM: ``ids (B, L) -> (logits (B, L, vocab) float32, captured)``
        (``capture`` / ``adds`` / ``sets``: ``nn.hooks.ForwardHooks``; ``hook_embed`` edits
        both the residual stream's start and the embeddings the shared blocks read)."""
        hooks = ForwardHooks(capture, adds, sets)
        emb = hooks("hook_embed", embed(params["embed_tokens"], ids))
        h, shared = emb, None
        blocks = cfg.shared_block_index
        for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
            if kind == "attention":
                h, shared, _ = shared_layer(params["shared_blocks"][blocks[i]], layer, h, emb, cfg, hooks.layer(i))
            else:
                h, _ = mamba_layer(layer, h, shared, cfg, hooks.layer(i))
                shared = None
            h, shared = between_layers((h, shared))
        h = rms_norm(h, params["final_layernorm"], cfg.rms_norm_eps)
        head = params["embed_tokens"] if params.get("lm_head") is None else params["lm_head"]
        return (h.astype(head.dtype) @ head.T).astype(f32), hooks.captured

    def shared_layer_forward(block: dict, layer: dict, h, emb, cfg, tap=None):
        """``shared_layer`` with an optional ``tap (B, heads, L, head_dim)`` added to the
        attention's per-head output: ``(t (B, L, D), x (B, L, 2D))``."""
        _, t, x = shared_layer(block, layer, h, emb, cfg, layer_tap(tap))
        return t, x

    def mamba_layer_forward(layer: dict, h, shared, cfg, tap=None):
        """``mamba_layer`` with an optional ``tap (B, channels, L)`` added to the mixer's
        operator output: ``(h_next (B, L, D), x (B, L, D))``."""
        return mamba_layer(layer, h, shared, cfg, layer_tap(tap))

    return SimpleNamespace(
        shared_layer=shared_layer, mamba_layer=mamba_layer, lm_forward=lm_forward,
        shared_layer_forward=shared_layer_forward, mamba_layer_forward=mamba_layer_forward,
        lm_forward_jit=jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture")),
        shared_layer_forward_jit=jax.jit(full_precision(shared_layer_forward), static_argnames=("cfg",)),
        mamba_layer_forward_jit=jax.jit(full_precision(mamba_layer_forward), static_argnames=("cfg",)),
        mixer_forward_jit=jax.jit(full_precision(mixer_forward), static_argnames=("cfg", "kind")),
        mixer_operator_jit=jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "kind", "variant")))


# Zamba2's: HF's Mamba-2 mixer and the fused gate/up MLP with adapters.
FUNCTIONS = zamba_functions(mixer_forward, mixer_operator)
shared_layer, mamba_layer, lm_forward = FUNCTIONS.shared_layer, FUNCTIONS.mamba_layer, FUNCTIONS.lm_forward
lm_forward_jit, mixer_forward_jit, mixer_operator_jit = (FUNCTIONS.lm_forward_jit, FUNCTIONS.mixer_forward_jit,
                                                         FUNCTIONS.mixer_operator_jit)
shared_layer_forward_jit, mamba_layer_forward_jit = FUNCTIONS.shared_layer_forward_jit, FUNCTIONS.mamba_layer_forward_jit

__all__ = ["VARIANTS", "mixer_forward", "mixer_operator", "mlp_forward", "attention_params", "zamba_functions",
           "FUNCTIONS", "shared_layer", "mamba_layer", "lm_forward", "lm_forward_jit", "shared_layer_forward_jit",
           "mamba_layer_forward_jit", "mixer_forward_jit", "mixer_operator_jit"]
