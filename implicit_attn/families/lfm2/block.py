"""LFM2 / LFM2-MoE / LFM3 (HF ``Lfm2ForCausalLM``, ``Lfm2MoeForCausalLM``, ``Lfm3ForCausalLM``):
the block math as pure functions.

Decoder layer: Bamba's ``h + mixer(norm(h))``, then ``h + ffn(norm(h))`` (``bamba.block.hybrid_layer``;
LFM3's sandwich norms RMS-norm the mixer's and the feed-forward part's outputs before the
residual sum). Mixers:

* Gated short convolution (HF ``Lfm2ShortConv``): ``in_proj`` gives ``b, c, x`` (``(B, L, D)``
  each), ``y = c * (conv(b * x) + bias)`` with a causal depthwise conv of width ``conv_L_cache``,
  then ``out_proj``. Operator per channel (exact): ``H_c = diag(c_c) M_c diag(b_c)`` on the values
  ``x``, ``M_c`` the conv's banded matrix, offset ``c * bias`` (``operator.ShortConvCore``);
  ``"gated_values"`` (exact too): ``H_c = diag(c_c) M_c`` on the values ``b * x``.
* Attention (HF ``Lfm2Attention`` / ``Lfm3Attention``): GQA with an RMSNorm over each head's
  queries and keys, RoPE (``Config.rope_frequencies``), full or sliding window; LFM3 multiplies
  each head's output by ``sigmoid(gate_proj(h))``. Operator: the explicit attention (channels =
  heads; output before the gate).

FFN: SwiGLU ``w2(silu(w1 x) * w3 x)``, or LFM2-MoE's mixture of such experts with sigmoid routing.
"""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp

from ...nn.attention import attend, operator_of_parts, rope, segment_ids
from ...nn.hooks import apply_out_hook
from ...nn.moe import experts_forward, gated_act, sigmoid_group_topk
from ...operator import AttentionOperator, ImplicitOperator, ShortConvCore
from ...ops import causal_conv, linear
from ..bamba.block import hybrid_functions, mlp_forward, positions
from ..mamba.block import rms_norm

f32 = jnp.float32
VARIANTS = ("full", "gated_values")
EXACT_VARIANTS = VARIANTS
SWIGLU_NAMES = {"gate_proj.weight": "w1.weight", "up_proj.weight": "w3.weight", "down_proj.weight": "w2.weight"}


# ----------------------------------------------------------------------------- gated short conv

def conv_parts(p: dict, h, cfg) -> dict:
    """Intermediates of the gated short conv for input ``h (B, L, D)``: ``b, c, x`` (the three
    input projections), ``bx = b * x``, ``w (D, K)`` the filters and ``y (B, L, D)`` the output
    before ``out_proj``, all in the parameter dtype."""
    D = cfg.hidden_size
    bcx = linear(h, p["in_proj.weight"], p.get("in_proj.bias"))
    b, c, x = bcx[..., :D], bcx[..., D:2 * D], bcx[..., 2 * D:]
    w = p["conv.weight"][:, 0, :]
    bx = b * x
    y = c * causal_conv(bx, w, p.get("conv.bias"))
    return dict(b=b, c=c, x=x, bx=bx, w=w, y=y)


def conv_forward(p: dict, h, cfg, hook=None):
    """HF ``Lfm2ShortConv.forward``: ``(B, L, D) -> (B, L, D)``. ``hook``: optional
    ``(B, D, L) -> (B, D, L)`` on the gated conv output before ``out_proj``."""
    y = apply_out_hook(conv_parts(p, h, cfg)["y"], hook)
    return linear(y, p["out_proj.weight"], p.get("out_proj.bias"))


def conv_operator(p: dict, h, cfg, variant: str = "full") -> ImplicitOperator:
    """The gated short conv's operator for input ``h (B, L, D)`` (channels = ``D``; both
    variants exact): ``"full"``: ``diag(c) M diag(b)`` on ``x``; ``"gated_values"``: ``diag(c) M``
    on ``b * x``. ``offset = c * conv bias`` (zeros without one); ``output`` the block's own."""
    if variant not in VARIANTS:
        raise ValueError(f"{cfg.label} short-conv variant must be one of {VARIANTS}, got {variant!r}")
    q = conv_parts(p, h, cfg)
    T = lambda a: jnp.swapaxes(a, 1, 2).astype(f32)
    left = T(q["c"])
    bias = p.get("conv.bias")
    offset = jnp.zeros_like(left) if bias is None else left * bias.astype(f32)[:, None]
    full = variant == "full"
    core = ShortConvCore(conv_w=q["w"].astype(f32), left=left, right=T(q["b"]) if full else None)
    return ImplicitOperator(values=T(q["x"] if full else q["bx"]), offset=offset, output=T(q["y"]), core=core)


# ----------------------------------------------------------------------------- attention

def heads_view(cfg, kind: str) -> SimpleNamespace:
    """What ``nn.attention.attend`` / ``operator_of_parts`` read of a ``kind`` attention layer."""
    return SimpleNamespace(num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                           attention_window_size=cfg.window(kind))


def attention_parts(p: dict, h, cfg, kind: str) -> dict:
    """Queries (normed, rotated, scaled) ``(B, H, L, d)``, keys ``(B, KV, L, d)``, values
    ``(B, KV, L, d)``, document ids ``seg (B, L)`` and LFM3's gate ``(B, H, L)`` (None without)."""
    B, L, _ = h.shape
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    names = cfg.attention_names
    pos = positions(B, L)
    split = lambda t, n: t.reshape(B, L, n, d)
    norm = lambda t, w: rms_norm(t, w, cfg.norm_eps, cfg.norm_weight_in_float32)
    q = norm(split(linear(h, p["q_proj.weight"], p.get("q_proj.bias")), H), p[names["q_norm"]])
    k = norm(split(linear(h, p["k_proj.weight"], p.get("k_proj.bias")), KV), p[names["k_norm"]])
    v = split(linear(h, p["v_proj.weight"], p.get("v_proj.bias")), KV)
    inv = jnp.asarray(cfg.rope_frequencies(kind))
    q, k = (rope(jnp.swapaxes(t, 1, 2), pos, inv) for t in (q, k))
    gate = names["gate"] is not None and p.get(names["gate"]) is not None
    return dict(q=q * jnp.asarray(cfg.attention_scale, q.dtype), k=k, v=jnp.swapaxes(v, 1, 2), seg=segment_ids(pos),
                gate=jnp.swapaxes(jax.nn.sigmoid(linear(h, p[names["gate"]])), 1, 2) if gate else None)


def attention_forward(p: dict, h, cfg, kind: str, hook=None):
    """HF ``Lfm2Attention`` / ``Lfm3Attention``: ``(B, L, D) -> (B, L, D)``. ``hook``: optional
    on the per-head output before the gate ``(B, H, L, d)``."""
    a = attention_parts(p, h, cfg, kind)
    o = attend(a, heads_view(cfg, kind))
    if hook is not None:
        o = hook(o)
    if a["gate"] is not None:
        o = o * a["gate"][..., None].astype(o.dtype)
    B, H, L, d = o.shape
    out = cfg.attention_names["out"]
    return linear(jnp.swapaxes(o, 1, 2).reshape(B, L, H * d), p[out + ".weight"], p.get(out + ".bias"))


def attention_operator(p: dict, h, cfg, kind: str) -> AttentionOperator:
    """The explicit attention operator (channels = heads; output before the gate)."""
    return operator_of_parts(attention_parts(p, h, cfg, kind), heads_view(cfg, kind))


# ----------------------------------------------------------------------------- layers

def mixer_forward(p: dict, h, cfg, kind: str, hook=None):
    """Layer kind ``kind``'s token mixer (``"conv"``, ``"attention"``, ``"sliding"``): ``(B, L, D)
    -> (B, L, D)``."""
    return conv_forward(p, h, cfg, hook) if kind == "conv" else attention_forward(p, h, cfg, kind, hook)


def mixer_operator(p: dict, h, cfg, kind: str, variant: str = "full"):
    """Layer kind ``kind``'s operator (attention ignores ``variant``)."""
    return conv_operator(p, h, cfg, variant) if kind == "conv" else attention_operator(p, h, cfg, kind)


def swiglu(p: dict, x):
    """HF ``Lfm2MLP``: ``w2(silu(w1 x) * w3 x)``. ``(B, L, D)``."""
    return mlp_forward({ours: p[theirs] for ours, theirs in SWIGLU_NAMES.items()}, x)


def moe_forward(p: dict, x, cfg):
    """HF ``Lfm2MoeSparseMoeBlock``: ``(B, L, D) -> (B, L, D)``; the experts stacked as
    ``experts.gate_up_proj (E, 2I, D)`` (``w1`` then ``w3``), ``experts.down_proj (E, D, I)``."""
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    bias = p["expert_bias"] if cfg.use_expert_bias else jnp.zeros((cfg.num_experts,), f32)
    weights, experts = sigmoid_group_topk(linear(t, p["gate.weight"]), bias, cfg.num_experts_per_tok, 1, 1,
                                          cfg.norm_topk_prob, cfg.routed_scaling_factor, eps=1e-6)
    out = experts_forward(t, weights.astype(t.dtype), experts, p["experts.gate_up_proj"], p["experts.down_proj"],
                          gated_act(jax.nn.silu))
    return out.reshape(B, L, D)


def ffn_forward(p: dict, x, cfg):
    """A layer's SwiGLU or mixture of experts (the latter if its params have a router)."""
    return moe_forward(p, x, cfg) if "gate.weight" in p else swiglu(p, x)


FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, ffn_forward)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "EXACT_VARIANTS", "SWIGLU_NAMES", "conv_parts", "conv_forward", "conv_operator", "heads_view",
           "attention_parts", "attention_forward", "attention_operator", "mixer_forward", "mixer_operator", "swiglu",
           "moe_forward", "ffn_forward", "FUNCTIONS", "decoder_layer", "layer_forward", "lm_forward",
           "lm_forward_jit", "layer_forward_jit", "mixer_forward_jit", "mixer_operator_jit"]
