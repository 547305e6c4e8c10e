"""Kimi-Linear (HF ``KimiLinearForCausalLM``): the block math as pure functions.

Decoder layer (Bamba's ``hybrid_layer``): ``h + mixer(norm(h))``, then ``h + ffn(norm(h))``. Mixers:

* Kimi Delta Attention (HF ``KimiLinearDeltaAttention``): ``q_proj``, ``k_proj``, ``v_proj`` (one
  head width ``d`` for all three), a causal depthwise conv with SiLU on ``[q, k, v]`` (stored as
  ``q_conv1d``, ``k_conv1d``, ``v_conv1d``), ``q``, ``k`` l2-normalised (``x / sqrt(sum x^2 +
  1e-6)``, ``q`` then times ``d^-0.5``), ``b = sigmoid(b_proj)``, one log decay **per key
  dimension** ``log a = -exp(A_log_h) softplus(f_b_proj(f_a_proj(h)) + dt_bias)`` (HF's softplus is
  ``x`` above 20), the delta rule with those decays (``ops.delta_rule``), a per-head RMSNorm with
  weight times ``sigmoid(g_b_proj(g_a_proj(h)))``, ``o_proj``. Operator: Qwen3-Next's
  (``qwen3_next.block.delta_operator`` on ``kda_parts``): ``H_c = diag(w_c sigmoid(g_c) / rms_h)
  M_h diag(sigmoid(xc_c)) Conv_c`` on the value projection, ``M_h`` the matrix of the rule with
  per-dimension decays (``operator.DeltaRuleCore``); same variants.
* MLA attention without positional encoding (HF ``KimiLinearAttention``): queries from
  ``q_proj`` or the low-rank ``q_b_proj(norm(q_a_proj(h)))``; keys and values from the latent
  ``kv_b_proj(norm(c))`` of ``[c, k_r] = kv_a_proj_with_mqa(h)``, each head's key its own
  ``qk_nope_head_dim`` features then the shared ``k_r``; scale ``(qk_nope + qk_rope)^-1/2``;
  no RoPE. Operator: the explicit attention (channels = heads, values of width ``v_head_dim``).

FFN: a SwiGLU MLP, or sigmoid-routed experts (``nn.moe.sigmoid_group_topk``) plus shared experts.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...kernels import cpu as cpu_kernels
from ...nn.attention import attend, operator_of_parts, rope_frequencies, segment_ids
from ...nn.moe import experts_forward, gated_act, sigmoid_group_topk
from ...operator import AttentionOperator
from ...ops import causal_conv, from_first, linear, zero_nan
from ..bamba.block import hybrid_functions, mlp_forward, positions
from ..mamba.block import rms_norm
from ..qwen3_next.block import EXACT_VARIANTS, VARIANTS, delta_forward, delta_operator
from .config import Config

f32 = jnp.float32
LATENT_NORM_EPS = 1e-6  # HF builds the MLA latent norms with their default eps, not rms_norm_eps
CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def l2_normalize(x):
    """HF's KDA ``l2norm``: ``x / sqrt(sum x^2 + 1e-6)`` over the last axis, float32."""
    x = x.astype(f32)
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def chain(h, p: dict, names: tuple):
    """``h`` through the linear maps ``p[names[0]]``, then ``p[names[1]]``, ..."""
    for name in names:
        h = linear(h, p[name])
    return h


def kda_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of Kimi Delta Attention for input ``h (B, L, D)``, in the layout of
    ``qwen3_next.block.delta_parts`` (``C = heads x d``): ``x_v, xc_v (B, L, C)``, ``gate (B, L, C)``
    float32 (``sigmoid`` of the output gate), ``conv_v (C, K)``, ``q, k, v (B, H, L, d)``, ``log_a
    (B, H, L, d)`` (one log decay per key dimension), ``beta (B, H, L)``, ``state_bad``, ``read_bad``
    ``(B, H, L)``."""
    B, L, _ = h.shape
    H, d = cfg.linear_num_heads, cfg.linear_head_dim
    C = H * d
    x = jnp.concatenate([linear(h, p[f"{n}_proj.weight"]) for n in "qkv"], axis=-1)
    w = jnp.concatenate([p[n] for n in CONVS], axis=0)[:, 0, :]
    xc = causal_conv(x, w)
    u = jax.nn.silu(xc)
    heads = lambda t: jnp.swapaxes(t.reshape(B, L, H, d), 1, 2)
    qh, kh, vh = heads(u[..., :C]), heads(u[..., C:2 * C]), heads(u[..., 2 * C:]).astype(f32)
    g = chain(h, p, cfg.forget_projections).astype(f32) + p["dt_bias"].astype(f32)
    rate = jnp.exp(jnp.repeat(p["A_log"].astype(f32).reshape(H), d))  # A_log (1, 1, H, 1) or (H,)
    if cfg.gate_lower_bound is None:
        softplus = jnp.where(g > 20.0, g, jnp.log(1.0 + jnp.exp(jnp.minimum(g, 20.0))))  # HF's, thresholded
        log_a = heads(-rate * softplus)
    else:  # Bailing's bounded gate: log decays in (lower bound, 0)
        log_a = heads(jnp.asarray(cfg.gate_lower_bound, f32) * jax.nn.sigmoid(rate * g))
    beta = jnp.swapaxes(jax.nn.sigmoid(linear(h, p["b_proj.weight"]).astype(f32)), 1, 2)
    gate = jax.nn.sigmoid(chain(h, p, cfg.gate_projections).astype(f32))
    state_bad = from_first(jnp.isnan(kh).any(-1) | jnp.isnan(vh).any(-1) | jnp.isnan(beta)
                           | jnp.isnan(log_a).any(-1), axis=2)
    return dict(x_v=x[..., 2 * C:], xc_v=xc[..., 2 * C:], gate=gate, conv_v=w[2 * C:],
                q=zero_nan(l2_normalize(qh)) * jnp.asarray(d ** -0.5, f32), k=zero_nan(l2_normalize(kh)),
                v=zero_nan(vh), log_a=zero_nan(log_a), beta=zero_nan(beta), state_bad=state_bad,
                read_bad=jnp.isnan(qh).any(-1))


def interleaved_rope(x, pos, theta: float):
    """DeepSeek's RoPE on ``x (B, h, L, R)``: feature pairs ``(x_0, x_1), (x_2, x_3), ...`` each
    rotated by one frequency ``theta^(-2i/R)``, returned as ``[rotated firsts, rotated seconds]``
    (HF's layout; queries and keys get the same permutation, so their products are unchanged)."""
    R = x.shape[-1]
    ang = pos.astype(f32)[:, None, :, None] * jnp.asarray(rope_frequencies(theta, R))
    cos, sin = cpu_kernels.computed_once(jnp.stack([jnp.cos(ang), jnp.sin(ang)]).astype(x.dtype))
    a, b = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def mla_parts(p: dict, h, cfg: Config) -> dict:
    """Queries (scaled) and keys ``(B, H, L, qk_nope + qk_rope)``, values ``(B, H, L, v_head_dim)``
    and document ids ``seg (B, L)`` of the MLA attention (the shared key part and the queries'
    last ``qk_rope_head_dim`` features rotated where ``cfg.mla_rope_theta`` is set)."""
    B, L, _ = h.shape
    H, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = linear(h, p["q_proj.weight"])
    else:
        qa = linear(h, p["q_a_proj.weight"], p.get("q_a_proj.bias"))
        q = linear(rms_norm(qa, p["q_a_layernorm.weight"], LATENT_NORM_EPS), p["q_b_proj.weight"])
    c = linear(h, p["kv_a_proj_with_mqa.weight"], p.get("kv_a_proj_with_mqa.bias"))
    latent, k_shared = c[..., :cfg.kv_lora_rank], c[..., cfg.kv_lora_rank:]
    kv = linear(rms_norm(latent, p["kv_a_layernorm.weight"], LATENT_NORM_EPS), p["kv_b_proj.weight"])
    kv = kv.reshape(B, L, H, dn + dv)
    T = lambda t: jnp.swapaxes(t, 1, 2)
    q = T(q.reshape(B, L, H, dn + dr))
    if cfg.mla_rope_theta is not None:
        pos = positions(B, L)
        q = jnp.concatenate([q[..., :dn], interleaved_rope(q[..., dn:], pos, cfg.mla_rope_theta)], axis=-1)
        k_shared = interleaved_rope(k_shared[:, None], pos, cfg.mla_rope_theta)[:, 0]
    k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_shared[:, :, None, :], (B, L, H, dr))], axis=-1)
    return dict(q=q * jnp.asarray(cfg.qk_head_dim ** -0.5, q.dtype), k=T(k), v=T(kv[..., dn:]),
                seg=segment_ids(positions(B, L)))


def attention_forward(p: dict, h, cfg: Config, hook=None):
    """HF ``KimiLinearAttention.forward``: ``(B, L, D) -> (B, L, D)``. ``hook``: optional on the
    per-head output ``(B, H, L, v_head_dim)`` (before Bailing's per-head gate)."""
    o = attend(mla_parts(p, h, cfg), cfg)
    if hook is not None:
        o = hook(o)
    if cfg.attention_head_gate:
        gate = jax.nn.sigmoid(linear(h, p["g_proj.weight"]).astype(f32)).astype(o.dtype)  # (B, L, H)
        o = o * jnp.swapaxes(gate, 1, 2)[..., None]
    B, H, L, dv = o.shape
    out = cfg.attention_out_name
    return linear(jnp.swapaxes(o, 1, 2).reshape(B, L, H * dv), p[out + ".weight"], p.get(out + ".bias"))


def attention_operator(p: dict, h, cfg: Config) -> AttentionOperator:
    """The explicit attention operator (channels = heads)."""
    return operator_of_parts(mla_parts(p, h, cfg), cfg)


kda_forward = functools.partial(delta_forward, parts_fn=kda_parts)
kda_operator = functools.partial(delta_operator, parts_fn=kda_parts)


def mixer_forward(p: dict, h, cfg: Config, kind: str, hook=None):
    """Layer kind ``kind``'s token mixer: ``(B, L, D) -> (B, L, D)``."""
    return kda_forward(p, h, cfg, hook) if kind == "delta" else attention_forward(p, h, cfg, hook)


def mixer_operator(p: dict, h, cfg: Config, kind: str, variant: str = "full"):
    """Layer kind ``kind``'s operator (attention ignores ``variant``)."""
    return kda_operator(p, h, cfg, variant) if kind == "delta" else attention_operator(p, h, cfg)


def moe_forward(p: dict, x, cfg: Config):
    """HF ``KimiLinearMoE``: ``(B, L, D) -> (B, L, D)``: the router (``gate.weight (E, D)``,
    ``gate.e_score_correction_bias (E,)``, float32) picks ``num_experts_per_token`` experts
    (``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj (E, D, I)``), plus the shared
    experts' SwiGLU MLP (``shared_experts.*``)."""
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    weights, experts = sigmoid_group_topk(
        linear(t.astype(f32), p["gate.weight"].astype(f32)), p[cfg.router_bias_name],
        cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize, cfg.routed_scaling_factor)
    routed = experts_forward(t, weights.astype(t.dtype), experts, p["experts.gate_up_proj"], p["experts.down_proj"],
                             gated_act(jax.nn.silu))
    shared = mlp_forward({k[len("shared_experts."):]: v for k, v in p.items() if k.startswith("shared_experts.")}, t)
    return (routed + shared).reshape(B, L, D)


def ffn_forward(p: dict, x, cfg: Config):
    """A layer's MLP or MoE (the MoE if its params have a router). ``(B, L, D)``."""
    return moe_forward(p, x, cfg) if "gate.weight" in p else mlp_forward(p, x)


FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, ffn_forward)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "EXACT_VARIANTS", "LATENT_NORM_EPS", "CONVS", "l2_normalize", "chain", "kda_parts",
           "interleaved_rope", "mla_parts",
           "attention_forward", "attention_operator", "kda_forward", "kda_operator", "mixer_forward",
           "mixer_operator", "moe_forward", "ffn_forward", "FUNCTIONS", "decoder_layer", "layer_forward",
           "lm_forward", "lm_forward_jit", "layer_forward_jit", "mixer_forward_jit", "mixer_operator_jit"]
