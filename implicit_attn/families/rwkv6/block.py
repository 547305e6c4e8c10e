"""RWKV-6 ("Finch", flash-linear-attention's ``RWKV6ForCausalLM``): the block math as pure functions
and the exact implicit operator of each time mix.

Layer ``i`` (pre-norm; layer 0 first applies ``pre_norm`` to the residual stream itself):
``h + attn(attn_norm(h))``, then ``h + ffn(ffn_norm(h))``; final ``norm``, ``lm_head``.

Time mix on ``x = attn_norm(h) (B, L, C)``, with the token shift ``d_t = x_{t-1} - x_t`` (``x_{-1} =
0``): five data-dependent interpolations ``m_* = x_bias_* + tanh((x + d mu) W1)_* W2_*`` (one LoRA
per r, w, k, v, g), then ``r, k = r_proj, k_proj(x + d m_*)`` ``(B, H, L, K)``, ``v = v_proj(...)``
``(B, H, L, V)``, the gate ``silu(g_proj(...))``, and one log decay per key dimension ``log w =
-exp(w_bias + tanh(x_w A) B)``. Per head the state ``S (V, K)`` runs ``S_t = S_{t-1} Diag(w_t) + v_t
k_t^T`` and is read before the update plus the bonus ``u``: ``o_t = S_{t-1} r_t + (sum_k r_tk u_k
k_tk) v_t`` (``ops.dplr_rule``, ``after=False``). Output: ``o_proj(GroupNorm_H(o) * gate)``.

Operator (channels = the value width, head ``h`` owns ``V`` of them): ``o_t = sum_j M_h[t, j] v_j``
with one matrix per head (``operator.DplrCore``). The group norm subtracts the head mean of ``o``,
which is ``M_h`` applied to the head mean of ``v`` (``M_h`` is shared by the head's channels), so
``H_c = diag(gate_c w_c / sigma_h) M_h`` acts on the **head-centred values** ``v_c - mean_h(v)``
and ``offset_c = gate_c b_c`` (``w``, ``b`` the norm's weight and bias, ``sigma_h`` the row's
standard deviation, from the block's own output).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...kernels import cpu as cpu_kernels
from ...nn import run_scan
from ...nn.hooks import ForwardHooks, apply_out_hook, layer_tap, no_hook, out_hook
from ...operator import DplrCore, Mamba2Operator
from ...ops import dplr_rule, embed, from_first, full_precision, linear, mark_nan, nan_rows, zero_nan
from ..rwkv.block import layer_norm, token_shift
from .config import Config

VARIANTS = ("full", "no_gate", "no_bonus")
EXACT_VARIANTS = ("full",)
f32 = jnp.float32
MIX_ORDER = ("r", "w", "k", "v", "g")  # rows of x_bias, groups of the mix LoRA


def norm(x, p: dict, eps: float):
    """fla's ``LayerNorm`` (``nn.LayerNorm``) with ``p = {"weight", "bias"?}``: ``(..., C)``."""
    return layer_norm(x, p["weight"], p.get("bias", jnp.zeros((), x.dtype)), eps)


def shift_delta(x):
    """``(B, L, C)``: ``x_{t-1} - x_t`` with ``x_{-1} = 0`` (fla's ``token_shift``)."""
    return token_shift(x) - x


def lora(x, p: dict, prefix: str, act=None, bias: bool = True):
    """fla's ``LoRA``: ``lora.2(act(lora.0(x)))`` with the weights under ``prefix``; ``act`` None is
    the identity. ``(..., in) -> (..., out)``."""
    y = linear(x, p[prefix + "lora.0.weight"])
    y = y if act is None else act(y)
    return linear(y, p[prefix + "lora.2.weight"], p[prefix + "lora.2.bias"] if bias else None)


def heads(t, H: int):
    """``(B, L, H d) -> (B, H, L, d)``."""
    B, L, _ = t.shape
    return jnp.swapaxes(t.reshape(B, L, H, -1), 1, 2)


def group_stats(o, eps: float):
    """Per-head mean and inverse standard deviation of ``o (B, H, L, V)`` over ``V`` (biased
    variance, as ``GroupNorm``): ``(mean (B, H, L), inv (B, H, L))``."""
    mu = jnp.mean(o, axis=-1)
    var = jnp.mean(jnp.square(o - mu[..., None]), axis=-1)
    return mu, jax.lax.rsqrt(var + eps)


def head_centred(v):
    """``v (B, H, L, V)`` minus its mean over each head's ``V`` channels."""
    return v - jnp.mean(v, axis=-1, keepdims=True)


def flat(t):
    """``(B, H, L, V) -> (B, L, H V)``."""
    B, H, L, V = t.shape
    return jnp.swapaxes(t, 1, 2).reshape(B, L, H * V)


def time_mix_parts(p: dict, x, cfg: Config) -> dict:
    """Intermediates of the RWKV-6 time mix for its input ``x (B, L, C)`` (after ``attn_norm``):
    ``r, k, log_w (B, H, L, K)``, ``v (B, H, L, V)`` float32 (NaN set to 0), ``bonus (B, H, L)``
    (``sum_k r u k``), ``gate (B, L, H V)`` (``silu(g)``), and ``bad (B, H, L)`` (True from the first
    position whose inputs hold NaN; those rows are NaN in the output)."""
    H = cfg.num_heads
    d = shift_delta(x)
    B, L, C = x.shape
    R = cfg.proj_low_rank_dim
    z = jnp.tanh(linear(x + d * p["x_proj.0.mu"], p["x_proj.0.linear.weight"])).reshape(B, L, 5, R)
    mix = jnp.einsum("blnr,cnr->blnc", z, p["x_proj.2.weight"].reshape(C, 5, R)) + p["x_bias"]
    m = dict(zip(MIX_ORDER, jnp.moveaxis(mix, 2, 0)))
    at = lambda n: x + d * m[n]
    r = heads(linear(at("r"), p["r_proj.linear.weight"]).astype(f32), H)
    k = heads(linear(at("k"), p["k_proj.linear.weight"]).astype(f32), H)
    v = heads(linear(at("v"), p["v_proj.linear.weight"]).astype(f32), H)
    gate = jax.nn.silu(linear(at("g"), p["g_proj.linear.weight"]).astype(f32))
    log_w = heads(-jnp.exp(lora(at("w"), p, "w_proj.linear.", jnp.tanh).astype(f32)), H)
    bonus = jnp.einsum("bhlk,hk->bhl", r * k, p["bonus"].astype(f32))
    bad = from_first(jnp.isnan(k).any(-1) | jnp.isnan(v).any(-1) | jnp.isnan(log_w).any(-1), axis=2)
    bad = bad | jnp.isnan(r).any(-1) | jnp.isnan(bonus)
    return dict(r=zero_nan(r), k=zero_nan(k), v=zero_nan(v), log_w=zero_nan(log_w), bonus=zero_nan(bonus),
                gate=gate, bad=bad)


def dplr_outputs(q, k, v, log_w, a=None, b=None, bonus=None, after: bool = True, **knobs):
    """``ops.dplr_rule``'s outputs ``(B, H, L, d_v)`` (arguments as there; ``knobs``: its ``chunk`` and
    ``decay_floor``): on CPU by the fused kernel's recurrence (``kernels.cpu.dplr_scan``) where it
    pays off (``kernels.cpu.recurrence_pays_off``), else, and in an export for an accelerator, by
    the chunked form (``nn.run_scan`` picks by the platform lowered for)."""
    given = {n: x for n, x in dict(a=a, b=b, bonus=bonus).items() if x is not None}
    chunked = lambda q, k, v, log_w, *xs: dplr_rule(q, k, v, log_w, **dict(zip(given, xs)), after=after, **knobs)
    kernel = lambda q, k, v, log_w, *xs: cpu_kernels.dplr_scan(q, k, v, log_w, **dict(zip(given, xs)), after=after)
    fast = kernel if cpu_kernels.recurrence_pays_off(k, v) else chunked
    return run_scan("auto", fast, chunked, q, k, v, log_w, *given.values())


def recurrence(q: dict, cfg: Config):
    """The per-head recurrence of ``time_mix_parts`` ``q``: ``o (B, H, L, V)`` float32 (NaN rows
    where ``q["bad"]``)."""
    o = dplr_outputs(q["r"], q["k"], q["v"], q["log_w"], bonus=q["bonus"], after=False)
    return mark_nan(o, q["bad"][..., None])


def normed(o, p: dict, eps: float):
    """``GroupNorm`` (one group per head) of ``o (B, H, L, V)`` with ``g_norm``'s weight and bias:
    ``(y (B, L, H V), inv (B, H, L))``."""
    mu, inv = group_stats(o, eps)
    y = flat((o - mu[..., None]) * inv[..., None]) * p["g_norm.weight"].astype(f32) + p["g_norm.bias"].astype(f32)
    return y, inv


def time_mix_inner(p: dict, x, cfg: Config):
    """``GroupNorm(o) * gate``: the time mix's output before ``o_proj``, ``(B, L, V)`` float32."""
    q = time_mix_parts(p, x, cfg)
    y, _ = normed(recurrence(q, cfg), p, cfg.group_norm_eps)
    return y * q["gate"]


def time_mix_forward(p: dict, x, cfg: Config, hook=None):
    """fla ``RWKV6Attention.forward``: ``(B, L, C) -> (B, L, C)``. ``hook``: optional ``(B, V, L)
    -> (B, V, L)`` on the gated, normed output before ``o_proj`` (``mixer.hook_out``)."""
    y = apply_out_hook(time_mix_inner(p, x, cfg), hook)
    return linear(y.astype(x.dtype), p["o_proj.weight"])


def channel_mix_forward(p: dict, x, cfg) -> jax.Array:
    """fla ``RWKV6FeedForward``: ``sigmoid(receptance(x + d mu_r)) * value(relu(key(x + d mu_k))^2)``,
    ``(B, L, C) -> (B, L, C)``."""
    d = shift_delta(x)
    k = jnp.square(jax.nn.relu(linear(x + d * p["key.mu"], p["key.linear.weight"])))
    r = linear(x + d * p["receptance.mu"], p["receptance.linear.weight"])
    return jax.nn.sigmoid(r) * linear(k, p["value.weight"])


def head_operator(o, v, gate, p: dict, eps: float, core_args: dict, variant: str, core=DplrCore) -> Mamba2Operator:
    """The operator of a per-head DPLR time mix followed by ``GroupNorm * gate`` (RWKV-5/6/7; xLSTM's
    mLSTM with its multi-head layer norm passes ``core=MlstmCore``).

    Args:
      o: ``(B, H, L, V)`` the recurrence's output (NaN rows kept); v: ``(B, H, L, V)`` its values;
      gate: ``(B, L, H V)`` float32 multiplying the normed output, or None;
      p: the mixer's params (``g_norm.weight``, ``g_norm.bias``); eps: the norm's eps;
      core_args: ``DplrCore`` fields (``q, k, log_w`` and optionally ``a, b, bonus, after``), and
        optionally ``outside (B, H, L)``: a weight on each position's own value added after the
        norm (RWKV-7's ``r_k`` term; the block's output then includes it);
      variant: ``"no_gate"`` leaves the gate out of ``H`` and the offset, ``"no_bonus"`` the
        ``outside`` term (the output keeps both);
      core: the ``HeadMatrixCore`` class built from ``core_args`` (default ``DplrCore``).
    Returns:
      ``Mamba2Operator`` on the head-centred values, ``output`` the block's own gated output.
    """
    B, H, L, V = v.shape
    y, inv = normed(o, p, eps)
    g = jnp.ones_like(y) if gate is None or variant == "no_gate" else gate
    T = lambda a: jnp.swapaxes(a, 1, 2)
    left = T(g * p["g_norm.weight"].astype(f32) * jnp.repeat(T(inv), V, axis=-1))
    output = T(y * (1.0 if gate is None else gate))
    offset = T(g * p["g_norm.bias"].astype(f32))
    args = dict(core_args)
    outside = args.pop("outside", None)
    if outside is not None:
        # A weight on the current token's raw value read outside the norm (RWKV-7's r_k bonus): on
        # the centred values it is a diagonal, and the head mean it leaves is an offset.
        diag = flat(jnp.repeat(outside[..., None], V, axis=-1))  # (B, L, H V)
        output = output + T(diag * flat(v) * (1.0 if gate is None else gate))
        if variant != "no_bonus":
            args["diag"] = zero_nan(T(g * diag))
            offset = offset + T(g * diag * flat(jnp.broadcast_to(jnp.mean(v, -1, keepdims=True), v.shape)))
    values = T(flat(head_centred(v)))
    return Mamba2Operator(values=values, offset=offset, output=output,
                          core=core(head=jnp.repeat(jnp.arange(H), V), left=nan_rows(left, output), **args))


def time_mix_operator(p: dict, x, cfg: Config, variant: str = "full") -> Mamba2Operator:
    """The RWKV-6 time mix's operator for its input ``x (B, L, C)`` (channels = the value width).

    ``"full"`` (exact): ``diag(gate w / sigma_h) M_h`` on the head-centred values, offset ``gate
    b``; ``"no_gate"``: without the ``silu(g)`` gate; ``"no_bonus"``: ``M_h`` without the bonus
    ``u`` (no weight on the current token's own value). ``output`` is always the block's own.
    """
    if variant not in VARIANTS:
        raise ValueError(f"RWKV-6 variant must be one of {VARIANTS}, got {variant!r}")
    q = time_mix_parts(p, x, cfg)
    o = recurrence(q, cfg)
    core_args = dict(q=q["r"], k=q["k"], log_w=q["log_w"], after=False,
                     bonus=None if variant == "no_bonus" else q["bonus"])
    return head_operator(o, q["v"], q["gate"], p, cfg.group_norm_eps, core_args, variant)


# ----------------------------------------------------------------------------- the LM

# the per-layer parameters the blocks read (``pre_norm`` is applied before the first block)
LAYER_KEYS = ("attn_norm", "ffn_norm", "attn", "ffn")


def rwkv6_block(lp: dict, h, cfg: Config, hook=None):
    """One fla ``RWKV6Block``: ``(B, L, C) -> (h_next, x)`` with ``x`` the time mix's input.
    ``lp``: ``{"attn_norm", "ffn_norm", "attn", "ffn"}`` (``pre_norm`` is applied by the caller);
    ``hook``: ``(point, x) -> x`` at the ``nn.hooks.MID_POINTS``."""
    hook = hook or no_hook
    h = hook("hook_resid_pre", h)
    x = hook("mixer.hook_in", norm(h, lp["attn_norm"], cfg.norm_eps))
    h = hook("hook_resid_mid", h + time_mix_forward(lp["attn"], x, cfg, out_hook(hook)))
    h = h + channel_mix_forward(lp["ffn"], norm(h, lp["ffn_norm"], cfg.norm_eps), cfg)
    return hook("hook_resid_post", h), x


def first_norm(params: dict, h, cfg):
    """Layer 0's ``pre_norm`` of the embeddings (when ``norm_first``)."""
    pre = params["layers"][0].get("pre_norm")
    return h if pre is None else norm(h, pre, cfg.norm_eps)


def head_logits(params: dict, h, cfg):
    """Final ``norm`` and ``lm_head`` (the embeddings when tied): ``(B, L, vocab)`` float32."""
    h = norm(h, params["norm"], cfg.norm_eps)
    head = params["embeddings"] if params.get("lm_head") is None else params["lm_head"]
    return (h.astype(head.dtype) @ head.T).astype(f32)


def block_forward(lp: dict, h, cfg: Config, tap=None):
    """``rwkv6_block`` with an optional ``tap (B, V, L)`` added to the time mix's operator output;
    ``lp`` may hold ``pre_norm`` (layer 0). Returns ``(h_next, x)``."""
    if lp.get("pre_norm") is not None:
        h = norm(h, lp["pre_norm"], cfg.norm_eps)
    return rwkv6_block(lp, h, cfg, layer_tap(tap))


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """fla ``RWKV6ForCausalLM`` forward: ``ids (B, L) -> logits (B, L, vocab)`` float32, and the
    captured activations (``nn.hooks``; ``hook_embed`` is before layer 0's ``pre_norm``). The layers
    run one after another (``ForwardHooks.run_layers``)."""
    layers = params["layers"]
    hooks = ForwardHooks(capture, adds, sets)
    h = first_norm(params, hooks("hook_embed", embed(params["embeddings"], ids)), cfg)
    h = hooks.run_layers(lambda h, i, lp, hook: rwkv6_block(lp, h, cfg, hook)[0], h, layers, LAYER_KEYS)
    return head_logits(params, h, cfg), hooks.captured


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
time_mix_forward_jit = jax.jit(full_precision(time_mix_forward), static_argnames=("cfg",))
time_mix_operator_jit = jax.jit(full_precision(time_mix_operator), static_argnames=("cfg", "variant"))
channel_mix_forward_jit = jax.jit(full_precision(channel_mix_forward), static_argnames=("cfg",))
block_forward_jit = jax.jit(full_precision(block_forward), static_argnames=("cfg",))

__all__ = ["VARIANTS", "EXACT_VARIANTS", "MIX_ORDER", "norm", "shift_delta", "lora", "heads", "group_stats",
           "head_centred", "flat", "time_mix_parts", "dplr_outputs", "recurrence", "normed", "time_mix_inner", "time_mix_forward",
           "channel_mix_forward", "head_operator", "time_mix_operator", "LAYER_KEYS", "rwkv6_block", "first_norm",
           "head_logits", "block_forward", "lm_forward", "lm_forward_jit", "time_mix_forward_jit",
           "time_mix_operator_jit", "channel_mix_forward_jit", "block_forward_jit"]
