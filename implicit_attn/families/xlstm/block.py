"""xLSTM (transformers' ``xLSTMForCausalLM``, the mLSTM blocks of xLSTM-7B): the block math as pure
functions and the exact implicit operator of each mLSTM layer.

Block ``i``: ``h + mlstm_layer(norm_mlstm(h))``, then ``h + ffn(norm_ffn(h))`` (RMS norms); then
``out_norm``, ``lm_head`` and ``cap tanh(logits / cap)`` with ``cap = output_logit_soft_cap``.

mLSTM layer on ``x (B, L, D)``: ``q, k (B, H, L, d_k)``, ``v (B, H, L, d_v)``, the output gate's
pre-activation ``o (B, L, V)`` and per-head gate pre-activations, soft-capped: ``i = c tanh(i~ /
c)``, ``f = c tanh(f~ / c)`` (``c = gate_soft_cap``), log forget gate ``logsigmoid(f)``; per head
the stabilised, normalised matrix memory of ``ops.mlstm_rule`` (on CPU, where it pays off, the
kernel's recurrence ``kernels.cpu.mlstm_scan``) with the stabiliser of the torch
forward (``ops.mlstm_stabiliser``: chunk-wise for the longest multiple of ``chunk_size``, step by
step for the rest, in pieces of ``max_inference_chunksize``); then the multi-head layer norm (per
head over ``d_v``, eps ``norm_eps``), times ``sigmoid(o)``, then ``out_proj``.

Operator (channels = the value width, head ``h`` owns ``d_v`` of them; ``operator.MlstmCore``):
``h_t = sum_j M_h[t, j] v_j`` with one matrix per head, so the layer norm's mean is ``M_h`` applied
to the head mean of ``v`` and (``rwkv6.block.head_operator``)
``H_c = diag(sigmoid(o_c) w_c / sigma_h) M_h`` on the head-centred values ``v_c - mean_h(v)``,
``offset_c = sigmoid(o_c) b_c`` (``w``, ``b`` the norm's weight and bias, ``sigma_h`` the row's
standard deviation from the layer's own output). ``M_h`` divides each row by the layer's own
normaliser ``max(|n . q|, e^{-m}) + eps`` (another per-row diagonal).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...kernels import cpu as cpu_kernels
from ...nn import run_scan
from ...nn.hooks import ForwardHooks, apply_out_hook, layer_tap, no_hook, out_hook
from ...operator import MlstmCore, Mamba2Operator
from ...ops import embed, from_first, full_precision, linear, mark_nan, mlstm_rule, mlstm_stabiliser, zero_nan
from ..rwkv6.block import head_operator, heads, normed
from .config import Config

VARIANTS = ("full", "no_gate")
EXACT_VARIANTS = ("full",)
f32 = jnp.float32
LAYER_KEYS = ("norm_mlstm", "norm_ffn", "mlstm_layer", "ffn")


def soft_cap(x, cap: float):
    """``cap tanh(x / cap)``."""
    return cap * jnp.tanh(x / cap)


def rms_norm(x, p: dict, eps: float):
    """transformers' ``xLSTMRMSNorm`` with ``p = {"weight", "bias"?}``: statistics in float32, the
    result cast back to ``x``'s dtype before the weight. ``(..., D)``."""
    x32 = x.astype(f32)
    y = (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = y * p["weight"]
    return y if p.get("bias") is None else y + p["bias"]


def head_norm_params(p: dict) -> dict:
    """The multi-head layer norm's weight and bias (zeros without ``use_bias``) under the names
    ``rwkv6.block.normed`` reads."""
    w = p["multihead_norm.weight"]
    return {"g_norm.weight": w, "g_norm.bias": p.get("multihead_norm.bias", jnp.zeros_like(w))}


def projections(p: dict, x, cfg: Config):
    """``(q, k, v, o, i, f)`` pre-activations of the mLSTM layer for ``x (B, L, D)``: ``q, k (B, L,
    QK)``, ``v, o (B, L, V)``, ``i, f (B, L, H)`` soft-capped (``weight_mode`` "single" or "fused")."""
    b = lambda name: p.get(name + ".bias")
    cap = lambda t: soft_cap(t.astype(f32), cfg.gate_soft_cap)
    if cfg.weight_mode == "single":
        q, k, v, o = (linear(x, p[n + ".weight"], b(n)) for n in ("q", "k", "v", "ogate_preact"))
        i = cap(linear(x, p["igate_preact.weight"], p["igate_preact.bias"]))
        f = cap(linear(x, p["fgate_preact.weight"], p["fgate_preact.bias"]))
    else:
        z = linear(x, p["qkv_opreact.weight"], b("qkv_opreact"))
        QK, V = cfg.qk_dim, cfg.v_dim
        q, k, v, o = z[..., :QK], z[..., QK:2 * QK], z[..., 2 * QK:2 * QK + V], z[..., 2 * QK + V:]
        g = cap(linear(x, p["ifgate_preact.weight"], p["ifgate_preact.bias"]))
        i, f = g[..., :cfg.num_heads], g[..., cfg.num_heads:]
    return q, k, v, o, i, f


def stabiliser(log_f, log_i, cfg: Config):
    """The torch forward's stabiliser ``m (B, H, L)`` (``ops.mlstm_stabiliser``). In ``mode="train"``
    the torch layer runs the chunk-wise kernel alone and refuses a piece that is not a multiple of
    ``chunk_size``: so do we (``ValueError``)."""
    L = log_f.shape[-1]
    if cfg.mode == "train":
        S = cfg.segment
        pieces = [min(S, L - s) for s in range(0, L, S)] if L > S else [L]
        if any(n % cfg.chunk_size for n in pieces):
            raise ValueError(f"xLSTM mode 'train' needs a length whose pieces (max_inference_chunksize {S}) are "
                             f"multiples of chunk_size ({cfg.chunk_size}), got length {L}")
    return mlstm_stabiliser(log_f, log_i, cfg.chunk_size, cfg.segment)


def mixer_parts(p: dict, x, cfg: Config) -> dict:
    """Intermediates of the mLSTM layer for its input ``x (B, L, D)`` (after ``norm_mlstm``): ``q``
    (scaled by ``d_k^-1/2``), ``k (B, H, L, d_k)``, ``v (B, H, L, d_v)``, ``log_f``, ``log_i``, ``m (B,
    H, L)`` float32 (NaN set to 0), ``gate (B, L, V)`` (``sigmoid(o)``), and ``bad (B, H, L)`` (True
    from the first position whose inputs hold NaN; those rows are NaN in the output)."""
    H = cfg.num_heads
    q, k, v, o, i, f = projections(p, x, cfg)
    q = heads(q.astype(f32), H) * cfg.qk_head_dim ** -0.5
    k, v = heads(k.astype(f32), H), heads(v.astype(f32), H)
    log_i = jnp.swapaxes(i, 1, 2)
    log_f = jax.nn.log_sigmoid(jnp.swapaxes(f, 1, 2))
    bad = from_first(jnp.isnan(k).any(-1) | jnp.isnan(v).any(-1) | jnp.isnan(log_f) | jnp.isnan(log_i), axis=2)
    bad = bad | jnp.isnan(q).any(-1)
    log_f, log_i = zero_nan(log_f), zero_nan(log_i)
    return dict(q=zero_nan(q), k=zero_nan(k), v=zero_nan(v), log_f=log_f, log_i=log_i,
                m=stabiliser(log_f, log_i, cfg), gate=jax.nn.sigmoid(o.astype(f32)), bad=bad)


def recurrence(q: dict, cfg: Config):
    """The per-head mLSTM read-out of ``mixer_parts`` ``q``: ``(h (B, H, L, d_v), norm (B, H, L))``
    float32, ``h`` with NaN rows where ``q["bad"]``, ``norm`` its normaliser. On CPU the kernel's
    recurrence where it pays off (``kernels.cpu.mlstm_scan``), the chunk-wise form elsewhere."""
    args = (q["q"], q["k"], q["v"], q["log_f"], q["log_i"], q["m"])
    chunked = functools.partial(mlstm_rule, eps=cfg.eps, chunk=cfg.chunk_size)
    if cpu_kernels.recurrence_pays_off(q["k"], q["v"]):
        h, norm = run_scan("auto", functools.partial(cpu_kernels.mlstm_scan, eps=cfg.eps),
                           chunked, *args)
    else:
        h, norm = chunked(*args)
    return mark_nan(h, q["bad"][..., None]), norm


def mixer_inner(p: dict, x, cfg: Config):
    """``MultiHeadLayerNorm(h) * sigmoid(o)``: the layer's output before ``out_proj``, ``(B, L, V)``."""
    q = mixer_parts(p, x, cfg)
    y, _ = normed(recurrence(q, cfg)[0], head_norm_params(p), cfg.norm_eps)
    return y * q["gate"]


def mixer_forward(p: dict, x, cfg: Config, hook=None):
    """transformers ``xLSTMLayer.forward`` (no state): ``(B, L, D) -> (B, L, D)``. ``hook``: optional
    ``(B, V, L) -> (B, V, L)`` on the gated, normed output before ``out_proj`` (``mixer.hook_out``)."""
    y = apply_out_hook(mixer_inner(p, x, cfg), hook)
    return linear(y.astype(x.dtype), p["out_proj.weight"], p.get("out_proj.bias"))


def ffn_forward(p: dict, x, cfg: Config):
    """transformers ``xLSTMFeedForward``: ``proj_down(silu(gate) * up)``, ``(B, L, D) -> (B, L, D)``."""
    b = lambda name: p.get(name + ".bias")
    if cfg.weight_mode == "single":
        gate = linear(x, p["proj_up_gate.weight"], b("proj_up_gate"))
        up = linear(x, p["proj_up.weight"], b("proj_up"))
    else:
        z = linear(x, p["proj_up_gate_z.weight"], b("proj_up_gate_z"))
        gate, up = z[..., :cfg.ffn_size], z[..., cfg.ffn_size:]
    return linear(jax.nn.silu(gate) * up, p["proj_down.weight"], b("proj_down"))


def mixer_operator(p: dict, x, cfg: Config, variant: str = "full") -> Mamba2Operator:
    """The mLSTM layer's operator for its input ``x (B, L, D)`` (channels = the value width).

    ``"full"`` (exact): ``diag(sigmoid(o) w / sigma_h) M_h`` on the head-centred values, offset
    ``sigmoid(o) b``; ``"no_gate"``: without the output gate. ``output`` is always the layer's own
    (before ``out_proj``).
    """
    if variant not in VARIANTS:
        raise ValueError(f"xLSTM variant must be one of {VARIANTS}, got {variant!r}")
    q = mixer_parts(p, x, cfg)
    h, norm = recurrence(q, cfg)
    core_args = dict(q=q["q"], k=q["k"], log_f=q["log_f"], log_i=q["log_i"], m=q["m"], norm=zero_nan(norm))
    return head_operator(h, q["v"], q["gate"], head_norm_params(p), cfg.norm_eps, core_args, variant,
                         core=MlstmCore)


# ----------------------------------------------------------------------------- the LM

def xlstm_block(lp: dict, h, cfg: Config, hook=None):
    """One transformers ``xLSTMBlock``: ``(B, L, D) -> (h_next, x)`` with ``x`` the mLSTM layer's
    input; ``hook``: ``(point, x) -> x`` at the ``nn.hooks.MID_POINTS``."""
    hook = hook or no_hook
    h = hook("hook_resid_pre", h)
    x = hook("mixer.hook_in", rms_norm(h, lp["norm_mlstm"], cfg.norm_eps))
    h = hook("hook_resid_mid", h + mixer_forward(lp["mlstm_layer"], x, cfg, out_hook(hook)))
    h = h + ffn_forward(lp["ffn"], rms_norm(h, lp["norm_ffn"], cfg.norm_eps), cfg)
    return hook("hook_resid_post", h), x


def head_logits(params: dict, h, cfg: Config):
    """``out_norm``, ``lm_head`` and the logits' soft cap: ``(B, L, vocab)`` float32."""
    h = rms_norm(h, params["out_norm"], cfg.norm_eps)
    head = params["lm_head"]
    return soft_cap((h.astype(head.dtype) @ head.T).astype(f32), cfg.output_logit_soft_cap)


def block_forward(lp: dict, h, cfg: Config, tap=None):
    """``xlstm_block`` with an optional ``tap (B, V, L)`` added to the layer's operator output."""
    return xlstm_block(lp, h, cfg, layer_tap(tap))


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """transformers ``xLSTMForCausalLM`` forward: ``ids (B, L) -> logits (B, L, vocab)`` float32, and
    the captured activations (``nn.hooks``). The layers run one after another (``ForwardHooks.run_layers``)."""
    layers = params["layers"]
    hooks = ForwardHooks(capture, adds, sets)
    h = hooks("hook_embed", embed(params["embeddings"], ids))
    h = hooks.run_layers(lambda h, i, lp, hook: xlstm_block(lp, h, cfg, hook)[0], h, layers, LAYER_KEYS)
    return head_logits(params, h, cfg), hooks.captured


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
mixer_forward_jit = jax.jit(full_precision(mixer_forward), static_argnames=("cfg",))
mixer_operator_jit = jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "variant"))
ffn_forward_jit = jax.jit(full_precision(ffn_forward), static_argnames=("cfg",))
block_forward_jit = jax.jit(full_precision(block_forward), static_argnames=("cfg",))

__all__ = ["VARIANTS", "EXACT_VARIANTS", "LAYER_KEYS", "soft_cap", "rms_norm", "head_norm_params", "projections",
           "stabiliser", "mixer_parts", "recurrence", "mixer_inner", "mixer_forward", "ffn_forward",
           "mixer_operator", "xlstm_block", "head_logits", "block_forward", "lm_forward",
           "lm_forward_jit", "mixer_forward_jit", "mixer_operator_jit", "ffn_forward_jit", "block_forward_jit"]
