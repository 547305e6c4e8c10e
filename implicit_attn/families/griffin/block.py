"""Griffin / RecurrentGemma (Hugging Face ``RecurrentGemmaForCausalLM``): the block math as
pure functions and the exact operator of every temporal block.

Residual layer: ``h + temporal(norm(h))`` then ``+ mlp(norm(.))``; temporal blocks follow
``block_types`` (recurrent / local attention).

Recurrent block (per channel c of the LRU width C):
  ``y = gelu_tanh(linear_y(h))``, ``x = linear_x(h)``, ``xc = conv(x)`` (width K, with bias),
  RG-LRU: ``i, r = sigmoid(block-diagonal gates of xc)``, ``log a = -8 r softplus(Lambda)``,
  ``mult = sqrt(1 - a^2)`` (``a = 0``, ``mult = 1`` where a document starts),
  ``h_t = a_t h_{t-1} + mult_t i_t xc_t``; output ``linear_out(h * y)``.
Operator: ``H_c = diag(y_c) . A_c . M_c`` acting on ``x``, with
``A_c[i, j] = exp(sum_{k=j+1..i} log a_k) mult_j i_j`` and ``offset_c = y_c * (A_c b_c)``.

Documents (``segment_pos``): positions restart at 0; the recurrence resets there, the
local attention does not look across, and the conv does not either (as in DeepMind's
Griffin; the HF torch conv mixes the last K-1 tokens of the previous document in).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ...nn import run_scan
from ...nn.attention import (attention_forward, attention_inner, attention_operator, attention_parts, repeat_kv,
                             rotary, segment_ids)
from ...nn.hooks import ForwardHooks, between_layers, apply_out_hook, layer_tap, no_hook, out_hook
from ...operator import DocumentMaskedCore, ImplicitOperator, ScalarDecayCore
from ...ops import causal_conv, embed, full_precision, linear, linear_scan, rounded
from .config import Config

VARIANTS = ("full", "no_conv", "no_gate")
f32 = jnp.float32


# ----------------------------------------------------------------------------- inputs

def check_segment_pos(segment_pos, shape: tuple[int, int]):
    """Validate document positions at the API boundary.

    Args:
      segment_pos: None (one document: ``0..L-1``) or ``(B, L)`` integers, each row
        starting at 0 and either restarting at 0 (a new document) or counting up by one.
      shape: ``(B, L)`` of the token ids.
    Returns:
      ``(B, L)`` int32 jax array.
    """
    B, L = shape
    if segment_pos is None:
        return jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    if isinstance(segment_pos, jax.core.Tracer):
        if segment_pos.shape != (B, L) or not jnp.issubdtype(segment_pos.dtype, jnp.integer):
            raise ValueError(f"segment_pos must be integers of shape {(B, L)}, got {segment_pos.dtype} "
                             f"{segment_pos.shape}")
        return segment_pos.astype(jnp.int32)
    pos = np.asarray(segment_pos)
    if pos.dtype == object or not np.issubdtype(pos.dtype, np.integer):
        raise TypeError(f"segment_pos must be an integer array, got dtype {pos.dtype}")
    if pos.shape != (B, L):
        raise ValueError(f"segment_pos must have the shape of input_ids {(B, L)}, got {pos.shape}")
    if (pos[:, 0] != 0).any():
        b = int(np.flatnonzero(pos[:, 0] != 0)[0])
        raise ValueError(f"segment_pos must start at 0 in every row; row {b} starts at {int(pos[b, 0])}")
    ok = (pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)
    if not ok.all():
        b, t = (int(v) for v in np.argwhere(~ok)[0])
        raise ValueError(f"segment_pos[{b}, {t + 1}] = {int(pos[b, t + 1])} after {int(pos[b, t])}: positions "
                         "must count up by one inside a document and restart at 0 at a new one")
    return jnp.asarray(pos, jnp.int32)


# ----------------------------------------------------------------------------- math

def rms_norm(x, w, eps: float):
    """HF ``RecurrentGemmaRMSNorm``: float32 ``x / rms(x) * (1 + w)``, cast back. ``(..., D)``."""
    xf = x.astype(f32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(f32))).astype(x.dtype)


def gelu_tanh(x):
    """``gelu_pytorch_tanh``."""
    return jax.nn.gelu(x, approximate=True)


def document_conv(x, w, b, seg=None):
    """Causal depthwise conv that does not reach across documents.

    Args:
      x: ``(B, L, C)``; w: ``(C, K)``; b: ``(C,)`` or None;
      seg: ``(B, L)`` document ids or None (one document: plain ``causal_conv``).
    Returns:
      ``(B, L, C)``: ``out[t] = sum_k w[:, k] x[t-K+1+k] [seg(t-K+1+k) == seg(t)] + b``.
    """
    if seg is None:
        return causal_conv(x, w, b)
    K, L = w.shape[-1], x.shape[1]
    xp = jnp.pad(x, ((0, 0), (K - 1, 0), (0, 0)))
    sp = jnp.pad(seg, ((0, 0), (K - 1, 0)), constant_values=-1)
    out = sum(jnp.where((sp[:, k:k + L] == seg)[..., None], xp[:, k:k + L, :], 0) * w[:, k] for k in range(K))
    return out if b is None else out + b


def rglru_gates(p: dict, xc, pos, num_heads: int) -> dict:
    """RG-LRU gates of the conv output ``xc (B, L, C)`` at positions ``pos (B, L)``.

    Returns float32 ``(B, L, C)`` arrays: ``gate_i``, ``log_a`` (``-inf`` at document
    starts), ``a`` (0 there), ``mult`` (1 there).
    """
    B, L, C = xc.shape
    xh = xc.reshape(B, L, num_heads, C // num_heads)
    blockdiag = lambda w, b: (jnp.einsum("blhi,hij->blhj", xh, w) + b).reshape(B, L, C)
    gate_i = jax.nn.sigmoid(blockdiag(p["rg_lru.input_gate_weight"], p["rg_lru.input_gate_bias"]).astype(f32))
    gate_r = jax.nn.sigmoid(blockdiag(p["rg_lru.recurrent_gate_weight"], p["rg_lru.recurrent_gate_bias"]).astype(f32))
    log_a = -8.0 * gate_r * jax.nn.softplus(p["rg_lru.recurrent_param"].astype(f32))
    reset = (pos == 0)[..., None]
    mult = jnp.where(reset, 1.0, jnp.sqrt(1.0 - jnp.exp(2.0 * log_a)))
    return dict(gate_i=gate_i, mult=mult, a=jnp.where(reset, 0.0, jnp.exp(log_a)),
                log_a=jnp.where(reset, -jnp.inf, log_a))


def recurrent_parts(p: dict, h, pos, cfg: Config) -> dict:
    """Intermediates of the recurrent block for input ``h (B, L, d_model)``.

    Returns ``(B, L, C)`` arrays ``y, x, xc`` (parameter dtype) and the gates of
    ``rglru_gates`` (float32); ``seg (B, L)`` document ids.
    """
    seg = segment_ids(pos)
    y = gelu_tanh(linear(h, p["linear_y.weight"], p["linear_y.bias"]))
    x = linear(h, p["linear_x.weight"], p["linear_x.bias"])
    xc = document_conv(x, p["conv_1d.weight"][:, 0, :], p["conv_1d.bias"], seg)
    return dict(y=y, x=x, xc=xc, seg=seg, **rglru_gates(p, xc, pos, cfg.num_attention_heads))


def rglru_scan(a, u, method: str = "auto"):
    """``h_t = a_t h_{t-1} + u_t`` (``h_{-1} = 0``) over axis 1 in float32. ``(B, L, C) -> (B, L, C)``.

    ``method="sequential"``: one ``lax.scan``, the same accumulation order as the reference
    loop; on CPU it is the faster choice and compiles in a fraction of the time of an
    associative scan (3x at L = 1024, 13x at 8192). ``"parallel"``: ``ops.linear_scan``
    (``jax.lax.associative_scan``, O(log L) depth; for GPU/TPU). ``"auto"`` picks by the
    platform lowered for (``nn.run_scan``, as Mamba's ``selective_scan``). Document resets (``a_t = 0``) cut
    the state exactly with either method.
    """
    a, u = a.astype(f32), u.astype(f32)

    def parallel(a, u):
        return linear_scan(a, u, axis=1)

    def sequential(a, u):
        def step(h, au):
            h = au[0] * h + au[1]
            return h, h

        a, u = (jnp.swapaxes(t, 0, 1) for t in (a, u))
        _, hs = jax.lax.scan(step, jnp.zeros_like(u[0]), (a, u))
        return jnp.swapaxes(hs, 0, 1)

    return run_scan(method, sequential, parallel, a, u)


def recurrent_inner(p: dict, h, pos, cfg: Config):
    """The recurrent block's token-mixing output ``h_lru * y`` before ``linear_out``: ``(B, L, C)``."""
    q = recurrent_parts(p, h, pos, cfg)
    u = q["xc"] * (q["gate_i"] * q["mult"]).astype(q["xc"].dtype)
    hs = rglru_scan(q["a"], u).astype(q["xc"].dtype)
    return hs * q["y"]


def recurrent_forward(p: dict, h, pos, cfg: Config, hook=None):
    """HF ``RecurrentGemmaRecurrentBlock.forward``: ``(B, L, d_model) -> (B, L, d_model)``.

    ``hook``: optional ``(B, C, L) -> (B, C, L)`` applied to the inner output in the
    operator's ``output`` layout (``mixer.hook_out``; see ``nn.hooks``).
    """
    y = apply_out_hook(recurrent_inner(p, h, pos, cfg), hook)
    return linear(y, p["linear_out.weight"], p["linear_out.bias"])


def recurrent_operator(p: dict, h, pos, cfg: Config, variant: str = "full",
                       documents: bool = True) -> ImplicitOperator:
    """The recurrent block's operator for input ``h (B, L, d_model)`` at positions ``pos``.

    ``variant``: ``"full"`` (exact): ``diag(y) A M`` on ``x`` plus the conv-bias offset
    ``y * (A b)``; ``"no_conv"``: ``diag(y) A`` on the conv output ``xc`` (also exact:
    the bias is inside ``xc``); ``"no_gate"``: ``A M`` on ``x`` with offset ``A b``.
    ``documents``: mask entries between documents (needed only if ``pos`` has restarts).
    Channels = ``lru_width``; ``output`` is always the block's own inner output.
    """
    if variant not in VARIANTS:
        raise ValueError(f"Griffin variant must be one of {VARIANTS}, got {variant!r}")
    q = recurrent_parts(p, h, pos, cfg)
    T = lambda a: jnp.swapaxes(a, 1, 2).astype(f32)  # (B, L, C) -> (B, C, L)
    right = q["gate_i"] * q["mult"]
    y = q["y"].astype(f32)
    output = recurrent_inner(p, h, pos, cfg)
    bias = p["conv_1d.bias"].astype(f32)
    Ab = rglru_scan(q["a"], right * bias)  # A applied to the constant bias
    left, cw, values, offset = y, p["conv_1d.weight"][:, 0, :].astype(f32), q["x"], y * Ab
    if variant == "no_conv":
        cw, values, offset = None, q["xc"], None
    elif variant == "no_gate":
        left, offset = None, Ab
    C = cfg.lru_width
    core = ScalarDecayCore(log_a=T(q["log_a"]), group=jnp.arange(C), left=None if left is None else T(left),
                           right=T(right), conv_w=cw)
    if documents and cw is not None:
        core = DocumentMaskedCore(core, q["seg"])
    values = T(values)
    offset = jnp.zeros_like(values) if offset is None else T(offset)
    return ImplicitOperator(values=values, offset=offset, output=T(output), core=core)


def mlp_forward(p: dict, h):
    """HF ``RecurrentGemmaMlp``: ``down(gelu_tanh(gate(h)) * up(h))``. ``(B, L, D)``."""
    g = gelu_tanh(linear(h, p["gate_proj.weight"], p["gate_proj.bias"]))
    return linear(g * linear(h, p["up_proj.weight"], p["up_proj.bias"]), p["down_proj.weight"],
                   p["down_proj.bias"])


def embed_scale(cfg: Config, dtype):
    """HF multiplies embeddings by ``sqrt(hidden_size)`` stored as a bfloat16 buffer."""
    return jnp.asarray(math.sqrt(cfg.hidden_size), jnp.bfloat16).astype(dtype)


def decoder_layer(layer: dict, h, pos, cfg: Config, kind: str, hook=None):
    """HF ``RecurrentGemmaDecoderLayer``: ``h + temporal(norm(h))``, then ``+ mlp(norm(.))``.

    Args:
      layer: ``{"temporal_pre_norm", "channel_pre_norm", "temporal_block", "mlp_block"}``;
      h: ``(B, L, d_model)`` residual stream; pos: ``(B, L)`` positions;
      kind: ``"recurrent"`` or ``"attention"``; hook: optional ``(point, x) -> x`` called at
        the layer's hook points (``nn.hooks``; ``mixer.hook_out`` is ``(B, C, L)`` recurrent,
        ``(B, H, L, d)`` attention).
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the layer output and the temporal
      block's input.
    """
    hook = hook or no_hook
    h = hook("hook_resid_pre", h)
    hn = hook("mixer.hook_in", rms_norm(h, layer["temporal_pre_norm"], cfg.rms_norm_eps))
    fwd = recurrent_forward if kind == "recurrent" else attention_forward
    h = hook("hook_resid_mid", fwd(layer["temporal_block"], hn, pos, cfg, out_hook(hook)) + h)
    h = mlp_forward(layer["mlp_block"], rms_norm(h, layer["channel_pre_norm"], cfg.rms_norm_eps)) + h
    return hook("hook_resid_post", h), hn


def layer_forward(layer: dict, h, pos, cfg: Config, kind: str, tap=None):
    """``decoder_layer`` with an optional ``tap`` added to the temporal block's operator
    output (``(B, C, L)`` recurrent, ``(B, H, L, d)`` attention)."""
    return decoder_layer(layer, h, pos, cfg, kind, layer_tap(tap))


def lm_forward(params: dict, ids, pos, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """Full LM: ``ids (B, L)``, positions ``pos (B, L)`` -> ``logits (B, L, vocab)`` float32
    (soft-capped), and ``{name: activation}`` of the hook names in ``capture``. ``adds`` /
    ``sets``: ``{name: array}`` added to / replacing activations (``nn.hooks.ForwardHooks``;
    ``hook_embed`` is the embedding before the ``sqrt(d_model)`` scale)."""
    hooks = ForwardHooks(capture, adds, sets)
    emb = params["embed_tokens"]
    h = rounded(hooks("hook_embed", embed(emb, ids)) * embed_scale(cfg, emb.dtype))  # HF's is a stored tensor
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
        h = between_layers(decoder_layer(layer, h, pos, cfg, kind, hooks.layer(i))[0])
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    head = emb if params.get("lm_head") is None else params["lm_head"]
    logits = h.astype(head.dtype) @ head.T
    cap = cfg.logits_soft_cap
    logits = jnp.tanh(logits / cap) * cap
    return logits.astype(f32), hooks.captured


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
recurrent_forward_jit = jax.jit(full_precision(recurrent_forward), static_argnames=("cfg",))
attention_forward_jit = jax.jit(full_precision(attention_forward), static_argnames=("cfg",))
recurrent_operator_jit = jax.jit(full_precision(recurrent_operator), static_argnames=("cfg", "variant", "documents"))
attention_operator_jit = jax.jit(full_precision(attention_operator), static_argnames=("cfg",))
layer_forward_jit = jax.jit(full_precision(layer_forward), static_argnames=("cfg", "kind"))


__all__ = ["VARIANTS", "check_segment_pos", "segment_ids", "rms_norm", "gelu_tanh", "document_conv", "rglru_gates",
           "recurrent_parts", "rglru_scan", "recurrent_inner", "recurrent_forward", "recurrent_operator", "rotary",
           "attention_parts", "repeat_kv", "attention_inner", "attention_forward", "attention_operator",
           "mlp_forward", "embed_scale", "decoder_layer", "layer_forward", "lm_forward", "lm_forward_jit", "recurrent_forward_jit",
           "attention_forward_jit", "recurrent_operator_jit", "attention_operator_jit", "layer_forward_jit"]
