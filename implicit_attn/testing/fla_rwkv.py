"""A plain-torch CPU reference of flash-linear-attention's (fla 0.6.0) RWKV-6 and RWKV-7 Hugging
Face models, checked against BlinkDL's official ``rwkv`` pip package (0.8.32).

fla's models need triton and a GPU (fused kernels). This module rebuilds them for tests:
``transformers`` classes with fla's config fields and defaults and fla's exact parameter names
and shapes, so that ``save_pretrained`` writes a checkpoint in fla's layout (``config.json`` with
``model_type`` ``"rwkv6"`` / ``"rwkv7"``, ``model.safetensors``) and ``from_pretrained`` reads
one back. The forward pass is written from the published math (token shift, data-dependent
lerps, low-rank projections, the per-head matrix-state recurrences evaluated step by step in
float32), so it is slow and meant for tiny models.

``official_state_dict`` renames the weights into the official RWKV-LM checkpoint layout, and
``official_logits`` runs the official package on them in a subprocess (its import-time switches
would otherwise leak into the test process). With the settings named there, the two agree to
float32 rounding.

This is a test reference: it is never imported by the library. Needs the ``test`` extra
(torch, transformers; ``rwkv`` for ``official_logits``): ``pip install implicit-attn[test]``.

    model = RWKV7ForCausalLM(RWKV7Config(hidden_size=128, num_hidden_layers=3, vocab_size=64))
    perturb_weights(model, seed=0)
    logits = model(torch.tensor([[1, 2, 3]])).logits             # (1, 3, 64) float32
    ref = official_logits(model, [[1, 2, 3]])                     # numpy, same shape
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from ..families.rwkv6.checkpoint import MIX_GROUPS, OFFICIAL_MIX_GROUPS
from .deps import require

torch = require("torch")
transformers = require("transformers")
hf_init = require("transformers.initialization")
hf_outputs = require("transformers.modeling_outputs")

nn = torch.nn
F = torch.nn.functional

# exp(-1/2): RWKV-7's largest per-step log decay magnitude (fla uses the exact value)
RWKV7_MAX_LOG_DECAY = math.exp(-0.5)
OFFICIAL_PACKAGE = "rwkv==0.8.32"

_ACTIVATIONS = {
    "sqrelu": lambda x: F.relu(x).square(),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported (one of {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _ffn_size(hidden_size: int, hidden_ratio, intermediate_size, default_ratio) -> int:
    """fla's FFN width: ``intermediate_size``, else ``hidden_size * hidden_ratio`` rounded up to 32."""
    if intermediate_size is not None:
        return intermediate_size
    ratio = default_ratio if hidden_ratio is None else hidden_ratio
    return 32 * math.ceil(int(hidden_size * ratio) / 32)


def _no_hybrid(config) -> None:
    if config.attn is not None:
        raise NotImplementedError(
            f"{type(config).__name__}.attn={config.attn!r}: hybrid models with softmax-attention layers are "
            "not implemented by this reference (only pure RWKV stacks, attn=None)")


# ----------------------------------------------------------------------------- configs

class RWKV6Config(transformers.PretrainedConfig):
    """fla 0.6.0's ``RWKV6Config`` (``model_type="rwkv6"``): the same fields and defaults.

    Derived sizes (as fla): key dim ``Kd = hidden_size * expand_k``, value dim
    ``Vd = hidden_size * expand_v`` (both integers), head sizes ``Kd / num_heads`` and
    ``Vd / num_heads``; FFN width ``intermediate_size`` or ``32 * ceil(int(hidden_size *
    hidden_ratio) / 32)``. ``proj_low_rank_dim`` is the rank of the token-shift lerp LoRA
    (``x_proj``) and ``gate_low_rank_dim`` the rank of the *decay* LoRA (``w_proj``). Official
    RWKV-6 models have ``expand_k = expand_v = 1`` and ``num_heads = hidden_size / 64``.

    One extra field: ``g_norm_eps`` (default ``None``), the epsilon of the per-head output
    GroupNorm. ``None`` means ``norm_eps``, which is what fla computes. Official RWKV-6 uses
    ``64e-5`` there; fla's converter sets that on the module object but never saves it in the
    config, so a reloaded fla RWKV-6 checkpoint runs with ``norm_eps``. Set
    ``g_norm_eps=64e-5`` to reproduce the official model (``official_logits``).

    ``attn`` (hybrid softmax-attention layers) is stored, but the models raise
    ``NotImplementedError`` if it is set. The loss-related fields (``fuse_*``, ``use_l2warp``)
    and ``attn_mode`` are stored only."""

    model_type = "rwkv6"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        attn_mode: str = "chunk",
        hidden_size: int = 2048,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        hidden_ratio: float | None = 3.5,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 24,
        num_heads: int = 4,
        proj_low_rank_dim: int = 32,
        gate_low_rank_dim: int = 64,
        hidden_act: str = "sqrelu",
        max_position_embeddings: int = 2048,
        norm_first: bool = True,
        norm_bias: bool = True,
        norm_eps: float = 1e-5,
        attn: dict | list | None = None,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fuse_norm: bool = True,
        fuse_cross_entropy: bool = True,
        fuse_linear_cross_entropy: bool = False,
        use_l2warp: bool = False,
        vocab_size: int = 32000,
        g_norm_eps: float | None = None,
        **kwargs,
    ):
        if fuse_cross_entropy and fuse_linear_cross_entropy:
            raise ValueError("fuse_cross_entropy and fuse_linear_cross_entropy cannot both be True")
        self.attn_mode = attn_mode
        self.hidden_size = hidden_size
        self.expand_k = expand_k
        self.expand_v = expand_v
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.norm_first = norm_first
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.proj_low_rank_dim = proj_low_rank_dim
        self.gate_low_rank_dim = gate_low_rank_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.norm_bias = norm_bias
        self.norm_eps = norm_eps
        self.attn = attn
        self.use_cache = use_cache
        self.initializer_range = initializer_range
        self.fuse_norm = fuse_norm
        self.fuse_cross_entropy = fuse_cross_entropy
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        self.use_l2warp = use_l2warp
        self.vocab_size = vocab_size
        self.g_norm_eps = g_norm_eps
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class RWKV7Config(transformers.PretrainedConfig):
    """fla 0.6.0's ``RWKV7Config`` (``model_type="rwkv7"``): the same fields, defaults and
    normalisation.

    ``head_dim`` / ``num_heads``: if only ``num_heads`` is given, ``head_dim = hidden_size //
    num_heads``; if only ``head_dim`` (default 64), ``num_heads = hidden_size // head_dim``.
    The layers use ``head_dim`` when it is set. ``value_dim`` becomes a per-layer list: ``None``
    gives ``[hidden_size] * num_hidden_layers``, an int ``[value_dim] * num_hidden_layers``; each
    entry must be a multiple of ``hidden_size`` (v_first is lerped into every layer, so in
    practice they are all equal). Ranks: ``decay_low_rank_dim`` (w), ``a_low_rank_dim`` (a),
    ``v_low_rank_dim`` (value residual), ``gate_low_rank_dim`` (output gate). The output
    GroupNorm's epsilon is ``head_dim * norm_eps`` (the official ``64e-5`` for 64 and 1e-5).
    ``fuse_norm`` also selects the key normalisation ``kk``: ``x / sqrt(sum x^2 + 1e-6)`` (True,
    fla's fused l2norm) or ``F.normalize`` (False, as the official code).

    ``attn`` (hybrid softmax-attention layers) is stored, but the models raise
    ``NotImplementedError`` if it is set. The loss-related fields and ``attn_mode`` are stored only."""

    model_type = "rwkv7"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        attn_mode: str = "chunk",
        hidden_size: int = 2048,
        hidden_ratio: float | None = 4,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 24,
        head_dim: int | None = 64,
        num_heads: int | None = None,
        decay_low_rank_dim: int = 64,
        gate_low_rank_dim: int = 128,
        a_low_rank_dim: int = 64,
        v_low_rank_dim: int = 16,
        hidden_act: str = "sqrelu",
        max_position_embeddings: int = 2048,
        norm_first: bool = True,
        norm_bias: bool = True,
        norm_eps: float = 1e-5,
        attn: dict | list | None = None,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fuse_norm: bool = True,
        fuse_cross_entropy: bool = True,
        fuse_linear_cross_entropy: bool = False,
        use_l2warp: bool = True,
        vocab_size: int = 32000,
        value_dim: int | list[int] | None = None,
        **kwargs,
    ):
        if fuse_cross_entropy and fuse_linear_cross_entropy:
            raise ValueError("fuse_cross_entropy and fuse_linear_cross_entropy cannot both be True")
        if head_dim is None and num_heads is not None:
            head_dim = int(hidden_size // num_heads)
        elif head_dim is not None and num_heads is None:
            num_heads = int(hidden_size // head_dim)
        if value_dim is None:
            value_dim = [hidden_size] * num_hidden_layers
        elif isinstance(value_dim, int):
            value_dim = [value_dim] * num_hidden_layers
        else:
            value_dim = list(value_dim)
            if len(value_dim) != num_hidden_layers:
                raise ValueError(f"value_dim has {len(value_dim)} entries for {num_hidden_layers} layers")
        for v in value_dim:
            if v < hidden_size or v % hidden_size:
                raise ValueError(f"value_dim entries must be multiples of hidden_size={hidden_size}, got {v}")
        self.attn_mode = attn_mode
        self.hidden_size = hidden_size
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.norm_first = norm_first
        self.num_hidden_layers = num_hidden_layers
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.value_dim = value_dim
        self.decay_low_rank_dim = decay_low_rank_dim
        self.gate_low_rank_dim = gate_low_rank_dim
        self.a_low_rank_dim = a_low_rank_dim
        self.v_low_rank_dim = v_low_rank_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.norm_bias = norm_bias
        self.norm_eps = norm_eps
        self.attn = attn
        self.use_cache = use_cache
        self.initializer_range = initializer_range
        self.fuse_norm = fuse_norm
        self.fuse_cross_entropy = fuse_cross_entropy
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        self.use_l2warp = use_l2warp
        self.vocab_size = vocab_size
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


# ----------------------------------------------------------------------------- recurrences

def rwkv6_recurrence(r, k, v, log_w, bonus, initial_state=None):
    """RWKV-6's per-head recurrence, step by step in float32 (read before the update, plus the bonus).

    ``r, k, log_w``: (B, T, H, K); ``v``: (B, T, H, V); ``bonus`` ``u``: (H, K); ``log_w`` is the
    log decay (``<= 0``); ``initial_state``: (B, H, K, V) or None (zeros). With the state ``S``
    (K x V per head)::

        o_t = r_t^T (S_{t-1} + diag(u) k_t v_t^T),    S_t = diag(exp(log_w_t)) S_{t-1} + k_t v_t^T

    Returns ``(o (B, T, H, V) float32, S_T (B, H, K, V) float32)``."""
    r, k, v, log_w, bonus = (t.float() for t in (r, k, v, log_w, bonus))
    B, T, H, K = k.shape
    S = (torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=k.device) if initial_state is None
         else initial_state.float())
    decay = log_w.exp()
    outs = []
    for t in range(T):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", r[:, t], S + bonus[:, :, None] * kv))
        S = decay[:, t, :, :, None] * S + kv
    return torch.stack(outs, dim=1), S


def rwkv7_recurrence(r, log_w, k, v, a, b, initial_state=None):
    """RWKV-7's per-head generalised delta rule, step by step in float32 (read after the update).

    ``r, log_w, k, a, b``: (B, T, H, K); ``v``: (B, T, H, V); ``initial_state``: (B, H, K, V) or
    None. With the key-major state ``S`` (K x V per head)::

        S_t = diag(exp(log_w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,    o_t = S_t^T r_t

    (RWKV-7 passes ``a = -kk``, ``b = kk * a_gate``; the low-rank term reads the state before
    the decay.) Returns ``(o (B, T, H, V) float32, S_T (B, H, K, V) float32)``."""
    r, log_w, k, v, a, b = (t.float() for t in (r, log_w, k, v, a, b))
    B, T, H, K = k.shape
    S = (torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=k.device) if initial_state is None
         else initial_state.float())
    decay = log_w.exp()
    outs = []
    for t in range(T):
        read = torch.einsum("bhk,bhkv->bhv", a[:, t], S)
        S = (decay[:, t, :, :, None] * S + b[:, t, :, :, None] * read[:, :, None, :]
             + k[:, t, :, :, None] * v[:, t, :, None, :])
        outs.append(torch.einsum("bhk,bhkv->bhv", r[:, t], S))
    return torch.stack(outs, dim=1), S


# ----------------------------------------------------------------------------- shared modules

def _token_delta(x):
    """``shift(x) - x`` for (B, T, C): ``shift(x)_t = x_{t-1}``, zero before the first token."""
    previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
    return previous - x


def _layer_norm(config) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class _LowRank(nn.Module):
    """``x -> lora.2(act(lora.0(x)))``: ``lora.0.weight`` (rank, d_in), ``lora.2.weight``
    (d_out, rank) and, with ``bias``, ``lora.2.bias`` (d_out). ``act``: None (identity), "tanh"
    or "sigmoid"."""

    def __init__(self, d_in: int, d_out: int, rank: int, act: str | None, bias: bool = True):
        super().__init__()
        middle = {None: nn.Identity, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[act]()
        self.lora = nn.Sequential(nn.Linear(d_in, rank, bias=False), middle, nn.Linear(rank, d_out, bias=bias))

    def forward(self, x):
        return self.lora(x)


class _LerpLinear(nn.Module):
    """``linear(x + delta * mu)``. With ``own_mu`` the lerp weight is the parameter ``mu`` (d_in);
    otherwise it is passed in (data-dependent). ``linear`` is a bias-free ``nn.Linear`` or, with
    ``rank``, a tanh ``_LowRank`` with bias."""

    def __init__(self, d_in: int, d_out: int, own_mu: bool, rank: int | None = None):
        super().__init__()
        self.linear = (nn.Linear(d_in, d_out, bias=False) if rank is None
                       else _LowRank(d_in, d_out, rank, "tanh"))
        if own_mu:
            self.mu = nn.Parameter(torch.zeros(d_in))

    def forward(self, x, delta, mu=None):
        return self.linear(x + delta * (self.mu if mu is None else mu))


# ----------------------------------------------------------------------------- RWKV-6

class RWKV6Attention(nn.Module):
    """RWKV-6 time mixing (fla's ``RWKV6Attention`` parameters): ``forward(x (B, T, C)) -> (B, T, C)``."""

    def __init__(self, config: RWKV6Config, layer_idx: int):
        super().__init__()
        C, H = config.hidden_size, config.num_heads
        key_dim, value_dim = C * config.expand_k, C * config.expand_v
        self.key_dim, self.value_dim = round(key_dim), round(value_dim)
        if not (math.isclose(key_dim, self.key_dim) and math.isclose(value_dim, self.value_dim)):
            raise ValueError(f"hidden_size * expand_k / expand_v must be integers, got {key_dim}, {value_dim}")
        if self.key_dim % H or self.value_dim % H:
            raise ValueError(f"key dim {self.key_dim} and value dim {self.value_dim} must be divisible by "
                             f"num_heads={H}")
        self.layer_idx = layer_idx
        self.num_heads = H
        self.head_k_dim, self.head_v_dim = self.key_dim // H, self.value_dim // H
        R = self.proj_low_rank_dim = config.proj_low_rank_dim
        self.x_proj = nn.Sequential(_LerpLinear(C, 5 * R, own_mu=True), nn.Tanh(), nn.Linear(5 * R, C, bias=False))
        self.x_bias = nn.Parameter(torch.zeros(5, C))  # rows: r, w, k, v, g
        self.r_proj = _LerpLinear(C, self.key_dim, own_mu=False)
        self.w_proj = _LerpLinear(C, self.key_dim, own_mu=False, rank=config.gate_low_rank_dim)
        self.k_proj = _LerpLinear(C, self.key_dim, own_mu=False)
        self.v_proj = _LerpLinear(C, self.value_dim, own_mu=False)
        self.g_proj = _LerpLinear(C, self.value_dim, own_mu=False)
        self.bonus = nn.Parameter(torch.zeros(H, self.head_k_dim))
        eps = config.norm_eps if config.g_norm_eps is None else config.g_norm_eps
        self.g_norm = nn.GroupNorm(H, self.value_dim, eps=eps, affine=True)
        self.o_proj = nn.Linear(self.value_dim, C, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        H, R = self.num_heads, self.proj_low_rank_dim
        delta = _token_delta(x)
        z = self.x_proj[1](self.x_proj[0](x, delta).view(B, T, 5, R))
        # group n of the low-rank code goes through columns n*R:(n+1)*R of x_proj.2
        z = torch.einsum("btnr,cnr->btnc", z, self.x_proj[2].weight.view(C, 5, R)) + self.x_bias
        mr, mw, mk, mv, mg = z.unbind(-2)
        r = self.r_proj(x, delta, mr)
        log_w = -torch.exp(self.w_proj(x, delta, mw))
        k = self.k_proj(x, delta, mk)
        v = self.v_proj(x, delta, mv)
        g = self.g_proj(x, delta, mg)
        heads_k = lambda t: t.view(B, T, H, self.head_k_dim)  # noqa: E731
        o, _ = rwkv6_recurrence(heads_k(r), heads_k(k), v.view(B, T, H, self.head_v_dim), heads_k(log_w),
                                self.bonus)
        o = self.g_norm(o.reshape(B * T, self.value_dim)).view(B, T, self.value_dim) * F.silu(g)
        return self.o_proj(o)


class RWKV6FeedForward(nn.Module):
    """RWKV-6 channel mixing: ``sigmoid(receptance(x')) * value(act(key(x'')))`` with token-shift
    lerps; ``forward(x (B, T, C)) -> (B, T, C)``."""

    def __init__(self, config: RWKV6Config, layer_idx: int):
        super().__init__()
        C = config.hidden_size
        width = _ffn_size(C, config.hidden_ratio, config.intermediate_size, 3.5)
        self.layer_idx = layer_idx
        self.key = _LerpLinear(C, width, own_mu=True)
        self.value = nn.Linear(width, C, bias=False)
        self.receptance = _LerpLinear(C, C, own_mu=True)
        self.act_fn = _activation(config.hidden_act)

    def forward(self, x):
        delta = _token_delta(x)
        return torch.sigmoid(self.receptance(x, delta)) * self.value(self.act_fn(self.key(x, delta)))


class RWKV6Block(nn.Module):
    """Pre-norm block: (layer 0 with ``norm_first``: ``pre_norm`` on the residual stream first),
    ``h + attn(attn_norm(h))``, then ``+ ffn(ffn_norm(.))``; (B, T, C) -> (B, T, C)."""

    def __init__(self, config: RWKV6Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        if config.norm_first and layer_idx == 0:
            self.pre_norm = _layer_norm(config)
        self.attn_norm = _layer_norm(config)
        self.attn = RWKV6Attention(config, layer_idx)
        self.ffn_norm = _layer_norm(config)
        self.ffn = RWKV6FeedForward(config, layer_idx)

    def forward(self, h):
        residual = self.pre_norm(h) if hasattr(self, "pre_norm") else h
        residual = residual + self.attn(self.attn_norm(residual))
        return residual + self.ffn(self.ffn_norm(residual))


# ----------------------------------------------------------------------------- RWKV-7

def _default_rank(value, scale: float, hidden_size: int, factor: float) -> int:
    """fla's fallback LoRA rank when a rank is None: ``max(32, round(scale*sqrt(C)*factor/32)*32)``."""
    if value is not None:
        return value
    return max(32, int(round(scale * hidden_size ** 0.5 * factor / 32) * 32))


class RWKV7Attention(nn.Module):
    """RWKV-7 time mixing (fla's ``RWKV7Attention`` parameters):
    ``forward(x (B, T, C), v_first (B, T, Vd)) -> (o (B, T, C), v_first)``. Layer 0 returns its
    own values as ``v_first``; later layers lerp their values towards it and pass it on."""

    def __init__(self, config: RWKV7Config, layer_idx: int):
        super().__init__()
        C = config.hidden_size
        if config.head_dim is not None:
            if C % config.head_dim:
                raise ValueError(f"hidden_size={C} must be divisible by head_dim={config.head_dim}")
            self.head_dim = config.head_dim
        elif config.num_heads is not None:
            if C % config.num_heads:
                raise ValueError(f"hidden_size={C} must be divisible by num_heads={config.num_heads}")
            self.head_dim = C // config.num_heads
        else:
            raise ValueError("RWKV7Config needs head_dim or num_heads")
        H = self.num_heads = C // self.head_dim
        self.key_dim = C
        self.value_dim = config.value_dim[layer_idx]
        if self.value_dim % H:
            raise ValueError(f"value_dim={self.value_dim} must be divisible by num_heads={H}")
        self.head_v_dim = self.value_dim // H
        self.layer_idx = layer_idx
        self.fuse_norm = config.fuse_norm
        factor = self.head_dim / 64
        dw = _default_rank(config.decay_low_rank_dim, 2.5, C, factor)
        dg = _default_rank(config.gate_low_rank_dim, 5.0, C, 1.0)
        da = _default_rank(config.a_low_rank_dim, 2.5, C, factor)
        dv = _default_rank(config.v_low_rank_dim, 1.7, C, factor)
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, nn.Parameter(torch.zeros(1, 1, C)))
        self.k_k = nn.Parameter(torch.zeros(self.key_dim))
        self.k_a = nn.Parameter(torch.zeros(self.key_dim))
        self.r_k = nn.Parameter(torch.zeros(H, self.head_dim))
        self.r_proj = nn.Linear(C, self.key_dim, bias=False)
        self.k_proj = nn.Linear(C, self.key_dim, bias=False)
        self.v_proj = nn.Linear(C, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, C, bias=False)
        self.w_lora = _LowRank(C, self.key_dim, dw, "tanh")
        if layer_idx != 0:
            self.v_lora = _LowRank(C, self.value_dim, dv, None)
        self.a_lora = _LowRank(C, self.key_dim, da, None)
        self.g_lora = _LowRank(C, self.value_dim, dg, "sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(H, self.value_dim, eps=self.head_dim * config.norm_eps, affine=True)

    def forward(self, x, v_first):
        B, T, C = x.shape
        H, D, Dv = self.num_heads, self.head_dim, self.head_v_dim
        delta = _token_delta(x)
        xr, xw, xk, xv, xa, xg = (x + delta * m for m in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g))
        r = self.r_proj(xr)
        log_w = -RWKV7_MAX_LOG_DECAY * torch.sigmoid(self.w_lora(xw))
        k = self.k_proj(xk)
        v = self.v_proj(xv)
        if self.layer_idx == 0:
            v_first = v
        else:
            v = torch.lerp(v, v_first, torch.sigmoid(self.v_lora(xv)))
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = (k * self.k_k).view(B, T, H, D)
        if self.fuse_norm:  # fla's l2norm: eps inside the square root
            kk = kk / torch.sqrt(kk.square().sum(-1, keepdim=True) + 1e-6)
        else:
            kk = F.normalize(kk, dim=-1)
        k = k * (1 + (a - 1) * self.k_a)  # kk above uses the key before this update
        r4, k4, a4, v4 = r.view(B, T, H, D), k.view(B, T, H, D), a.view(B, T, H, D), v.view(B, T, H, Dv)
        o, _ = rwkv7_recurrence(r4, log_w.view(B, T, H, D), k4, v4, -kk, kk * a4)
        o = self.g_norm(o.reshape(B * T, self.value_dim)).view(B, T, self.value_dim)
        bonus = (r4 * k4 * self.r_k).sum(-1, keepdim=True) * v4
        o = (o + bonus.reshape(B, T, self.value_dim)) * g
        return self.o_proj(o), v_first


class RWKV7FeedForward(nn.Module):
    """RWKV-7 channel mixing ``value(act(key(x + delta * x_k)))``; (B, T, C) -> (B, T, C)."""

    def __init__(self, config: RWKV7Config, layer_idx: int):
        super().__init__()
        C = config.hidden_size
        width = _ffn_size(C, config.hidden_ratio, config.intermediate_size, 4)
        self.layer_idx = layer_idx
        self.x_k = nn.Parameter(torch.zeros(C))
        self.key = nn.Linear(C, width, bias=False)
        self.value = nn.Linear(width, C, bias=False)
        self.act_fn = _activation(config.hidden_act)

    def forward(self, x):
        return self.value(self.act_fn(self.key(x + _token_delta(x) * self.x_k)))


class RWKV7Block(nn.Module):
    """As ``RWKV6Block``, threading ``v_first``: ``forward(h, v_first) -> (h, v_first)``."""

    def __init__(self, config: RWKV7Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        if config.norm_first and layer_idx == 0:
            self.pre_norm = _layer_norm(config)
        self.attn_norm = _layer_norm(config)
        self.attn = RWKV7Attention(config, layer_idx)
        self.ffn_norm = _layer_norm(config)
        self.ffn = RWKV7FeedForward(config, layer_idx)

    def forward(self, h, v_first):
        residual = self.pre_norm(h) if hasattr(self, "pre_norm") else h
        o, v_first = self.attn(self.attn_norm(residual), v_first)
        residual = residual + o
        return residual + self.ffn(self.ffn_norm(residual)), v_first


# ----------------------------------------------------------------------------- HF models

def _spread(n_heads: int, head_size: int, low: float, high: float, like):
    """(n_heads * head_size,): ``linspace(low, high, head_size)`` in every head (on ``like``'s device)."""
    return torch.linspace(low, high, head_size, dtype=like.dtype, device=like.device).repeat(n_heads)


class _RwkvPreTrainedModel(transformers.PreTrainedModel):
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module):
        """Random init: normal(0, initializer_range) for linears and embeddings, ones / zeros for
        norms; RWKV's own parameters non-degenerate: lerp weights uniform in (0, 1), bonus /
        ``r_k`` small normal, decay biases spread per head from slow to fast, ``k_k`` / ``k_a``
        uniform in (0.5, 1.5). Uses ``transformers.initialization`` (skips loaded parameters)."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            hf_init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                hf_init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            hf_init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
            if module.weight is not None:
                hf_init.ones_(module.weight)
            if module.bias is not None:
                hf_init.zeros_(module.bias)
        elif isinstance(module, _LerpLinear) and hasattr(module, "mu"):
            hf_init.uniform_(module.mu, 0.0, 1.0)
        elif isinstance(module, RWKV6Attention):
            hf_init.uniform_(module.x_bias, 0.0, 1.0)
            hf_init.normal_(module.bonus, mean=0.0, std=0.1)
            # raw decay d, decay exp(-exp(d)): from 0.9975 (d = -6) to 0.07 (d = 1) in every head
            bias = module.w_proj.linear.lora[2].bias
            hf_init.copy_(bias, _spread(module.num_heads, module.head_k_dim, -6.0, 1.0, bias))
        elif isinstance(module, RWKV7Attention):
            for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
                hf_init.uniform_(getattr(module, name), 0.0, 1.0)
            hf_init.uniform_(module.k_k, 0.5, 1.5)
            hf_init.uniform_(module.k_a, 0.5, 1.5)
            hf_init.normal_(module.r_k, mean=0.0, std=0.1)
            # decay exp(-e^-1/2 sigmoid(b)): from 0.9985 (b = -6) to 0.55 (b = 4) in every head
            bias = module.w_lora.lora[2].bias
            hf_init.copy_(bias, _spread(module.num_heads, module.head_dim, -6.0, 4.0, bias))
            hf_init.uniform_(module.a_lora.lora[2].bias, -1.0, 1.0)
            if hasattr(module, "v_lora"):
                hf_init.uniform_(module.v_lora.lora[2].bias, -0.5, 1.5)
        elif isinstance(module, RWKV7FeedForward):
            hf_init.uniform_(module.x_k, 0.0, 1.0)


class _Backbone:
    """Shared parts of the two backbones (embeddings, layers, final norm)."""

    def _build(self, config, block_cls):
        _no_hybrid(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([block_cls(config, i) for i in range(config.num_hidden_layers)])
        self.norm = _layer_norm(config)

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value


class _CausalLM:
    """Shared parts of the two ``*ForCausalLM`` classes."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, use_cache=False, attention_mask=None, labels=None, **kwargs):
        """``input_ids`` (B, L) int -> ``CausalLMOutput(logits=(B, L, vocab) float32)``. No cache
        (``use_cache`` is ignored), no loss, no padding masks."""
        if input_ids is None:
            raise ValueError("input_ids is required")
        if labels is not None:
            raise NotImplementedError("labels: this reference computes logits only, no loss")
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
            raise NotImplementedError("attention_mask with padding is not supported by this reference")
        states = self.model(input_ids, output_hidden_states=True)
        return hf_outputs.CausalLMOutput(logits=self.lm_head(states[-1]).float(),
                                         hidden_states=states if kwargs.get("output_hidden_states") else None)


class RWKV6Model(_Backbone, _RwkvPreTrainedModel):
    """fla's ``RWKV6Model``: ``forward(input_ids (B, L)) -> final-normed hidden states (B, L, C)``
    (or every layer's input and the final-normed output, with ``output_hidden_states``)."""

    config_class = RWKV6Config
    _no_split_modules = ["RWKV6Block"]

    def __init__(self, config: RWKV6Config):
        super().__init__(config)
        self._build(config, RWKV6Block)
        self.post_init()

    def forward(self, input_ids, output_hidden_states: bool = False, **kwargs):
        """``(B, L, C)`` final-normed hidden states; with ``output_hidden_states`` the tuple fla
        returns: each layer's input (the embeddings first), then the final-normed output."""
        h = self.embeddings(input_ids)
        states = []
        for layer in self.layers:
            states.append(h)
            h = layer(h)
        h = self.norm(h)
        return tuple(states) + (h,) if output_hidden_states else h


class RWKV6ForCausalLM(_CausalLM, _RwkvPreTrainedModel):
    """fla's ``RWKV6ForCausalLM`` in plain torch (float32, CPU): ``.model`` (``RWKV6Model``) and
    ``lm_head``; state-dict keys and shapes as fla's. ``forward(input_ids (B, L))`` ->
    ``CausalLMOutput(logits (B, L, vocab) float32)``. Eval mode after construction; the head is
    tied to the embeddings only if ``config.tie_word_embeddings``."""

    config_class = RWKV6Config
    _no_split_modules = ["RWKV6Block"]

    def __init__(self, config: RWKV6Config):
        super().__init__(config)
        self.model = RWKV6Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.eval()


class RWKV7Model(_Backbone, _RwkvPreTrainedModel):
    """fla's ``RWKV7Model``: ``forward(input_ids (B, L)) -> final-normed hidden states (B, L, C)``;
    ``v_first`` (layer 0's values) is threaded through the layers."""

    config_class = RWKV7Config
    _no_split_modules = ["RWKV7Block"]

    def __init__(self, config: RWKV7Config):
        super().__init__(config)
        self._build(config, RWKV7Block)
        self.post_init()

    def forward(self, input_ids, output_hidden_states: bool = False, **kwargs):
        """As ``RWKV6Model.forward``."""
        h = self.embeddings(input_ids)
        v_first = torch.zeros_like(h)
        states = []
        for layer in self.layers:
            states.append(h)
            h, v_first = layer(h, v_first)
        h = self.norm(h)
        return tuple(states) + (h,) if output_hidden_states else h


class RWKV7ForCausalLM(_CausalLM, _RwkvPreTrainedModel):
    """fla's ``RWKV7ForCausalLM`` in plain torch (float32, CPU); as ``RWKV6ForCausalLM``."""

    config_class = RWKV7Config
    _no_split_modules = ["RWKV7Block"]

    def __init__(self, config: RWKV7Config):
        super().__init__(config)
        self.model = RWKV7Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.eval()


# ----------------------------------------------------------------------------- random weights

@torch.no_grad()
def perturb_weights(model, seed: int = 0):
    """Set every parameter of an ``RWKV6ForCausalLM`` / ``RWKV7ForCausalLM`` to a seeded random
    value of a realistic scale, away from any trivial initial value (so that every path matters
    in a comparison): embeddings N(0, 1); linear weights N(0, 1/fan_in) (LoRA up-projections and
    the head smaller); norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2); lerp weights U(0, 1);
    ``k_k`` / ``k_a`` U(0.5, 1.5); bonus / ``r_k`` N(0, 0.3^2); LoRA biases (decay, a, value
    residual) N(-0.5, 1). Logits come out O(1..10). Returns ``model``."""
    gen = torch.Generator().manual_seed(seed)

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)

    def uniform(p, low, high):
        p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32) * (high - low) + low)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embeddings.weight"):
            normal(p, 1.0)
        elif "norm." in name or name.startswith("norm"):
            normal(p, 0.1, 1.0 if leaf == "weight" else 0.0)
        elif leaf in ("mu", "x_bias", "x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            uniform(p, 0.0, 1.0)
        elif leaf in ("k_k", "k_a"):
            uniform(p, 0.5, 1.5)
        elif leaf in ("bonus", "r_k"):
            normal(p, 0.3)
        elif name.endswith("lora.2.bias"):
            normal(p, 1.0, -0.5)
        elif name.endswith("lora.2.weight") or name.endswith("x_proj.2.weight"):
            rank = p.shape[1] // 5 if "x_proj" in name else p.shape[1]
            normal(p, 0.5 * rank ** -0.5)
        elif name == "lm_head.weight":
            normal(p, 3.0 * p.shape[1] ** -0.5)
        elif leaf == "weight" and p.ndim == 2:
            normal(p, p.shape[1] ** -0.5)
        else:
            raise KeyError(f"perturb_weights: no rule for parameter {name!r} {tuple(p.shape)}")
    return model


# ----------------------------------------------------------------------------- official package

def _version(model) -> int:
    if isinstance(model, RWKV6ForCausalLM):
        return 6
    if isinstance(model, RWKV7ForCausalLM):
        return 7
    raise TypeError(f"expected RWKV6ForCausalLM or RWKV7ForCausalLM, got {type(model).__name__}")


# official RWKV-6 stores its five lerp LoRA groups in the order w, k, v, r, g; fla in r, w, k, v, g
_V6_OFFICIAL_GROUPS = OFFICIAL_MIX_GROUPS
_V6_FLA_GROUPS = MIX_GROUPS


@torch.no_grad()
def official_state_dict(model) -> dict:
    """The weights of an ``RWKV6ForCausalLM`` / ``RWKV7ForCausalLM`` under the official RWKV-LM
    checkpoint names and shapes (``emb.weight``, ``blocks.{i}.ln0/ln1/ln2``, ``blocks.{i}.att.*``,
    ``blocks.{i}.ffn.*``, ``ln_out``, ``head.weight``): the inverse of fla's converters. RWKV-6:
    ``time_maa_x/w/k/v/r/g`` (1, 1, C), ``time_maa_w1`` (C, 5R) and ``time_maa_w2`` (5, R, C) with
    the LoRA groups reordered from fla's r, w, k, v, g to w, k, v, r, g, ``time_decay`` (1, 1, C),
    ``time_decay_w1`` (C, G), ``time_decay_w2`` (G, C), ``time_faaaa`` (H, N), ``ln_x``. RWKV-7:
    ``x_*`` (1, 1, C), ``w0/a0/v0`` (1, 1, C), ``w1/a1/v1/g1`` (C, rank), ``w2/a2/v2/g2`` (rank, C),
    ``k_k/k_a`` (1, 1, C), ``r_k`` (H, N), ``ln_x``; layer 0 has no ``v0/v1/v2`` (the official
    loader sets them to empty tensors itself). Linear weights stay (out, in). Missing norm biases
    (``norm_bias=False``) become zeros. Returns ``name -> float32 tensor`` (copies).

    Raises ``ValueError`` for configurations the official code cannot express: no ``pre_norm``
    (``norm_first=False``: the official loader folds ``ln0`` into the embeddings), RWKV-6 key /
    value dims other than ``hidden_size``, RWKV-7 value dims other than ``hidden_size``."""
    version = _version(model)
    cfg = model.config
    C = cfg.hidden_size
    if not cfg.norm_first:
        raise ValueError("the official RWKV models need norm_first=True (layer 0's ln0)")
    fla = {k: v.detach().float().clone().contiguous() for k, v in model.state_dict().items()}
    out = {}

    def ln(official: str, ours: str):
        out[official + ".weight"] = fla[ours + ".weight"]
        out[official + ".bias"] = fla.get(ours + ".bias", torch.zeros(C))

    out["emb.weight"] = fla["model.embeddings.weight"]
    ln("ln_out", "model.norm")
    out["head.weight"] = fla["lm_head.weight"]
    mix = lambda t: t.reshape(1, 1, -1)  # noqa: E731
    for i, layer in enumerate(model.model.layers):
        b, p = f"blocks.{i}.", f"model.layers.{i}."
        if i == 0:
            ln(b + "ln0", p + "pre_norm")
        ln(b + "ln1", p + "attn_norm")
        ln(b + "ln2", p + "ffn_norm")
        a = p + "attn."
        ln(b + "att.ln_x", a + "g_norm")
        out[b + "att.output.weight"] = fla[a + "o_proj.weight"]
        if version == 6:
            attn = layer.attn
            if attn.key_dim != C or attn.value_dim != C:
                raise ValueError("the official RWKV-6 code needs expand_k = expand_v = 1 "
                                 f"(key dim {attn.key_dim}, value dim {attn.value_dim}, hidden {C})")
            R = attn.proj_low_rank_dim
            order = [_V6_FLA_GROUPS.index(n) for n in _V6_OFFICIAL_GROUPS]
            out[b + "att.time_maa_x"] = mix(fla[a + "x_proj.0.mu"])
            w1 = fla[a + "x_proj.0.linear.weight"].t().reshape(C, 5, R)[:, order]
            out[b + "att.time_maa_w1"] = w1.reshape(C, 5 * R).contiguous()
            out[b + "att.time_maa_w2"] = fla[a + "x_proj.2.weight"].t().reshape(5, R, C)[order].contiguous()
            for row, n in enumerate(_V6_FLA_GROUPS):
                out[b + f"att.time_maa_{n}"] = mix(fla[a + "x_bias"][row])
            out[b + "att.time_decay"] = mix(fla[a + "w_proj.linear.lora.2.bias"])
            out[b + "att.time_decay_w1"] = fla[a + "w_proj.linear.lora.0.weight"].t().contiguous()
            out[b + "att.time_decay_w2"] = fla[a + "w_proj.linear.lora.2.weight"].t().contiguous()
            out[b + "att.time_faaaa"] = fla[a + "bonus"]
            for official, ours in (("receptance", "r_proj"), ("key", "k_proj"), ("value", "v_proj"),
                                   ("gate", "g_proj")):
                out[b + f"att.{official}.weight"] = fla[a + f"{ours}.linear.weight"]
            out[b + "ffn.time_maa_k"] = mix(fla[p + "ffn.key.mu"])
            out[b + "ffn.time_maa_r"] = mix(fla[p + "ffn.receptance.mu"])
            out[b + "ffn.key.weight"] = fla[p + "ffn.key.linear.weight"]
            out[b + "ffn.receptance.weight"] = fla[p + "ffn.receptance.linear.weight"]
            out[b + "ffn.value.weight"] = fla[p + "ffn.value.weight"]
        else:
            if layer.attn.value_dim != C:
                raise ValueError("the official RWKV-7 code needs value_dim = hidden_size "
                                 f"({layer.attn.value_dim} != {C})")
            for n in "rwkvag":
                out[b + f"att.x_{n}"] = fla[a + f"x_{n}"]
            out[b + "att.k_k"] = mix(fla[a + "k_k"])
            out[b + "att.k_a"] = mix(fla[a + "k_a"])
            out[b + "att.r_k"] = fla[a + "r_k"]
            for official, ours in (("receptance", "r_proj"), ("key", "k_proj"), ("value", "v_proj")):
                out[b + f"att.{official}.weight"] = fla[a + f"{ours}.weight"]
            for n in "wavg":
                if n == "v" and i == 0:
                    continue
                lora = a + f"{n}_lora.lora."
                if n != "g":
                    out[b + f"att.{n}0"] = mix(fla[lora + "2.bias"])
                out[b + f"att.{n}1"] = fla[lora + "0.weight"].t().contiguous()
                out[b + f"att.{n}2"] = fla[lora + "2.weight"].t().contiguous()
            out[b + "ffn.x_k"] = mix(fla[p + "ffn.x_k"])
            out[b + "ffn.key.weight"] = fla[p + "ffn.key.weight"]
            out[b + "ffn.value.weight"] = fla[p + "ffn.value.weight"]
    return out


# One worker process per package mode (RWKV-7 or not) serves every request of this process:
# importing torch and the package costs about 2 s, the tiny models' runs milliseconds. It reads
# one JSON request per line on stdin and answers one JSON line on the pipe its stdout was when it
# started; the package's own prints go to its stderr (a file, shown when a request fails).
_OFFICIAL_WORKER = r"""
import json, os, sys, traceback
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
import numpy as np
import torch
from rwkv.model import RWKV
for line in sys.stdin:
    req = json.loads(line)
    try:
        os.environ["RWKV_RESCALE_LAYER"] = str(req["rescale_layer"])  # read when a model is built
        with open(req["tokens"]) as f:
            rows = json.load(f)
        model = RWKV(req["weights"], "cpu fp32")
        logits = []
        for row in rows:
            out, _ = model.forward(list(row), None, full_output=True)
            logits.append(out.float().reshape(len(row), -1).numpy())
        np.save(req["out"], np.stack(logits))
        reply = {"ok": True}
    except Exception:
        reply = {"ok": False, "error": traceback.format_exc()}
    replies.write(json.dumps(reply) + "\n")
    replies.flush()
"""


class OfficialWorker:
    """A subprocess (``sys.executable``) running the official package for many requests; its
    environment has ``RWKV_JIT_ON=0``, ``RWKV_CUDA_ON=0`` and, for ``v7``, ``RWKV_V7_ON=1``
    (the package reads these when it is imported). ``close()`` ends it."""

    def __init__(self, v7: bool):
        env = dict(os.environ, RWKV_JIT_ON="0", RWKV_CUDA_ON="0", RWKV_RESCALE_LAYER="0")
        for name in ("RWKV_V7_ON", "RWKV_DE_VERSION", "RWKV_DML_ON"):
            env.pop(name, None)
        if v7:
            env["RWKV_V7_ON"] = "1"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _OFFICIAL_WORKER], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def run(self, request: dict, timeout: float) -> None:
        """Send ``request``, wait up to ``timeout`` seconds for its reply. ``RuntimeError`` with
        the package's traceback and output if it failed; the worker is closed if it died or
        timed out."""
        box = []
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: the read below finds no reply
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            what = "timed out" if not box else f"exited ({self.proc.poll()})"
            self.close()
            raise RuntimeError(f"the official rwkv package {what}:\n{self.log_tail()}")
        reply = json.loads(box[0])
        if not reply["ok"]:
            raise RuntimeError(f"the official rwkv package failed:\n{reply['error']}\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()
        self.log.close()


_workers: dict[bool, OfficialWorker] = {}


def official_worker(v7: bool) -> OfficialWorker:
    """This process's running ``OfficialWorker`` for RWKV-7 (``v7``) or RWKV-4/5/6, started on
    first use and closed at exit."""
    w = _workers.get(v7)
    if w is None or not w.alive():
        if not _workers:
            atexit.register(close_official_workers)
        w = _workers[v7] = OfficialWorker(v7)
    return w


def close_official_workers() -> None:
    """End the workers ``official_worker`` started."""
    while _workers:
        _workers.popitem()[1].close()


def official_logits(model, ids, timeout: float = 600) -> np.ndarray:
    """Logits of the official ``rwkv`` package (``rwkv.model.RWKV``, strategy ``"cpu fp32"``, its
    pure-torch paths) on ``model``'s weights (``official_state_dict``), for ``ids`` (B, L) ints.
    Returns numpy float32 (B, L, vocab). Runs ``run_official`` (a subprocess; see there).

    Exact agreement with the reference (float32 rounding) needs the official constants: the
    output GroupNorm epsilon is ``64e-5`` in both versions, so RWKV-6 needs ``g_norm_eps=64e-5``
    and RWKV-7 ``head_dim * norm_eps == 64e-5`` (head 64, ``norm_eps=1e-5``); all LayerNorms use
    ``1e-5`` (``norm_eps``); ``hidden_act="sqrelu"``. Small known differences: RWKV-7 ``kk`` is
    normalised with ``F.normalize`` there (``fuse_norm=False`` here) and its decay constant is
    rounded to 0.606531. Raises ``ImportError`` if the package is not installed, ``RuntimeError``
    with the subprocess's output if it fails."""
    version = _version(model)
    check_ids(ids)
    return run_official(official_state_dict(model), ids, version, timeout=timeout)


def check_ids(ids) -> np.ndarray:
    """``ids`` as a ``(B, L)`` int array with ``L >= 1`` (``ValueError`` otherwise)."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids must be (B, L) with L >= 1, got shape {ids.shape}")
    return ids


def run_official(weights: dict, ids, version: int, rescale_layer: int = 0, timeout: float = 600) -> np.ndarray:
    """Logits of the official ``rwkv`` package (``rwkv.model.RWKV``, strategy ``"cpu fp32"``, its
    pure-torch paths) on the official-layout checkpoint ``weights`` (``name -> tensor``, RWKV-LM
    names), for ``ids`` (B, L) ints: numpy float32 (B, L, vocab).

    ``version``: 7 runs ``RWKV_x070`` (``RWKV_V7_ON=1``); any other value the RWKV-4/5/6 class,
    which detects the version from the weights' names and shapes. ``rescale_layer``: the
    package's ``RWKV_RESCALE_LAYER`` (``R > 0``: ``att.output`` / ``ffn.value`` weights of block
    ``i`` divided by ``2 ** (i // R)`` and the residual stream halved after every ``R``-th
    block; 0: none, the fp32 default). The package runs in a subprocess (``official_worker``:
    one per process for RWKV-7 and one for the others, kept for later calls) with
    ``RWKV_JIT_ON=0``, ``RWKV_CUDA_ON=0``: the package reads these at import time, and V7 mode
    switches it to TorchScript for the whole process, so nothing of it enters the calling
    process. ``timeout``: seconds to wait for the result. The weights go through a temporary
    ``.pth`` file (the package only loads from a path; its RWKV-7 loader appends ``.pth``
    itself). The package is unbatched: each row is one ``forward(row, None, full_output=True)``.
    Raises ``ImportError`` if the package is not installed, ``RuntimeError`` with the package's
    error and output if it fails or does not answer within ``timeout``."""
    if importlib.util.find_spec("rwkv") is None:
        raise ImportError(f"the official RWKV package is needed: pip install {OFFICIAL_PACKAGE} "
                          "(part of implicit-attn's test extra)")
    ids = check_ids(ids)
    if isinstance(rescale_layer, bool) or not isinstance(rescale_layer, int) or rescale_layer < 0:
        raise ValueError(f"rescale_layer must be a non-negative int, got {rescale_layer!r}")
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        torch.save(weights, d / "model.pth")
        (d / "tokens.json").write_text(json.dumps(ids.tolist()))
        # the RWKV-7 loader appends ".pth"; the RWKV-4..6 loader accepts the full name
        path = d / "model" if version == 7 else d / "model.pth"
        official_worker(version == 7).run({"weights": str(path), "tokens": str(d / "tokens.json"),
                                           "out": str(d / "logits.npy"), "rescale_layer": rescale_layer}, timeout)
        return np.load(d / "logits.npy").astype(np.float32)


__all__ = [
    "RWKV6Config", "RWKV6Attention", "RWKV6FeedForward", "RWKV6Block", "RWKV6Model", "RWKV6ForCausalLM",
    "RWKV7Config", "RWKV7Attention", "RWKV7FeedForward", "RWKV7Block", "RWKV7Model", "RWKV7ForCausalLM",
    "rwkv6_recurrence", "rwkv7_recurrence", "perturb_weights", "official_state_dict", "official_logits",
    "run_official", "check_ids", "OFFICIAL_PACKAGE", "OfficialWorker", "official_worker",
    "close_official_workers",
]
