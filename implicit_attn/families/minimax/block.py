"""MiniMax (HF ``MiniMaxForCausalLM``): the block math as pure functions.

Decoder layer (HF ``MiniMaxDecoderLayer``; the residual is taken **after** each norm):
``x = norm(h)``, ``h = a_1 x + b_1 mixer(x)``, ``y = norm(h)``, ``h = a_2 y + b_2 moe(y)`` with
the per-kind factors ``*_alpha_factor`` / ``*_beta_factor`` (``Config.residual_factors``).
Mixers:

* Lightning attention (HF ``MiniMaxLightningAttention``): ``[q, k, v] = SiLU(qkv_proj(x))`` per
  head (``H`` heads of width ``d``, the three side by side within each head), per head a linear
  attention with one constant decay ``s_h`` (``slope_rates``): ``o_i = sum_{j <= i} (q_i . k_j)
  exp(-s_h (i - j)) v_j`` (no ``d^-1/2``; HF computes it in blocks of ``block_size``, here Mamba-2's
  chunked SSD with ``dt = 1``, ``A_h = -s_h``), an RMSNorm over all ``H d`` channels together
  (weight ``w``, eps ``1e-6``), times ``sigmoid(output_gate(x))``, ``out_proj``. Operator (channels
  = heads x d, ``operator.Mamba2Core``): ``H_c = diag(w_c sigmoid(g_c) / rms) K_h diag(sigmoid(v'_c))``
  on the value projection ``v'`` before its SiLU, ``K_h[i, j] = (q_i . k_j) exp(-s_h (i - j))``;
  the norm's ``1 / rms`` (a per-token scalar of the block's own output) and the gate are left
  diagonals, the SiLU of the values a right one.
* Softmax attention (HF ``MiniMaxAttention``): GQA with RoPE over the whole head, an optional
  sliding window (``nn.attention``). Operator: the explicit attention (channels = heads).

FFN: HF ``MiniMaxSparseMoeBlock``: softmax over all experts, the top ``num_experts_per_tok``
renormalised to sum 1, SwiGLU experts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...nn.attention import attention_forward, attention_operator
from ...nn.hooks import apply_out_hook, no_hook, out_hook
from ...nn.moe import experts_forward, gated_act, softmax_then_topk
from ...operator import Mamba2Core, Mamba2Operator
from ...ops import linear
from ..bamba.block import hybrid_functions, positions
from ..mamba2.block import ssd
from ..mamba.block import rms_norm
from .config import Config

f32 = jnp.float32
VARIANTS = ("full", "no_gate", "no_norm")
EXACT_VARIANTS = ("full",)
CHUNK = 64  # our chunk length (a performance knob; HF's block_size does not change the numbers)


def slope_rates(num_heads: int, layer: int, num_layers: int) -> np.ndarray:
    """HF ``MiniMaxLightningAttention.get_slope_rate``: ``(num_heads,)`` float32 decay rates ``s_h =
    b^(h+1) (1 - layer / (num_layers - 1 + 1e-5) + 1e-5)``, ``b = 2^(-8 / num_heads)`` (with one
    layer the factor is ``1 + 1e-5``; the last layer's is about ``1e-5 / num_layers``)."""
    base = 1.0 / 2.0 ** (8.0 / num_heads)
    factor = 1.0 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** np.arange(1, num_heads + 1, dtype=np.float64) * factor).astype(np.float32)


def decay_tables(slope, block_size: int) -> dict:
    """The decay tables HF keeps as buffers next to ``slope_rate`` ``(H, 1, 1)``, from the slopes
    ``(H,)`` (numpy float32): ``query_decay (H, bs, 1)``, ``key_decay (H, bs, 1)``,
    ``diagonal_decay (1, H, bs, bs)`` (for checking a checkpoint's tables)."""
    s = np.asarray(slope, np.float32).reshape(-1, 1, 1)
    r = np.arange(1, block_size + 1, dtype=np.float32)[:, None]
    diff = r - r.T
    diag = np.where(diff >= 0, np.exp(-s * np.maximum(diff, 0)), 0.0)[None]
    return {"query_decay": np.exp(-s * r), "key_decay": np.exp(-s * (block_size - r)), "diagonal_decay": diag}


# ----------------------------------------------------------------------------- lightning attention

def lightning_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of the lightning attention for input ``h (B, L, D)``: ``q, k, v (B, L, H, d)``
    float32 (after the SiLU), ``v_pre (B, L, C)`` (the value projection before it), ``gate (B, L, C)``
    float32 (``sigmoid(output_gate(h))``) and ``slope (H,)`` float32."""
    B, L, _ = h.shape
    H, d = cfg.num_attention_heads, cfg.head_dim
    pre = linear(h, p["qkv_proj.weight"]).reshape(B, L, H, 3 * d)
    qkv = jax.nn.silu(pre).astype(f32)
    return dict(q=qkv[..., :d], k=qkv[..., d:2 * d], v=qkv[..., 2 * d:], v_pre=pre[..., 2 * d:].reshape(B, L, H * d),
                gate=jax.nn.sigmoid(linear(h, p["output_gate.weight"]).astype(f32)),
                slope=p["slope_rate"].reshape(H).astype(f32))


def lightning_inner(p: dict, h, cfg: Config, parts=None):
    """``(o, norm)``, both ``(B, L, C)`` float32: the decayed linear attention's output and the norm's
    factor ``w / rms(o)`` (the block's pre-``out_proj`` output is ``norm * gate * o``)."""
    q = parts or lightning_parts(p, h, cfg)
    B, L, H, d = q["q"].shape
    o = ssd(q["v"], jnp.ones((B, L, H), f32), -q["slope"], q["k"], q["q"], CHUNK).reshape(B, L, H * d)
    inv = jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.lightning_norm_eps)
    return o, p["norm.weight"].astype(f32) * inv


def lightning_forward(p: dict, h, cfg: Config, hook=None):
    """HF ``MiniMaxLightningAttention.forward`` (no cache): ``(B, L, D) -> (B, L, D)``. ``hook``:
    optional ``(B, C, L) -> (B, C, L)`` on the gated, normed output before ``out_proj``."""
    parts = lightning_parts(p, h, cfg)
    o, norm = lightning_inner(p, h, cfg, parts)
    return linear(apply_out_hook(norm * parts["gate"] * o, hook).astype(h.dtype), p["out_proj.weight"])


def lightning_operator(p: dict, h, cfg: Config, variant: str = "full") -> Mamba2Operator:
    """The lightning attention's operator for input ``h (B, L, D)`` (channels = heads x d).

    ``"full"`` (exact): ``diag(w sigmoid(g) / rms) K_h diag(sigmoid(v'))`` on the value projection
    ``v'``; ``"no_gate"``: without ``sigmoid(g)``; ``"no_norm"``: without ``w / rms``. ``output`` is
    always the block's own.
    """
    if variant not in VARIANTS:
        raise ValueError(f"{cfg.label} lightning attention variant must be one of {VARIANTS}, got {variant!r}")
    parts = lightning_parts(p, h, cfg)
    o, norm = lightning_inner(p, h, cfg, parts)
    T = lambda a: jnp.swapaxes(a, 1, 2).astype(f32)
    left = {"full": norm * parts["gate"], "no_gate": norm, "no_norm": parts["gate"]}[variant]
    output = T(norm * parts["gate"] * o)
    B, L, H, d = parts["q"].shape
    heads = lambda t: jnp.swapaxes(t, 1, 2)  # (B, L, H, d) -> (B, H, L, d)
    core = Mamba2Core(log_a=jnp.broadcast_to(-parts["slope"][None, :, None], (B, H, L)), dt=jnp.ones((B, H, L), f32),
                      D=jnp.zeros((H,), f32), q=heads(parts["q"]), k=heads(parts["k"]),
                      head=jnp.arange(H * d, dtype=jnp.int32) // d, left=T(left),
                      right=T(jax.nn.sigmoid(parts["v_pre"].astype(f32))))
    values = T(parts["v_pre"])
    return Mamba2Operator(values=values, offset=jnp.zeros_like(values), output=output, core=core)


# ----------------------------------------------------------------------------- layers

def mixer_forward(p: dict, h, cfg: Config, kind: str, hook=None):
    """Layer kind ``kind``'s token mixer: ``(B, L, D) -> (B, L, D)``."""
    if kind == "lightning":
        return lightning_forward(p, h, cfg, hook)
    return attention_forward(p, h, positions(*h.shape[:2]), cfg, hook)


def mixer_operator(p: dict, h, cfg: Config, kind: str, variant: str = "full"):
    """Layer kind ``kind``'s operator (attention ignores ``variant``)."""
    if kind == "lightning":
        return lightning_operator(p, h, cfg, variant)
    return attention_operator(p, h, positions(*h.shape[:2]), cfg)


def moe_forward(p: dict, x, cfg: Config):
    """HF ``MiniMaxSparseMoeBlock``: ``(B, L, D) -> (B, L, D)`` with ``gate.weight (E, D)``,
    ``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj (E, D, I)``; the chosen experts'
    softmax probabilities renormalised to sum 1."""
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    weights, experts = softmax_then_topk(linear(t, p["gate.weight"]), cfg.num_experts_per_tok)
    weights = weights / weights.sum(-1, keepdims=True)
    out = experts_forward(t, weights.astype(t.dtype), experts, p["experts.gate_up_proj"], p["experts.down_proj"],
                          gated_act(jax.nn.silu))
    return out.reshape(B, L, D)


def minimax_layer(layer: dict, h, cfg: Config, kind: str, hook, mixer_fn, ffn_fn, residual_scale=None):
    """HF ``MiniMaxDecoderLayer`` (``bamba.block.hybrid_layer``'s signature; ``residual_scale`` unused):
    ``x = norm(h)``, ``h = a_1 x + b_1 mixer(x)``, ``y = norm(h)``, ``h = a_2 y + b_2 ffn(y)``.
    Returns ``(h_next, x)``, both ``(B, L, D)``."""
    hook = hook or no_hook
    a1, b1, a2, b2 = (jnp.asarray(f, h.dtype) for f in cfg.residual_factors(kind))
    h = hook("hook_resid_pre", h)
    x = hook("mixer.hook_in", rms_norm(h, layer["input_layernorm"], cfg.rms_norm_eps))
    h = hook("hook_resid_mid", a1 * x + b1 * mixer_fn(layer["mixer"], x, cfg, kind, out_hook(hook)))
    y = rms_norm(h, layer["pre_ff_layernorm"], cfg.rms_norm_eps)
    return hook("hook_resid_post", a2 * y + b2 * ffn_fn(layer["feed_forward"], y, cfg)), x


FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, moe_forward, layer_fn=minimax_layer)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "EXACT_VARIANTS", "CHUNK", "slope_rates", "decay_tables", "lightning_parts", "lightning_inner",
           "lightning_forward", "lightning_operator", "mixer_forward", "mixer_operator", "moe_forward",
           "minimax_layer", "FUNCTIONS", "decoder_layer", "layer_forward", "lm_forward", "lm_forward_jit",
           "layer_forward_jit", "mixer_forward_jit", "mixer_operator_jit"]
