"""Qwen3-Next (HF ``Qwen3NextForCausalLM``): the block math as pure functions.

Decoder layer: ``h + mixer(norm(h))``, then ``h + ffn(norm(h))``, every norm zero-centred
(``x / rms(x) * (1 + w)``). Mixers:

* Gated DeltaNet (HF ``Qwen3NextGatedDeltaNet``): ``in_proj_qkvz`` and ``in_proj_ba`` (grouped by
  key head; Qwen3.5: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; OLMo-Hybrid: one
  projection each, ``g_proj`` for ``z``; LaraMini: one ``in_proj``; ``Config.projections``), a
  causal depthwise conv with SiLU on ``[q, k, v]``, ``q``, ``k`` l2-normalised (``x * rsqrt(sum x^2
  + 1e-6)``, ``q`` then times ``d_k^-0.5``), ``b = sigmoid(b)``, ``log a = -exp(A_log) softplus(a +
  dt_bias)``, the gated delta rule per value head (``ops.delta_rule``; value head ``h`` reads key
  head ``h // (H_v / H_k)``), a per-head RMSNorm with weight, times ``SiLU(z)``, ``out_proj``.
  Operator: ``H_c = diag(w_c SiLU(z_c) / rms_h) M_h diag(sigmoid(xc_c)) Conv_c`` on the value
  projection (``operator.DeltaRuleCore``): every factor of the block is inside ``H``, as for
  Mamba-2.
* Gated attention (HF ``Qwen3NextAttention``): ``q_proj`` gives per head a query and an output
  gate, zero-centred RMSNorm on q and k, partial RoPE, softmax attention, the output times
  ``sigmoid(gate)``, ``o_proj``. Operator: the explicit attention (channels = heads) with output
  the attention before the gate (the gate, like ``o_proj``, is applied after ``H``).

FFN: a SwiGLU MLP, or a mixture of SwiGLU experts (softmax top-k, renormalised if
``norm_topk_prob``) plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...kernels import cpu as cpu_kernels
from ...nn import run_scan
from ...nn.attention import attend, operator_of_parts, rotary, segment_ids
from ...nn.hooks import ForwardHooks, between_layers, apply_out_hook, layer_tap, no_hook, out_hook
from ...nn.moe import experts_forward, gated_act, softmax_then_topk
from ...operator import AttentionOperator, DeltaRuleCore, Mamba2Operator
from ...ops import causal_conv, delta_rule, embed, from_first, full_precision, linear, mark_nan, nan_rows, zero_nan
from ..bamba.block import mlp_forward, positions
from .config import Config

f32 = jnp.float32
VARIANTS = ("full", "no_conv", "no_gate", "no_norm", "no_delta")
EXACT_VARIANTS = ("full", "no_conv")


def zc_rms_norm(x, w, eps: float):
    """HF ``Qwen3NextRMSNorm``: ``x / rms(x) * (1 + w)`` in float32, cast back. ``(..., D)``."""
    xf = x.astype(f32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(f32))).astype(x.dtype)


def l2_normalize(x):
    """FLA's / HF's ``l2norm``: ``x * rsqrt(sum x^2 + 1e-6)`` over the last axis, float32."""
    x = x.astype(f32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


# ----------------------------------------------------------------------------- Gated DeltaNet

def delta_projections(p: dict, h, cfg: Config):
    """The Gated DeltaNet's input projections of ``h (B, L, D)``, as the kernel reads them: ``(x (B,
    L, P_x), xcols, z (B, L, P_z), zcols, b, a (B, L, H_v))`` where ``x[..., xcols]`` are the conv's
    inputs ``[q | k | v]`` (``C_x = 2 H_k d_k + H_v d_v`` channels) and ``z[..., zcols]`` the output
    gate's (``H_v d_v``); ``xcols``, ``zcols`` numpy int32 (for ``cfg.projections == "grouped"`` both
    pick from ``in_proj_qkvz``'s key-head groups; otherwise ``arange``: ``"split"``, ``"separate"``
    and ``"fused"``, LaraMini's one ``in_proj`` of rows ``[q | k | v | z | b | a]``)."""
    B, L, _ = h.shape
    Hk, Hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    rep = Hv // Hk
    ident = lambda n: np.arange(n, dtype=np.int32)
    if cfg.projections == "split":
        x = linear(h, p["in_proj_qkv.weight"])
        z, b, a = (linear(h, p[f"in_proj_{n}.weight"]) for n in "zba")
        return x, ident(x.shape[-1]), z, ident(z.shape[-1]), b, a
    if cfg.projections == "fused":  # LaraMini: one ``in_proj``, rows [q | k | v | z | b | a]
        y = linear(h, p["in_proj.weight"])
        x, z, b, a = jnp.split(y, np.cumsum([2 * Hk * dk + Hv * dv, Hv * dv, Hv]), axis=-1)
        return x, ident(x.shape[-1]), z, ident(z.shape[-1]), b, a
    if cfg.projections == "separate":
        x = jnp.concatenate([linear(h, p[f"{n}_proj.weight"]) for n in "qkv"], axis=-1)
        z, b, a = (linear(h, p[f"{n}_proj.weight"]) for n in "gba")
        return x, ident(x.shape[-1]), z, ident(z.shape[-1]), b, a
    qkvz = linear(h, p["in_proj_qkvz.weight"])  # per key head g: [q_g, k_g, v of its rep heads, z of them]
    width = 2 * dk + 2 * rep * dv
    g, i = np.arange(Hk)[:, None], np.arange(dk)[None, :]
    vh = np.arange(Hv)[:, None] // rep * width + np.arange(Hv)[:, None] % rep * dv + np.arange(dv)[None, :]
    xcols = np.concatenate([(g * width + i).ravel(), (g * width + dk + i).ravel(), (vh + 2 * dk).ravel()])
    zcols = (vh + 2 * dk + rep * dv).ravel()
    ba = linear(h, p["in_proj_ba.weight"]).reshape(B, L, Hk, 2 * rep)
    b, a = (t.reshape(B, L, Hv) for t in jnp.split(ba, 2, axis=-1))
    return qkvz, xcols.astype(np.int32), qkvz, zcols.astype(np.int32), b, a


def delta_gates(p: dict, b, a, cfg: Config):
    """``(beta, log_a)``, both ``(B, L, H_v)`` float32, from the projections ``b, a (B, L, H_v)``:
    ``beta = beta_scale sigmoid(b)``, ``log a = -exp(A_log) softplus(a + dt_bias)``."""
    beta = jax.nn.sigmoid(b.astype(f32))
    if cfg.beta_scale != 1.0:
        beta = beta * jnp.asarray(cfg.beta_scale, f32)
    log_a = -jnp.exp(p["A_log"].astype(f32)) * jax.nn.softplus(a.astype(f32) + p["dt_bias"].astype(f32))
    return beta, log_a


def delta_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of the Gated DeltaNet for input ``h (B, L, D)``.

    Returns ``x_v, xc_v (B, L, C)`` (value channels before and after the conv, ``C = H_v d_v``),
    ``gate (B, L, C)`` float32 (the activated output gate ``SiLU(z)``), ``conv_v (C, K)`` (the value
    channels' filters), ``q, k (B, H_k, L, d_k)``
    (normalised, q scaled), ``v (B, H_v, L, d_v)``, ``log_a, beta (B, H_v, L)`` (float32), and
    ``state_bad (B, H_v, L)`` / ``read_bad (B, H_v, L)``: NaN reaching the state / the read-out
    (NaN inputs are replaced by 0 here; ``ops.nan``).
    """
    B, L, _ = h.shape
    Hk, Hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    rep = Hv // Hk
    xp, xcols, zp, zcols, b, a = delta_projections(p, h, cfg)
    pick = lambda t, cols: t if np.array_equal(cols, np.arange(t.shape[-1])) else t[..., cols]
    x, z = pick(xp, xcols), pick(zp, zcols)
    w = p["conv1d.weight"][:, 0, :]
    xc = causal_conv(x, w, p.get("conv1d.bias"))
    u = jax.nn.silu(xc)
    heads = lambda t, n, d: jnp.swapaxes(t.reshape(B, L, n, d), 1, 2)
    qh = heads(u[..., :Hk * dk], Hk, dk)
    kh = heads(u[..., Hk * dk:2 * Hk * dk], Hk, dk)
    vh = heads(u[..., 2 * Hk * dk:], Hv, dv).astype(f32)
    beta, log_a = (jnp.swapaxes(t, 1, 2) for t in delta_gates(p, b, a, cfg))
    per_value = lambda t: jnp.repeat(t, rep, axis=1)  # key head g serves value heads g*rep ... (g+1)*rep-1
    state_bad = from_first(per_value(jnp.isnan(kh).any(-1)) | jnp.isnan(vh).any(-1) | jnp.isnan(beta)
                           | jnp.isnan(log_a), axis=2)
    read_bad = per_value(jnp.isnan(qh).any(-1))
    return dict(x_v=x[..., 2 * Hk * dk:], xc_v=xc[..., 2 * Hk * dk:],
                gate=jax.nn.silu(z.astype(f32)), conv_v=w[2 * Hk * dk:],
                q=zero_nan(l2_normalize(qh)) * jnp.asarray(dk ** -0.5, f32), k=zero_nan(l2_normalize(kh)),
                v=zero_nan(vh), log_a=zero_nan(log_a), beta=zero_nan(beta), state_bad=state_bad, read_bad=read_bad)


def delta_inner(p: dict, h, cfg: Config, parts=None, method: str = "auto"):
    """``(o (B, L, C) float32 before the norm, left (B, L, C) float32)``: the delta rule's output and
    the norm-and-gate factor ``w gate / rms_h(o)`` (so the block's pre-``out_proj`` output is
    ``left * o``). ``parts``: ``delta_parts``' dict (computed if None). ``method``: ``nn.run_scan``'s
    (``"sequential"`` where the caller runs on CPU: no branch for the other platforms to trace)."""
    q = parts or delta_parts(p, h, cfg)
    B, L, _ = h.shape
    Hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    rep = Hv // cfg.linear_num_key_heads
    qk = jnp.repeat(q["q"], rep, axis=1), jnp.repeat(q["k"], rep, axis=1)
    # on CPU the fused kernel's recurrence where it pays off; the chunked form elsewhere (nn.run_scan)
    rule = cpu_kernels.delta_scan if cpu_kernels.recurrence_pays_off(qk[1], q["v"]) else delta_rule
    o = run_scan(method, rule, delta_rule, *qk, q["v"], q["log_a"], q["beta"])
    o = mark_nan(o, (q["state_bad"] | q["read_bad"])[..., None])  # (B, Hv, L, dv)
    inv = jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.delta_norm_eps)  # (B, Hv, L, 1)
    o = jnp.swapaxes(o, 1, 2).reshape(B, L, Hv * dv)
    inv = jnp.repeat(jnp.swapaxes(inv[..., 0], 1, 2), dv, axis=-1)  # (B, L, C)
    left = jnp.tile(p[cfg.delta_norm_name].astype(f32), Hv) * inv * q["gate"]
    return o, left


def delta_output(p: dict, h, cfg: Config, parts_fn=delta_parts, method: str = "auto"):
    """The Gated DeltaNet's output before ``out_proj``, ``(B, L, C)`` float32 (``left * o`` of
    ``delta_inner``), by XLA (its recurrence by the CPU kernel where ``delta_inner`` takes it;
    ``method`` as there)."""
    o, left = delta_inner(p, h, cfg, parts_fn(p, h, cfg), method)
    return left * o


def delta_output_kernel(p: dict, h, cfg: Config):
    """``delta_output``'s numbers (to float32 rounding) by the fused CPU kernel
    (``kernels.cpu.gated_delta_net``: everything between the projections in one pass), its
    derivatives ``delta_output``'s (its recurrence the CPU's: the kernel runs on CPU only). Float32
    parameters and input only."""
    def fast(p, h):
        x, xcols, z, zcols, b, a = delta_projections(p, h, cfg)
        beta, log_a = delta_gates(p, b, a, cfg)
        return cpu_kernels.gated_delta_net(x, xcols, p["conv1d.weight"][:, 0, :], p.get("conv1d.bias"), z, zcols,
                                           log_a, beta, p[cfg.delta_norm_name], cfg.linear_num_key_heads,
                                           cfg.delta_norm_eps)

    return cpu_kernels.with_reference_derivatives(fast, lambda p, h: delta_output(p, h, cfg, method="sequential"))(p, h)


def delta_kernel_pays_off(p: dict, h, cfg: Config) -> bool:
    """Whether a CPU forward takes ``delta_output_kernel``: float32 input and parameters, and the
    kernel's size rule (``kernels.cpu.delta_net_pays_off``)."""
    return (all(jnp.dtype(t.dtype) == f32 for t in (h, *jax.tree.leaves(p)))
            and cpu_kernels.delta_net_pays_off(h.shape[0], h.shape[1], cfg.linear_num_value_heads,
                                               cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def delta_forward(p: dict, h, cfg: Config, hook=None, parts_fn=delta_parts):
    """HF ``Qwen3NextGatedDeltaNet.forward``: ``(B, L, D) -> (B, L, D)``. ``hook``: optional
    ``(B, C, L) -> (B, C, L)`` on the gated, normed output before ``out_proj``. ``parts_fn``: the
    mixer's intermediates in ``delta_parts``' layout (Kimi Delta Attention has its own). On CPU the
    fused kernel where ``delta_kernel_pays_off`` (``parts_fn`` this module's), XLA elsewhere."""
    if parts_fn is delta_parts and delta_kernel_pays_off(p, h, cfg):
        y = jax.lax.platform_dependent(p, h, cpu=lambda p, h: delta_output_kernel(p, h, cfg),
                                       default=lambda p, h: delta_output(p, h, cfg, method="parallel"))
    else:
        y = delta_output(p, h, cfg, parts_fn)
    y = apply_out_hook(y, hook).astype(h.dtype)
    return linear(y, p[cfg.delta_out_name])


def delta_operator(p: dict, h, cfg: Config, variant: str = "full", parts_fn=delta_parts) -> Mamba2Operator:
    """The Gated DeltaNet's operator for input ``h (B, L, D)`` (channels = value heads x d_v).

    ``"full"`` (exact): ``diag(w SiLU(z) / rms) M_h diag(sigmoid(xc)) Conv`` on the value
    projection; ``"no_conv"`` (exact): the same on the conv output, without ``Conv``;
    ``"no_gate"``: without ``SiLU(z)``; ``"no_norm"``: without ``w / rms``; ``"no_delta"``:
    ``M_h`` without the delta rule's erasure (``tril(q k^T * Gamma) diag(b)``). ``output`` is
    always the block's own. ``parts_fn``: as for ``delta_forward``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"{cfg.label} Gated DeltaNet variant must be one of {VARIANTS}, got {variant!r}")
    parts = parts_fn(p, h, cfg)
    o, left = delta_inner(p, h, cfg, parts)
    T = lambda a: jnp.swapaxes(a, 1, 2).astype(f32)
    output = T(left * o)
    if variant == "no_gate":
        left = left / parts["gate"]
    elif variant == "no_norm":
        left = parts["gate"]
    right = jax.nn.sigmoid(parts["xc_v"].astype(f32))
    values = parts["xc_v"] if variant == "no_conv" else parts["x_v"]
    Hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    core = DeltaRuleCore(q=parts["q"], k=parts["k"], log_a=parts["log_a"], beta=parts["beta"],
                         head=jnp.repeat(jnp.arange(Hv), dv), left=nan_rows(T(left), output), right=zero_nan(T(right)),
                         conv_w=None if variant == "no_conv" else parts["conv_v"].astype(f32),
                         heads_per_group=Hv // cfg.linear_num_key_heads, delta=variant != "no_delta")
    values = T(values)
    return Mamba2Operator(values=values, offset=jnp.zeros_like(values), output=output, core=core)


# ----------------------------------------------------------------------------- gated attention

def attention_parts(p: dict, h, cfg: Config) -> dict:
    """Queries (normed, rotated, scaled) ``(B, H, L, d)``, keys ``(B, KV, L, d)``, values
    ``(B, KV, L, d)``, the output gate ``(B, H, L, d)`` and document ids ``seg (B, L)``."""
    B, L, _ = h.shape
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pos = positions(B, L)
    qg = linear(h, p["q_proj.weight"], p.get("q_proj.bias")).reshape(B, L, H, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = linear(h, p["k_proj.weight"], p.get("k_proj.bias")).reshape(B, L, KV, d)
    v = linear(h, p["v_proj.weight"], p.get("v_proj.bias")).reshape(B, L, KV, d)
    q = jnp.swapaxes(zc_rms_norm(q, p["q_norm.weight"], cfg.rms_norm_eps), 1, 2)
    k = jnp.swapaxes(zc_rms_norm(k, p["k_norm.weight"], cfg.rms_norm_eps), 1, 2)
    q, k = rotary(q, pos, cfg), rotary(k, pos, cfg)
    return dict(q=q * jnp.asarray(cfg.attention_scale, q.dtype), k=k, v=jnp.swapaxes(v, 1, 2),
                gate=jnp.swapaxes(gate, 1, 2), seg=segment_ids(pos))


def attention_inner(p: dict, h, cfg: Config):
    """Per-head attention output before the gate: ``(B, H, L, d)``."""
    return attend(attention_parts(p, h, cfg), cfg)


def attention_forward(p: dict, h, cfg: Config, hook=None):
    """HF ``Qwen3NextAttention.forward``: ``(B, L, D) -> (B, L, D)``. ``hook``: optional on the
    per-head output before the gate ``(B, H, L, d)``."""
    a = attention_parts(p, h, cfg)
    o = attend(a, cfg)
    if hook is not None:
        o = hook(o)
    o = o * jax.nn.sigmoid(a["gate"]).astype(o.dtype)
    B, H, L, d = o.shape
    return linear(jnp.swapaxes(o, 1, 2).reshape(B, L, H * d), p["o_proj.weight"], p.get("o_proj.bias"))


def attention_operator(p: dict, h, cfg: Config) -> AttentionOperator:
    """The explicit attention operator (channels = heads; output before the gate)."""
    return operator_of_parts(attention_parts(p, h, cfg), cfg)


# ----------------------------------------------------------------------------- layers

def mixer_forward(p: dict, h, cfg: Config, kind: str, hook=None):
    """Layer kind ``kind``'s token mixer: ``(B, L, D) -> (B, L, D)``."""
    return delta_forward(p, h, cfg, hook) if kind == "delta" else attention_forward(p, h, cfg, hook)


def mixer_operator(p: dict, h, cfg: Config, kind: str, variant: str = "full"):
    """Layer kind ``kind``'s operator (attention ignores ``variant``)."""
    return delta_operator(p, h, cfg, variant) if kind == "delta" else attention_operator(p, h, cfg)


def moe_forward(p: dict, x, cfg: Config):
    """HF ``Qwen3NextSparseMoeBlock``: ``(B, L, D) -> (B, L, D)``."""
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    weights, experts = softmax_then_topk(linear(t, p["gate.weight"]), cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    routed = experts_forward(t, weights.astype(t.dtype), experts, p["experts.gate_up_proj"], p["experts.down_proj"],
                             gated_act(jax.nn.silu))
    shared = mlp_forward({k[len("shared_expert."):]: v for k, v in p.items() if k.startswith("shared_expert.")}, t)
    shared = jax.nn.sigmoid(linear(t, p["shared_expert_gate.weight"])) * shared
    return (routed + shared).reshape(B, L, D)


def ffn_forward(p: dict, x, cfg: Config):
    """A layer's MLP or MoE (the MoE if its params have a router). ``(B, L, D)``."""
    return moe_forward(p, x, cfg) if "gate.weight" in p else mlp_forward(p, x)


def decoder_layer(layer: dict, h, cfg: Config, kind: str, hook=None):
    """HF ``Qwen3NextDecoderLayer``: ``(h_next, mixer input)``, both ``(B, L, D)``.

    ``layer``: ``{"input_layernorm", "pre_ff_layernorm"`` (HF's ``post_attention_layernorm``),
    ``"mixer", "feed_forward"}``."""
    hook = hook or no_hook
    h = hook("hook_resid_pre", h)
    x = hook("mixer.hook_in", zc_rms_norm(h, layer["input_layernorm"], cfg.rms_norm_eps))
    h = hook("hook_resid_mid", h + mixer_forward(layer["mixer"], x, cfg, kind, out_hook(hook)))
    h = h + ffn_forward(layer["feed_forward"], zc_rms_norm(h, layer["pre_ff_layernorm"], cfg.rms_norm_eps), cfg)
    return hook("hook_resid_post", h), x


def layer_forward(layer: dict, h, cfg: Config, kind: str, tap=None):
    """``decoder_layer`` with an optional ``tap`` added to the mixer's operator output."""
    return decoder_layer(layer, h, cfg, kind, layer_tap(tap))


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """The full LM: ``ids (B, L) -> (logits (B, L, vocab) float32, captured)``."""
    hooks = ForwardHooks(capture, adds, sets)
    h = hooks("hook_embed", embed(params["embed_tokens"], ids))
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
        h = between_layers(decoder_layer(layer, h, cfg, kind, hooks.layer(i))[0])
    h = zc_rms_norm(h, params["final_layernorm"], cfg.rms_norm_eps)
    head = params["embed_tokens"] if params.get("lm_head") is None else params["lm_head"]
    return (h.astype(head.dtype) @ head.T).astype(f32), hooks.captured


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
layer_forward_jit = jax.jit(full_precision(layer_forward), static_argnames=("cfg", "kind"))
mixer_forward_jit = jax.jit(full_precision(mixer_forward), static_argnames=("cfg", "kind"))
mixer_operator_jit = jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "kind", "variant"))

__all__ = ["VARIANTS", "EXACT_VARIANTS", "zc_rms_norm", "l2_normalize", "delta_parts", "delta_inner",
           "delta_forward", "delta_operator", "attention_parts", "attention_inner", "attention_forward",
           "attention_operator", "mixer_forward", "mixer_operator", "moe_forward", "ffn_forward", "decoder_layer",
           "layer_forward", "lm_forward", "lm_forward_jit", "layer_forward_jit", "mixer_forward_jit",
           "mixer_operator_jit"]
