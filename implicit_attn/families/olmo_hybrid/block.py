"""OLMo-Hybrid (HF ``OlmoHybridForCausalLM``): the block math as pure functions.

Two layer kinds with different residual structures:

* Gated DeltaNet layers (HF ``OlmoHybridLinearAttentionDecoderLayer``, pre-norm):
  ``h + mixer(norm(h))``, then ``h + mlp(norm(h))``. The mixer is Qwen3-Next's Gated DeltaNet
  (``qwen3_next.block.delta_forward`` / ``delta_operator``, same exact operator and variants) with
  one projection per input (``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` for the output gate,
  ``b_proj``, ``a_proj``), write strengths ``2 sigmoid(b)`` in [0, 2] where
  ``linear_allow_neg_eigval`` (so the transition ``I - b k kᵀ`` has eigenvalues down to -1), and
  the gated output norm at eps 1e-5.
* Attention layers (HF ``OlmoHybridAttentionDecoderLayer``, OLMo-3's post-norm):
  ``h + norm(attention(h))``, then ``h + norm(mlp(h))``; queries and keys RMS-normed over all
  heads together before the split into heads, full RoPE or none. Operator: the explicit
  attention (channels = heads).

Norms: ``w * x / rms(x)`` in float32. MLP: SwiGLU.
"""
from __future__ import annotations

import jax.numpy as jnp

from ...nn.attention import attend, operator_of_parts, rotary, segment_ids
from ...nn.hooks import no_hook, out_hook
from ...operator import AttentionOperator
from ...ops import linear
from ..bamba.block import hybrid_functions, mlp_ffn, positions
from ..mamba.block import rms_norm as mamba_rms_norm
from ..qwen3_next.block import EXACT_VARIANTS, VARIANTS, delta_forward, delta_operator
from .config import Config

f32 = jnp.float32


def rms_norm(x, w, eps: float):
    """HF ``OlmoHybridRMSNorm``: ``w * x / rms(x)`` in float32, cast back. ``(..., D)``."""
    return mamba_rms_norm(x, w, eps, weight_in_float32=True)


def attention_parts(p: dict, h, cfg: Config) -> dict:
    """Queries (normed over all heads, rotated, scaled) ``(B, H, L, d)``, keys ``(B, KV, L, d)``,
    values ``(B, KV, L, d)`` and document ids ``seg (B, L)``."""
    B, L, _ = h.shape
    d = cfg.head_dim
    pos = positions(B, L)
    q = rms_norm(linear(h, p["q_proj.weight"], p.get("q_proj.bias")), p["q_norm.weight"], cfg.rms_norm_eps)
    k = rms_norm(linear(h, p["k_proj.weight"], p.get("k_proj.bias")), p["k_norm.weight"], cfg.rms_norm_eps)
    v = linear(h, p["v_proj.weight"], p.get("v_proj.bias"))
    heads = lambda t, n: jnp.swapaxes(t.reshape(B, L, n, d), 1, 2)
    q, k = rotary(heads(q, cfg.num_attention_heads), pos, cfg), rotary(heads(k, cfg.num_key_value_heads), pos, cfg)
    return dict(q=q * jnp.asarray(cfg.attention_scale, q.dtype), k=k, v=heads(v, cfg.num_key_value_heads),
                seg=segment_ids(pos))


def attention_forward(p: dict, h, cfg: Config, hook=None):
    """HF ``OlmoHybridAttention.forward``: ``(B, L, D) -> (B, L, D)``. ``hook``: optional on the
    per-head output ``(B, H, L, d)``."""
    o = attend(attention_parts(p, h, cfg), cfg)
    if hook is not None:
        o = hook(o)
    B, H, L, d = o.shape
    return linear(jnp.swapaxes(o, 1, 2).reshape(B, L, H * d), p["o_proj.weight"], p.get("o_proj.bias"))


def attention_operator(p: dict, h, cfg: Config) -> AttentionOperator:
    """The explicit attention operator (channels = heads)."""
    return operator_of_parts(attention_parts(p, h, cfg), cfg)


def mixer_forward(p: dict, h, cfg: Config, kind: str, hook=None):
    """Layer kind ``kind``'s token mixer: ``(B, L, D) -> (B, L, D)``."""
    return delta_forward(p, h, cfg, hook) if kind == "delta" else attention_forward(p, h, cfg, hook)


def mixer_operator(p: dict, h, cfg: Config, kind: str, variant: str = "full"):
    """Layer kind ``kind``'s operator (attention ignores ``variant``)."""
    return delta_operator(p, h, cfg, variant) if kind == "delta" else attention_operator(p, h, cfg)


def olmo_layer(layer: dict, h, cfg: Config, kind: str, hook, mixer_fn, ffn_fn, residual_scale=None):
    """One decoder layer (``bamba.block.hybrid_layer``'s signature; ``residual_scale`` unused):
    pre-norm on DeltaNet layers, post-norm on attention layers (the
    mixer input is then ``h`` itself). Returns ``(h_next, mixer input)``, both ``(B, L, D)``."""
    hook = hook or no_hook
    eps = cfg.rms_norm_eps
    h = hook("hook_resid_pre", h)
    if kind == "delta":
        x = hook("mixer.hook_in", rms_norm(h, layer["input_layernorm"], eps))
        h = hook("hook_resid_mid", h + mixer_fn(layer["mixer"], x, cfg, kind, out_hook(hook)))
        h = h + ffn_fn(layer["mlp"], rms_norm(h, layer["post_attention_layernorm"], eps), cfg)
    else:
        x = hook("mixer.hook_in", h)
        y = mixer_fn(layer["mixer"], x, cfg, kind, out_hook(hook))
        h = hook("hook_resid_mid", h + rms_norm(y, layer["post_attention_layernorm"], eps))
        h = h + rms_norm(ffn_fn(layer["mlp"], h, cfg), layer["post_feedforward_layernorm"], eps)
    return hook("hook_resid_post", h), x


# the LM: Bamba's (embeddings, layers, final RMSNorm, head; its final norm applies the weight after
# the cast back, HF's before: the same in float32)
FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, mlp_ffn, layer_fn=olmo_layer)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "EXACT_VARIANTS", "rms_norm", "attention_parts", "attention_forward", "attention_operator",
           "mixer_forward", "mixer_operator", "olmo_layer", "FUNCTIONS", "decoder_layer", "layer_forward", "lm_forward",
           "lm_forward_jit", "layer_forward_jit", "mixer_forward_jit", "mixer_operator_jit"]
