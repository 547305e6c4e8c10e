"""RWKV-5 ("Eagle", the RWKV team's HF ``Rwkv5ForCausalLM``): the time mix as pure functions
and its exact implicit operator; the block, the LM and the eval-mode rescaling are RWKV-4's
(``rwkv.block``, with this time mix).

Time mix on ``x = ln1(h) (B, L, C)``, with the token shift ``x'_t = x_{t-1}`` (``x'_0 = 0``):
``r, k, v, g`` are the ``receptance``, ``key``, ``value``, ``gate`` projections of ``x mu +
x' (1 - mu)`` (one ``time_mix_*`` each), split into ``H`` heads of ``S``; one constant decay per
key dimension ``w = exp(-exp(time_decay))`` (``log w`` broadcast over positions) and the bonus
``u = time_faaaa``. Per head the state ``S (V, K)`` runs ``S_t = S_{t-1} Diag(w) + v_t k_t^T``
and is read before the update plus the bonus: ``o_t = S_{t-1} r_t + (sum_k r_tk u_k k_tk) v_t``
(``ops.dplr_rule``, ``after=False``). Output: ``output(GroupNorm_H(o / head_size_divisor) *
silu(g))``, the ``output`` weight divided by ``2 ** (layer // rescale_every)`` in eval mode in half
precision (as the RWKV team's code: no rescaling in float32).

Operator (channels = the hidden width, head ``h`` owns ``S`` of them): RWKV-6's
(``rwkv6.block.head_operator``): ``H_c = diag(silu(g_c) w_c / sigma_h) M_h`` on the
head-centred values, ``offset_c = silu(g_c) b_c`` (``w``, ``b`` ``ln_x``'s weight and bias,
``sigma_h`` the row's standard deviation with the group norm's eps).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...nn.hooks import apply_out_hook
from ...operator import Mamba2Operator
from ...ops import from_first, full_precision, linear, zero_nan
from ..rwkv.block import block_forward as rwkv_block_forward
from ..rwkv.block import channel_mix_forward, mix, token_shift
from ..rwkv.block import lm_forward as rwkv_lm_forward
from ..rwkv6.block import head_operator, heads, normed, recurrence
from .config import Config

VARIANTS = ("full", "no_gate", "no_bonus")
EXACT_VARIANTS = ("full",)
f32 = jnp.float32


def group_norm_params(p: dict) -> dict:
    """``ln_x``'s weight and bias under the names ``rwkv6.block.normed`` reads (``g_norm.*``)."""
    return {"g_norm.weight": p["ln_x.weight"], "g_norm.bias": p["ln_x.bias"]}


def time_mix_parts(p: dict, x, cfg: Config) -> dict:
    """Intermediates of the RWKV-5 time mix for its input ``x (B, L, C)`` (after ``ln1``):
    ``r, k, log_w (B, H, L, S)``, ``v (B, H, L, S)`` float32 (NaN set to 0), ``bonus (B, H, L)``
    (``sum_k r u k``), ``gate (B, L, C)`` (``silu(g)``), and ``bad (B, H, L)`` (True from the
    first position whose inputs hold NaN; those rows are NaN in the output)."""
    H = cfg.num_heads
    prev = token_shift(x)
    proj = lambda name: linear(mix(x, prev, p["time_mix_" + name]), p[name + ".weight"]).astype(f32)
    r, k, v = heads(proj("receptance"), H), heads(proj("key"), H), heads(proj("value"), H)
    gate = jax.nn.silu(proj("gate"))
    log_w = jnp.broadcast_to(-jnp.exp(p["time_decay"].astype(f32))[:, None, :], r.shape)
    bonus = jnp.einsum("bhlk,hk->bhl", r * k, p["time_faaaa"].astype(f32))
    bad = from_first(jnp.isnan(k).any(-1) | jnp.isnan(v).any(-1), axis=2)
    bad = bad | jnp.isnan(r).any(-1) | jnp.isnan(bonus) | jnp.isnan(log_w).any(-1)
    return dict(r=zero_nan(r), k=zero_nan(k), v=zero_nan(v), log_w=zero_nan(log_w), bonus=zero_nan(bonus),
                gate=gate, bad=bad)


def time_mix_inner(p: dict, x, cfg: Config):
    """``GroupNorm(o / head_size_divisor) * silu(g)``: the time mix's output before ``output``,
    ``(B, L, C)`` float32."""
    q = time_mix_parts(p, x, cfg)
    y, _ = normed(recurrence(q, cfg), group_norm_params(p), cfg.group_norm_eps)
    return y * q["gate"]


def time_mix_forward(p: dict, x, cfg: Config, layer=0, hook=None):
    """HF ``Rwkv5SelfAttention.forward`` in eval mode (block ``layer``, may be traced: it only
    picks the rescaling divisor): ``(B, L, C) -> (B, L, C)``. ``hook``: optional ``(B, C, L) ->
    (B, C, L)`` on the gated, normed output before ``output`` (``mixer.hook_out``)."""
    y = apply_out_hook(time_mix_inner(p, x, cfg), hook)
    return linear(y.astype(x.dtype), p["output.weight"] / cfg.rescale(layer, x.dtype))


def time_mix_operator(p: dict, x, cfg: Config, variant: str = "full") -> Mamba2Operator:
    """The RWKV-5 time mix's operator for its input ``x (B, L, C)`` (channels = the hidden width).

    ``"full"`` (exact): ``diag(silu(g) w / sigma_h) M_h`` on the head-centred values, offset
    ``silu(g) b``; ``"no_gate"``: without the ``silu(g)`` gate; ``"no_bonus"``: ``M_h`` without
    the bonus ``u`` (no weight on the current token's own value). ``output`` is always the
    block's own (before the ``output`` projection, so independent of the rescaling).
    """
    if variant not in VARIANTS:
        raise ValueError(f"RWKV-5 variant must be one of {VARIANTS}, got {variant!r}")
    q = time_mix_parts(p, x, cfg)
    o = recurrence(q, cfg)
    core_args = dict(q=q["r"], k=q["k"], log_w=q["log_w"], after=False,
                     bonus=None if variant == "no_bonus" else q["bonus"])
    return head_operator(o, q["v"], q["gate"], group_norm_params(p), cfg.group_norm_eps, core_args, variant)


def block_forward(lp: dict, h, cfg: Config, layer=0, tap=None):
    """One RWKV-5 block in eval mode (RWKV-4's ``rwkv.block.block_forward`` with this time mix):
    ``(B, L, C) -> (h_next, x)``, ``x`` the time mix's input; ``lp`` may hold ``pre_ln`` (block
    0); ``tap``: optional ``(B, C, L)`` added to the time mix's operator output."""
    return rwkv_block_forward(lp, h, cfg, layer, tap, time_mix_forward)


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """HF ``Rwkv5ForCausalLM`` forward in eval mode: ``ids (B, L) -> logits (B, L, vocab)``
    float32, and the captured activations (``nn.hooks``); RWKV-4's ``rwkv.block.lm_forward``
    with this time mix (the blocks one after another)."""
    return rwkv_lm_forward(params, ids, cfg, capture, adds, sets, time_mix=time_mix_forward)


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
time_mix_operator_jit = jax.jit(full_precision(time_mix_operator), static_argnames=("cfg", "variant"))
# The layer index only picks the rescaling divisor: traced, so all blocks share one compile.
time_mix_forward_jit = jax.jit(full_precision(time_mix_forward), static_argnames=("cfg",))
block_forward_jit = jax.jit(full_precision(block_forward), static_argnames=("cfg",))

__all__ = ["VARIANTS", "EXACT_VARIANTS", "group_norm_params", "time_mix_parts", "time_mix_inner",
           "time_mix_forward", "time_mix_operator", "channel_mix_forward", "block_forward", "lm_forward",
           "lm_forward_jit", "time_mix_operator_jit", "time_mix_forward_jit", "block_forward_jit"]
