"""RWKV-7 ("Goose", flash-linear-attention's ``RWKV7ForCausalLM``): the block math as pure functions
and the exact implicit operator of each time mix.

Layers as RWKV-6's (``rwkv6.block``), with a value residual: layer 0's values ``v_first`` are mixed
into every later layer's values. The time mix therefore reads ``[x, v_first]`` (its input
``attn_norm(h) (B, L, C)`` and the value residual ``(B, L, V)``, zeros for layer 0): that pair is
its mixer input (``mixer.hook_in``, ``(B, L, C + V)``).

Time mix, with ``d_t = x_{t-1} - x_t``: ``x_* = x + d x_*`` for r, w, k, v, a, g; ``r = r_proj``,
``k = k_proj``, ``v = v_proj`` (layers > 0: ``v + (v_first - v) sigmoid(v_lora(x_v))``), the
in-context learning rate ``a = sigmoid(a_lora(x_a))``, the gate ``g = g_lora(x_g)`` (a sigmoid
inside the LoRA), log decays ``log w = -e^{-1/2} sigmoid(w_lora(x_w))`` per key dimension, the
removal key ``kk = normalize(k k_k)`` per head, ``k <- k (1 + (a - 1) k_a)``. Per head the state
``S (V, K)`` runs ``S_t = S_{t-1} (Diag(w_t) - kk_t (kk_t a_t)^T) + v_t k_t^T`` and is read after
the update, ``o_t = S_t r_t`` (``ops.dplr_rule``). Output: ``o_proj((GroupNorm_H(o) + (sum_k r k
r_k) v) g)``.

Operator (channels = the value width): as RWKV-6's (``rwkv6.block.head_operator``) with ``M_h`` the
DPLR matrix; the ``r_k`` term, read outside the norm, adds ``diag(g beta_h)`` (on the head-centred
values; the head mean it leaves goes to the offset).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...nn.hooks import ForwardHooks, apply_out_hook, layer_tap, no_hook, out_hook
from ...operator import Mamba2Operator
from ...ops import embed, from_first, full_precision, linear, mark_nan, zero_nan
from ..rwkv6.block import (LAYER_KEYS, dplr_outputs, first_norm, head_logits, head_operator, heads, lora, norm, normed,
                           shift_delta)
from .config import Config

VARIANTS = ("full", "no_gate", "no_low_rank", "no_bonus")
EXACT_VARIANTS = ("full",)
f32 = jnp.float32
LOG_DECAY_SCALE = 0.6065306597126334  # e^{-1/2}: log decays in (-e^{-1/2}, 0)
# Chunks of 16 with that bound let the chunk factors be matmuls (ops.dplr_parts; 7x faster on CPU)
CHUNK = 16
MIX_NAMES = ("r", "w", "k", "v", "a", "g")


def split_input(x_ext, cfg: Config):
    """The time mix's input ``(B, L, C + V)`` as ``(x (B, L, C), v_first (B, L, V))``."""
    C = cfg.hidden_size
    return x_ext[..., :C], x_ext[..., C:]


def unit(x, fuse_norm: bool):
    """``x`` normalised over its last axis: fla's ``l2norm`` (``x / sqrt(sum x^2 + 1e-6)``) or, without
    ``fuse_norm``, ``F.normalize`` (``x / max(|x|, 1e-12)``); float32."""
    s = jnp.sum(x * x, axis=-1, keepdims=True)
    return x / (jnp.sqrt(s + 1e-6) if fuse_norm else jnp.maximum(jnp.sqrt(s), 1e-12))


def time_mix_parts(p: dict, x_ext, cfg: Config, first=None) -> dict:
    """Intermediates of the RWKV-7 time mix for its input ``x_ext = [x, v_first] (B, L, C + V)``:
    ``r, k, log_w, kk, a (B, H, L, K)``, ``v (B, H, L, V)`` (after the value residual), ``outside (B,
    H, L)`` (``sum_k r k r_k``), ``gate (B, L, V)``, ``v_own (B, L, V)`` (this layer's values before
    the residual: ``v_first`` when this is layer 0), ``bad (B, H, L)``; float32, NaN set to 0 except
    in ``bad``.

    ``first``: whether this is layer 0 (its values are its own; a bool, or a traced one, where
    layer 0 carries zero ``v_lora`` weights); None: layer 0 iff ``p`` has no
    ``v_lora``.
    """
    x, v_first = split_input(x_ext, cfg)
    H = cfg.num_heads
    d = shift_delta(x)
    xs = {n: x + d * p["x_" + n].reshape(-1) for n in MIX_NAMES}
    r = linear(xs["r"], p["r_proj.weight"]).astype(f32)
    k = linear(xs["k"], p["k_proj.weight"]).astype(f32)
    v_own = linear(xs["v"], p["v_proj.weight"]).astype(f32)
    log_w = -LOG_DECAY_SCALE * jax.nn.sigmoid(lora(xs["w"], p, "w_lora.", jnp.tanh).astype(f32))
    a = jax.nn.sigmoid(lora(xs["a"], p, "a_lora.").astype(f32))
    gate = lora(xs["g"], p, "g_lora.", jax.nn.sigmoid, bias=False).astype(f32)
    if first is None:
        first = "v_lora.lora.0.weight" not in p
    if first is True:
        v = v_own
    else:
        mixed = v_own + (v_first.astype(f32) - v_own) * jax.nn.sigmoid(lora(xs["v"], p, "v_lora.").astype(f32))
        v = mixed if first is False else jnp.where(first, v_own, mixed)
    kk = unit(heads(k * p["k_k"].astype(f32), H), cfg.fuse_norm)
    k = k * (1.0 + (a - 1.0) * p["k_a"].astype(f32))
    rh, kh, ah = heads(r, H), heads(k, H), heads(a, H)
    outside = jnp.einsum("bhlk,hk->bhl", rh * kh, p["r_k"].astype(f32))
    vh, lw = heads(v, H), heads(log_w, H)
    # The state input v k^T overflows (finite but huge k, v: its largest entry is max|k| max|v|)
    # or holds NaN: the state is NaN from there on (ops.nan), and k, v are zeroed there for the
    # computation (a masked product would carry the overflow into earlier rows as 0 * inf).
    size = jnp.max(jnp.abs(kh), axis=-1) * jnp.max(jnp.abs(vh), axis=-1)
    state_bad = from_first(~jnp.isfinite(size) | jnp.isnan(lw).any(-1) | jnp.isnan(kk).any(-1)
                           | jnp.isnan(ah).any(-1), axis=2)
    bad = state_bad | jnp.isnan(rh).any(-1) | jnp.isnan(outside)
    return dict(r=zero_nan(rh), k=zero_nan(kh, state_bad[..., None]), v=zero_nan(vh, state_bad[..., None]),
                log_w=zero_nan(lw), kk=zero_nan(kk),
                a=zero_nan(ah), outside=zero_nan(outside), gate=gate, v_own=v_own, bad=bad)


def recurrence(q: dict, low_rank: bool = True):
    """``o (B, H, L, V)`` float32 of the DPLR recurrence of ``time_mix_parts`` ``q`` (NaN rows where
    ``q["bad"]``); ``low_rank=False`` leaves out the ``-kk (kk a)^T`` term."""
    a, b = (-q["kk"], q["kk"] * q["a"]) if low_rank else (None, None)
    o = dplr_outputs(q["r"], q["k"], q["v"], q["log_w"], a, b, after=True, chunk=CHUNK, decay_floor=-LOG_DECAY_SCALE)
    return mark_nan(o, q["bad"][..., None])


def time_mix_inner(p: dict, x_ext, cfg: Config, first=None):
    """``((GroupNorm(o) + outside v) g (B, L, V) float32, v_own (B, L, V))``: the time mix's output
    before ``o_proj`` and this layer's own values (the value residual, if this is layer 0)."""
    q = time_mix_parts(p, x_ext, cfg, first)
    y, _ = normed(recurrence(q), p, cfg.group_norm_eps)
    B, H, L, V = q["v"].shape
    extra = jnp.swapaxes(q["outside"][..., None] * mark_nan(q["v"], q["bad"][..., None]), 1, 2).reshape(B, L, H * V)
    return (y + extra) * q["gate"], q["v_own"]


def time_mix_forward(p: dict, x_ext, cfg: Config, hook=None):
    """fla ``RWKV7Attention.forward`` on ``[x, v_first] (B, L, C + V)`` -> ``(B, L, C)``. ``hook``:
    optional ``(B, V, L) -> (B, V, L)`` on the output before ``o_proj`` (``mixer.hook_out``)."""
    y, _ = time_mix_inner(p, x_ext, cfg)
    y = apply_out_hook(y, hook)
    return linear(y.astype(x_ext.dtype), p["o_proj.weight"])


def channel_mix_forward(p: dict, x, cfg) -> jax.Array:
    """fla ``RWKV7FeedForward``: ``value(relu(key(x + d x_k))^2)``, ``(B, L, C) -> (B, L, C)``."""
    d = shift_delta(x)
    return linear(jnp.square(jax.nn.relu(linear(x + d * p["x_k"], p["key.weight"]))), p["value.weight"])


def time_mix_operator(p: dict, x_ext, cfg: Config, variant: str = "full") -> Mamba2Operator:
    """The RWKV-7 time mix's operator for its input ``[x, v_first] (B, L, C + V)`` (channels = the
    value width).

    ``"full"`` (exact): ``diag(g w / sigma_h) M_h + diag(g beta_h)`` on the head-centred values
    (``beta = sum_k r k r_k``), offset ``g (b + beta mean_h(v))``; ``"no_gate"``: without ``g``;
    ``"no_low_rank"``: ``M_h`` of the diagonal transition alone (no in-context removal ``-kk (kk
    a)^T``); ``"no_bonus"``: without the ``r_k`` term. ``output`` is always the block's own.
    """
    if variant not in VARIANTS:
        raise ValueError(f"RWKV-7 variant must be one of {VARIANTS}, got {variant!r}")
    q = time_mix_parts(p, x_ext, cfg)
    o = recurrence(q)
    low_rank = variant != "no_low_rank"
    core_args = dict(q=q["r"], k=q["k"], log_w=q["log_w"], after=True, outside=q["outside"], chunk=CHUNK,
                     decay_floor=-LOG_DECAY_SCALE,
                     a=-q["kk"] if low_rank else None, b=q["kk"] * q["a"] if low_rank else None)
    return head_operator(o, q["v"], q["gate"], p, cfg.group_norm_eps, core_args, variant)


# ----------------------------------------------------------------------------- the LM

def rwkv7_block(lp: dict, h, v_first, cfg: Config, first, hook=None):
    """One fla ``RWKV7Block``: ``(h (B, L, C), v_first (B, L, V))`` -> ``(h_next, v_first_next,
    x_ext)`` with ``x_ext = [x, v_first]`` the time mix's input. ``first``: whether this is layer 0
    (a Python or traced bool); ``hook``: ``(point, x) -> x`` at ``nn.hooks.MID_POINTS``."""
    hook = hook or no_hook
    h = hook("hook_resid_pre", h)
    x = norm(h, lp["attn_norm"], cfg.norm_eps)
    x_ext = hook("mixer.hook_in", jnp.concatenate([x, v_first.astype(x.dtype)], axis=-1))
    y, v_own = time_mix_inner(lp["attn"], x_ext, cfg, first)
    y = apply_out_hook(y, out_hook(hook))
    h = hook("hook_resid_mid", h + linear(y.astype(h.dtype), lp["attn"]["o_proj.weight"]))
    h = h + channel_mix_forward(lp["ffn"], norm(h, lp["ffn_norm"], cfg.norm_eps), cfg)
    v_next = v_own.astype(v_first.dtype) if first is True else jnp.where(first, v_own.astype(v_first.dtype), v_first)
    return hook("hook_resid_post", h), v_next, x_ext


def with_value_lora(layers: list, cfg: Config) -> list:
    """Layers with layer 0's absent ``v_lora`` filled with zeros (so all layers stack; layer 0
    never reads them)."""
    if not layers or "v_lora.lora.0.weight" in layers[0]["attn"]:
        return layers
    like = layers[1]["attn"] if len(layers) > 1 else None
    C, V, R = cfg.hidden_size, cfg.value_width, cfg.v_low_rank_dim
    dt = layers[0]["attn"]["r_proj.weight"].dtype
    shapes = {"v_lora.lora.0.weight": (R, C), "v_lora.lora.2.weight": (V, R), "v_lora.lora.2.bias": (V,)}
    fill = {k: jnp.zeros(like[k].shape if like else s, dt) for k, s in shapes.items()}
    return [{**layers[0], "attn": {**layers[0]["attn"], **fill}}] + list(layers[1:])


def block_forward(lp: dict, h, cfg: Config, v_first=None, tap=None, first=None):
    """One layer on its own: ``rwkv7_block`` with an optional ``tap (B, V, L)`` on the time mix's
    operator output; ``lp`` may hold ``pre_norm`` (layer 0); ``v_first (B, L, V)`` is needed after
    layer 0 (zeros for layer 0). Returns ``(h_next, v_first_next, x_ext)``."""
    if lp.get("pre_norm") is not None:
        h = norm(h, lp["pre_norm"], cfg.norm_eps)
    first = "v_lora.lora.0.weight" not in lp["attn"] if first is None else first
    if v_first is None:
        v_first = jnp.zeros(h.shape[:2] + (cfg.value_width,), h.dtype)
    return rwkv7_block(lp, h, v_first, cfg, first, layer_tap(tap))


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """fla ``RWKV7ForCausalLM`` forward: ``ids (B, L) -> logits (B, L, vocab)`` float32, and the
    captured activations (``nn.hooks``; ``hook_embed`` is before layer 0's ``pre_norm``). The layers
    run one after another (``ForwardHooks.run_layers``) carrying the residual stream and the value residual."""
    layers = with_value_lora(params["layers"], cfg)
    hooks = ForwardHooks(capture, adds, sets)
    h = first_norm(params, hooks("hook_embed", embed(params["embeddings"], ids)), cfg)
    def layer(carry, i, lp, hook):
        h, v_first, _ = rwkv7_block(lp, *carry, cfg, i == 0, hook)
        return h, v_first

    v0 = jnp.zeros(h.shape[:2] + (cfg.value_width,), h.dtype)
    h, _ = hooks.run_layers(layer, (h, v0), layers, LAYER_KEYS)
    return head_logits(params, h, cfg), hooks.captured


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
time_mix_forward_jit = jax.jit(full_precision(time_mix_forward), static_argnames=("cfg",))
time_mix_operator_jit = jax.jit(full_precision(time_mix_operator), static_argnames=("cfg", "variant"))
channel_mix_forward_jit = jax.jit(full_precision(channel_mix_forward), static_argnames=("cfg",))
block_forward_jit = jax.jit(full_precision(block_forward), static_argnames=("cfg", "first"))

__all__ = ["VARIANTS", "EXACT_VARIANTS", "LOG_DECAY_SCALE", "CHUNK", "MIX_NAMES", "split_input", "unit",
           "time_mix_parts", "recurrence", "time_mix_inner", "time_mix_forward", "channel_mix_forward",
           "time_mix_operator", "rwkv7_block", "with_value_lora", "block_forward", "lm_forward", "lm_forward_jit",
           "time_mix_forward_jit", "time_mix_operator_jit", "channel_mix_forward_jit", "block_forward_jit"]
