"""Griffin / RecurrentGemma (Hugging Face ``RecurrentGemmaForCausalLM``): block math as pure
functions, NNX modules on top, and the exact operator of every temporal block.

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

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..attention_operator import AttentionCore, AttentionOperator, attention_probs
from ..operator import ImplicitOperator, ScalarDecayCore, _dataclass_pytree
from ..ops import causal_conv, linear_scan
from .base import (SCAN_METHODS, Weights, check_block_input, check_input_ids, check_layers, check_tap,
                   check_taps, count_params, scan_method)

VARIANTS = ("full", "no_conv", "no_gate")
BLOCK_TYPES = ("recurrent", "attention")
f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of HF ``RecurrentGemmaConfig`` the forward pass needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0
    lru_width: int = 0
    attention_window_size: int = 2048
    conv1d_width: int = 4
    logits_soft_cap: float = 30.0
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    block_types: tuple = ("recurrent", "recurrent", "attention")
    attention_bias: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if not self.lru_width:
            object.__setattr__(self, "lru_width", self.hidden_size)
        if not self.num_key_value_heads:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        object.__setattr__(self, "block_types", tuple(self.block_types))
        bad = [b for b in self.block_types if b not in BLOCK_TYPES]
        if bad or not self.block_types:
            raise ValueError(f"block_types must be a non-empty list of {BLOCK_TYPES}, got {list(self.block_types)}")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"RecurrentGemma hidden_activation {self.hidden_activation!r} is not supported "
                             "(only 'gelu_pytorch_tanh')")
        H, KV = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % H or self.lru_width % H or H % KV:
            raise ValueError(f"hidden_size {self.hidden_size} and lru_width {self.lru_width} must be multiples "
                             f"of num_attention_heads {H}, itself a multiple of num_key_value_heads {KV}")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dimension head_dim * partial_rotary_factor = {self.rotary_dim} must be even")
        if self.attention_window_size < 1 or self.conv1d_width < 1:
            raise ValueError("attention_window_size and conv1d_width must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Temporal block type of each layer: ``block_types`` repeated (as HF does)."""
        n = self.num_hidden_layers
        return tuple((self.block_types * (n // len(self.block_types) + 1))[:n])

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in names if k in d and d[k] is not None}
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"RecurrentGemma rope_type {rope['rope_type']!r} is not supported (only 'default')")
        for k in ("rope_theta", "partial_rotary_factor"):
            if rope.get(k) is not None:
                kw[k] = rope[k]
        for req in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if req not in kw:
                raise ValueError(f"config.json is missing {req!r}")
        return cls(**kw)

    def to_hf(self) -> dict:
        d = dataclasses.asdict(self)
        d["block_types"] = list(self.block_types)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                                "partial_rotary_factor": d.pop("partial_rotary_factor")}
        d.update(model_type="recurrent_gemma", architectures=["RecurrentGemmaForCausalLM"],
                 head_dim=self.head_dim)
        return d


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


def segment_ids(pos):
    """``(B, L)`` document index of every token (0, 1, ...) from positions ``(B, L)``."""
    return jnp.cumsum(pos == 0, axis=-1) - 1


# ----------------------------------------------------------------------------- math

def rms_norm(x, w, eps: float):
    """HF ``RecurrentGemmaRMSNorm``: float32 ``x / rms(x) * (1 + w)``, cast back. ``(..., D)``."""
    xf = x.astype(f32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(f32))).astype(x.dtype)


def _linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


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
    y = gelu_tanh(_linear(h, p["linear_y.weight"], p["linear_y.bias"]))
    x = _linear(h, p["linear_x.weight"], p["linear_x.bias"])
    xc = document_conv(x, p["conv_1d.weight"][:, 0, :], p["conv_1d.bias"], seg)
    return dict(y=y, x=x, xc=xc, seg=seg, **rglru_gates(p, xc, pos, cfg.num_attention_heads))


def rglru_scan(a, u, method: str = "auto"):
    """``h_t = a_t h_{t-1} + u_t`` (``h_{-1} = 0``) over axis 1 in float32. ``(B, L, C) -> (B, L, C)``.

    ``method="sequential"``: one ``lax.scan``, the same accumulation order as the reference
    loop; on CPU it is the faster choice and compiles in a fraction of the time of an
    associative scan (3x at L = 1024, 13x at 8192). ``"parallel"``: ``ops.linear_scan``
    (``jax.lax.associative_scan``, O(log L) depth; for GPU/TPU). ``"auto"`` picks by backend
    (``base.scan_method``, as Mamba's ``selective_scan``). Document resets (``a_t = 0``) cut
    the state exactly with either method.
    """
    a, u = a.astype(f32), u.astype(f32)
    if scan_method(method) == "parallel":
        return linear_scan(a, u, axis=1)

    def step(h, au):
        h = au[0] * h + au[1]
        return h, h

    a, u = (jnp.swapaxes(t, 0, 1) for t in (a, u))
    _, hs = jax.lax.scan(step, jnp.zeros_like(u[0]), (a, u))
    return jnp.swapaxes(hs, 0, 1)


def recurrent_inner(p: dict, h, pos, cfg: Config):
    """The recurrent block's token-mixing output ``h_lru * y`` before ``linear_out``: ``(B, L, C)``."""
    q = recurrent_parts(p, h, pos, cfg)
    u = q["xc"] * (q["gate_i"] * q["mult"]).astype(q["xc"].dtype)
    hs = rglru_scan(q["a"], u).astype(q["xc"].dtype)
    return hs * q["y"]


def recurrent_forward(p: dict, h, pos, cfg: Config, tap=None):
    """HF ``RecurrentGemmaRecurrentBlock.forward``: ``(B, L, d_model) -> (B, L, d_model)``.

    ``tap``: optional ``(B, C, L)`` added to the inner output (the operator's ``output``).
    """
    y = recurrent_inner(p, h, pos, cfg)
    if tap is not None:
        y = y + jnp.swapaxes(tap, 1, 2).astype(y.dtype)
    return _linear(y, p["linear_out.weight"], p["linear_out.bias"])


@_dataclass_pytree
class DocumentMaskedCore:
    """``H = inner.dense(idx)`` with entries between different documents set to 0.

    The conv is the only part of the recurrent operator that could reach across a
    document start (the decay is exactly 0 there already). Shapes: ``seg (B, L)``.
    """

    inner: Any
    seg: Any

    @property
    def num_channels(self) -> int:
        return self.inner.num_channels

    def dense(self, idx):
        H = self.inner.dense(idx)
        same = self.seg[:, None, :, None] == self.seg[:, None, None, :]
        return jnp.where(same, H, 0.0)


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


def rotary(x, pos, cfg: Config):
    """HF partial rotary embedding on the first ``rotary_dim`` features of ``x (B, h, L, d)``
    at positions ``pos (B, L)`` (rotate-half convention)."""
    R = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, R, 2, dtype=f32) / R))
    fr = pos.astype(f32)[..., None] * inv  # (B, L, R/2)
    emb = jnp.concatenate([fr, fr], axis=-1)[:, None]  # (B, 1, L, R)
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    xr, xp = x[..., :R], x[..., R:]
    rot = jnp.concatenate([-xr[..., R // 2:], xr[..., :R // 2]], axis=-1)
    return jnp.concatenate([xr * cos + rot * sin, xp], axis=-1)


def attention_parts(p: dict, h, pos, cfg: Config) -> dict:
    """Queries (scaled, rotated) ``(B, H, L, d)``, keys ``(B, KV, L, d)``, values
    ``(B, KV, L, d)`` and document ids ``seg (B, L)`` of the attention block."""
    B, L, _ = h.shape
    d = cfg.head_dim
    heads = lambda t, n: jnp.swapaxes(t.reshape(B, L, n, d), 1, 2)
    q = heads(_linear(h, p["q_proj.weight"], p.get("q_proj.bias")), cfg.num_attention_heads)
    k = heads(_linear(h, p["k_proj.weight"], p.get("k_proj.bias")), cfg.num_key_value_heads)
    v = heads(_linear(h, p["v_proj.weight"], p.get("v_proj.bias")), cfg.num_key_value_heads)
    q, k = rotary(q, pos, cfg), rotary(k, pos, cfg)
    return dict(q=q * jnp.asarray(d ** -0.5, q.dtype), k=k, v=v, seg=segment_ids(pos))


def _repeat_kv(t, cfg: Config):
    return jnp.repeat(t, cfg.num_attention_heads // cfg.num_key_value_heads, axis=1)


def attention_inner(p: dict, h, pos, cfg: Config):
    """Per-head attention output before ``o_proj``: ``(B, H, L, d)`` in the parameter dtype."""
    a = attention_parts(p, h, pos, cfg)
    probs = attention_probs(a["q"], _repeat_kv(a["k"], cfg), a["seg"], cfg.attention_window_size)
    return jnp.einsum("bhij,bhjd->bhid", probs.astype(a["v"].dtype), _repeat_kv(a["v"], cfg))


def attention_forward(p: dict, h, pos, cfg: Config, tap=None):
    """HF ``RecurrentGemmaAttention.forward`` (local, multi-query, partial rotary):
    ``(B, L, d_model) -> (B, L, d_model)``. ``tap``: optional ``(B, H, L, d)`` added to
    the per-head output (the operator's ``output``)."""
    o = attention_inner(p, h, pos, cfg)
    if tap is not None:
        o = o + tap.astype(o.dtype)
    B, H, L, d = o.shape
    return _linear(jnp.swapaxes(o, 1, 2).reshape(B, L, H * d), p["o_proj.weight"], p.get("o_proj.bias"))


def attention_operator(p: dict, h, pos, cfg: Config) -> AttentionOperator:
    """The attention block's explicit operator: per-head softmax probabilities acting on
    the value vectors (channels = heads)."""
    a = attention_parts(p, h, pos, cfg)
    values = _repeat_kv(a["v"], cfg).astype(f32)
    core = AttentionCore(q=a["q"].astype(f32), k=a["k"].astype(f32), seg=a["seg"],
                         window=cfg.attention_window_size)
    out = attention_inner(p, h, pos, cfg).astype(f32)
    return AttentionOperator(values=values, offset=jnp.zeros_like(values), output=out, core=core)


def mlp_forward(p: dict, h):
    """HF ``RecurrentGemmaMlp``: ``down(gelu_tanh(gate(h)) * up(h))``. ``(B, L, D)``."""
    g = gelu_tanh(_linear(h, p["gate_proj.weight"], p["gate_proj.bias"]))
    return _linear(g * _linear(h, p["up_proj.weight"], p["up_proj.bias"]), p["down_proj.weight"],
                   p["down_proj.bias"])


def embed_scale(cfg: Config, dtype):
    """HF multiplies embeddings by ``sqrt(hidden_size)`` stored as a bfloat16 buffer."""
    return jnp.asarray(math.sqrt(cfg.hidden_size), jnp.bfloat16).astype(dtype)


def layer_forward(layer: dict, h, pos, cfg: Config, kind: str, tap=None):
    """HF ``RecurrentGemmaDecoderLayer``: ``h + temporal(norm(h))``, then ``+ mlp(norm(.))``.

    Args:
      layer: ``{"temporal_pre_norm", "channel_pre_norm", "temporal_block", "mlp_block"}``;
      h: ``(B, L, d_model)`` residual stream; pos: ``(B, L)`` positions;
      kind: ``"recurrent"`` or ``"attention"``; tap: optional array added to the temporal
        block's operator output (``(B, C, L)`` recurrent, ``(B, H, L, d)`` attention).
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the layer output and the temporal
      block's input.
    """
    hn = rms_norm(h, layer["temporal_pre_norm"], cfg.rms_norm_eps)
    fwd = recurrent_forward if kind == "recurrent" else attention_forward
    h = fwd(layer["temporal_block"], hn, pos, cfg, tap) + h
    h = mlp_forward(layer["mlp_block"], rms_norm(h, layer["channel_pre_norm"], cfg.rms_norm_eps)) + h
    return h, hn


def lm_forward(params: dict, ids, pos, cfg: Config, capture: tuple[int, ...] = (), taps=None):
    """Full LM: ``ids (B, L)``, positions ``pos (B, L)`` -> ``logits (B, L, vocab)`` float32
    (soft-capped), and the temporal-block inputs of the layers in ``capture`` (list of
    ``(B, L, d_model)``). ``taps``: ``{layer: array}`` added to those layers' operator outputs
    (``(B, C, L)`` recurrent, ``(B, H, L, d)`` attention)."""
    taps = taps or {}
    emb = params["embed_tokens"]
    h = emb[ids] * embed_scale(cfg, emb.dtype)
    captured = []
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
        h, hn = layer_forward(layer, h, pos, cfg, kind, taps.get(i))
        if i in capture:
            captured.append(hn)
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    head = emb if params.get("lm_head") is None else params["lm_head"]
    logits = h.astype(head.dtype) @ head.T
    cap = cfg.logits_soft_cap
    logits = jnp.tanh(logits / cap) * cap
    return logits.astype(f32), captured


_lm_forward = jax.jit(lm_forward, static_argnames=("cfg", "capture"))
_recurrent_forward = jax.jit(recurrent_forward, static_argnames=("cfg",))
_attention_forward = jax.jit(attention_forward, static_argnames=("cfg",))
_recurrent_operator = jax.jit(recurrent_operator, static_argnames=("cfg", "variant", "documents"))
_attention_operator = jax.jit(attention_operator, static_argnames=("cfg",))
_layer_forward = jax.jit(layer_forward, static_argnames=("cfg", "kind"))


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM`` (scales like HF's init, plus non-zero
    biases and norm weights so that every term matters). For tests and benchmarks."""
    D, C, I, V, K = cfg.hidden_size, cfg.lru_width, cfg.intermediate_size // 2, cfg.vocab_size, cfg.conv1d_width
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    bw = C // H
    keys = iter(jax.random.split(key, 24 * cfg.num_hidden_layers + 4))
    nrm = lambda shape, s: (s * jax.random.normal(next(keys), shape)).astype(dtype)
    layers = []
    for kind in cfg.layer_types:
        if kind == "recurrent":
            rad = jax.random.uniform(next(keys), (C,), minval=0.9 ** 2, maxval=0.999 ** 2)
            t = {"linear_y.weight": nrm((C, D), D ** -0.5), "linear_y.bias": nrm((C,), 0.1),
                 "linear_x.weight": nrm((C, D), D ** -0.5), "linear_x.bias": nrm((C,), 0.1),
                 "linear_out.weight": nrm((D, C), C ** -0.5), "linear_out.bias": nrm((D,), 0.1),
                 "conv_1d.weight": nrm((C, 1, K), K ** -0.5), "conv_1d.bias": nrm((C,), 0.3),
                 "rg_lru.input_gate_weight": nrm((H, bw, bw), bw ** -0.5),
                 "rg_lru.input_gate_bias": nrm((H, bw), 0.1),
                 "rg_lru.recurrent_gate_weight": nrm((H, bw, bw), bw ** -0.5),
                 "rg_lru.recurrent_gate_bias": nrm((H, bw), 0.1),
                 "rg_lru.recurrent_param": jnp.log(jnp.exp(-0.5 * jnp.log(rad)) - 1.0).astype(dtype)}
        else:
            t = {"q_proj.weight": nrm((H * d, D), D ** -0.5), "k_proj.weight": nrm((KV * d, D), D ** -0.5),
                 "v_proj.weight": nrm((KV * d, D), D ** -0.5), "o_proj.weight": nrm((D, H * d), (H * d) ** -0.5),
                 "o_proj.bias": nrm((D,), 0.1)}
            if cfg.attention_bias:
                t.update({"q_proj.bias": nrm((H * d,), 0.1), "k_proj.bias": nrm((KV * d,), 0.1),
                          "v_proj.bias": nrm((KV * d,), 0.1)})
        mlp = {"gate_proj.weight": nrm((I, D), D ** -0.5), "gate_proj.bias": nrm((I,), 0.1),
               "up_proj.weight": nrm((I, D), D ** -0.5), "up_proj.bias": nrm((I,), 0.1),
               "down_proj.weight": nrm((D, I), I ** -0.5), "down_proj.bias": nrm((D,), 0.1)}
        layers.append({"temporal_pre_norm": nrm((D,), 0.1), "channel_pre_norm": nrm((D,), 0.1),
                       "temporal_block": t, "mlp_block": mlp})
    params = {"embed_tokens": nrm((V, D), D ** -0.5), "layers": layers, "final_norm": nrm((D,), 0.1),
              "lm_head": None}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = nrm((V, D), D ** -0.5)
    return params


# ----------------------------------------------------------------------------- modules

def _check_block_input(x, cfg: Config, name: str = "temporal block input"):
    return check_block_input(x, cfg.hidden_size, name)


def _tap_shape(cfg: Config, kind: str, B: int, L: int) -> tuple[tuple, str]:
    """Shape of a ``kind`` block's operator output, and its axes for messages."""
    if kind == "recurrent":
        return (B, cfg.lru_width, L), "(batch, lru_width, length)"
    return (B, cfg.num_attention_heads, L, cfg.head_dim), "(batch, heads, length, head_dim)"


class RecurrentBlock(Weights):
    """NNX recurrent block: ``__call__(h, segment_pos)`` is HF ``RecurrentGemmaRecurrentBlock``;
    ``as_operator(x, variant, segment_pos)`` its operator (channels = lru_width)."""

    kind = "recurrent"

    def __init__(self, cfg: Config, tensors: dict):
        super().__init__(tensors)
        self.cfg = cfg

    def __call__(self, h, segment_pos=None):
        """``(B, L, d_model) -> (B, L, d_model)``."""
        h = _check_block_input(h, self.cfg)
        pos = check_segment_pos(segment_pos, h.shape[:2])
        return _recurrent_forward(self.arrays(), h, pos, cfg=self.cfg)

    def as_operator(self, x, variant: str = "full", segment_pos=None) -> ImplicitOperator:
        """Implicit operator for block input ``x (B, L, d_model)``."""
        x = _check_block_input(x, self.cfg)
        if variant not in VARIANTS:
            raise ValueError(f"Griffin variant must be one of {VARIANTS}, got {variant!r}")
        pos = check_segment_pos(segment_pos, x.shape[:2])
        return _recurrent_operator(self.arrays(), x, pos, cfg=self.cfg, variant=variant,
                                   documents=segment_pos is not None)


class AttentionBlock(Weights):
    """NNX local attention block: ``__call__(h, segment_pos)`` is HF ``RecurrentGemmaAttention``;
    ``as_operator(x, variant, segment_pos)`` the explicit attention operator (channels = heads;
    the variant is accepted for a uniform interface and ignored: attention has no ablations)."""

    kind = "attention"

    def __init__(self, cfg: Config, tensors: dict):
        super().__init__(tensors)
        self.cfg = cfg

    def __call__(self, h, segment_pos=None):
        """``(B, L, d_model) -> (B, L, d_model)``."""
        h = _check_block_input(h, self.cfg)
        pos = check_segment_pos(segment_pos, h.shape[:2])
        return _attention_forward(self.arrays(), h, pos, cfg=self.cfg)

    def as_operator(self, x, variant: str = "full", segment_pos=None) -> AttentionOperator:
        """Attention operator for block input ``x (B, L, d_model)``."""
        x = _check_block_input(x, self.cfg)
        if variant not in VARIANTS:
            raise ValueError(f"Griffin variant must be one of {VARIANTS}, got {variant!r}")
        pos = check_segment_pos(segment_pos, x.shape[:2])
        return _attention_operator(self.arrays(), x, pos, cfg=self.cfg)


class GriffinLayer(nnx.Module):
    """Residual layer: ``temporal_pre_norm``, ``temporal_block``, ``channel_pre_norm``, ``mlp_block``."""

    def __init__(self, cfg: Config, kind: str, layer: dict):
        self.cfg = cfg
        self.kind = kind
        self.temporal_pre_norm = nnx.Param(jnp.asarray(layer["temporal_pre_norm"]))
        self.channel_pre_norm = nnx.Param(jnp.asarray(layer["channel_pre_norm"]))
        block = RecurrentBlock if kind == "recurrent" else AttentionBlock
        self.temporal_block = block(cfg, layer["temporal_block"])
        self.mlp_block = Weights(layer["mlp_block"])

    def params(self) -> dict:
        return {"temporal_pre_norm": self.temporal_pre_norm[...], "channel_pre_norm": self.channel_pre_norm[...],
                "temporal_block": self.temporal_block.arrays(), "mlp_block": self.mlp_block.arrays()}

    def __call__(self, h, segment_pos=None, tap=None):
        """One residual layer, as in ``lm_forward`` (the same pure ``layer_forward``).

        Args:
          h: ``(B, L, d_model)`` floating residual stream entering the layer.
          segment_pos: None or ``(B, L)`` document positions (see ``check_segment_pos``).
          tap: optional array added to the temporal block's operator output:
            ``(B, lru_width, L)`` (recurrent) or ``(B, heads, L, head_dim)`` (attention).
        Returns:
          ``(B, L, d_model)`` residual stream leaving the layer.
        """
        h = _check_block_input(h, self.cfg, "layer input")
        B, L, _ = h.shape
        pos = check_segment_pos(segment_pos, (B, L))
        if tap is not None:
            shape, what = _tap_shape(self.cfg, self.kind, B, L)
            tap = check_tap(tap, shape, what)
        return _layer_forward(self.params(), h, pos, cfg=self.cfg, kind=self.kind, tap=tap)[0]


class LM(nnx.Module):
    """``RecurrentGemmaForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``weights_convert.griffin.to_params`` or ``init_params``."""

    family = "recurrent_gemma"
    mixer_name = "temporal_block"

    def __init__(self, cfg: Config, params: dict):
        if len(params["layers"]) != cfg.num_hidden_layers:
            raise ValueError(f"params have {len(params['layers'])} layers, config says {cfg.num_hidden_layers}")
        self.config = cfg
        self.embed_tokens = nnx.Param(jnp.asarray(params["embed_tokens"]))
        self.layers = nnx.List([GriffinLayer(cfg, k, l) for k, l in zip(cfg.layer_types, params["layers"])])
        self.final_norm = nnx.Param(jnp.asarray(params["final_norm"]))
        head = params.get("lm_head")
        self.lm_head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        """The parameter tree the pure functions take."""
        return {"embed_tokens": self.embed_tokens[...], "layers": [l.params() for l in self.layers],
                "final_norm": self.final_norm[...],
                "lm_head": None if self.lm_head is None else self.lm_head[...]}

    @property
    def num_params(self) -> int:
        return count_params(self.params())

    def _inputs(self, input_ids, segment_pos):
        ids = check_input_ids(input_ids, self.config.vocab_size)
        return ids, check_segment_pos(segment_pos, ids.shape)

    def __call__(self, input_ids, segment_pos=None):
        """``(B, L)`` int token ids (and optional ``(B, L)`` document positions) ->
        ``(B, L, vocab)`` float32 soft-capped logits."""
        ids, pos = self._inputs(input_ids, segment_pos)
        return _lm_forward(self.params(), ids, pos, cfg=self.config)[0]

    def tapped_logits(self, input_ids, taps: dict, segment_pos=None):
        """Logits with ``taps = {layer: array}`` added to those layers' operator outputs
        (``(B, C, L)`` recurrent, ``(B, H, L, d)`` attention); differentiable in ``taps``.
        Each tap must have exactly its layer's operator-output shape (ValueError otherwise)."""
        ids, pos = self._inputs(input_ids, segment_pos)
        B, L = ids.shape
        kinds = self.config.layer_types
        taps = check_taps(taps, lambda i: _tap_shape(self.config, kinds[i], B, L)[0], len(self.layers),
                          lambda i: _tap_shape(self.config, kinds[i], B, L)[1])
        return _lm_forward(self.params(), ids, pos, cfg=self.config, taps=taps)[0]

    def mixer_inputs(self, input_ids, layers=None, segment_pos=None) -> dict[int, jax.Array]:
        """``{layer: (B, L, d_model)}`` inputs of the selected layers' temporal blocks."""
        ids, pos = self._inputs(input_ids, segment_pos)
        sel = sorted(set(check_layers(layers, len(self.layers))))
        _, cap = _lm_forward(self.params(), ids, pos, cfg=self.config, capture=tuple(sel))
        return dict(zip(sel, cap))

    def operators(self, input_ids, layers=None, variant: str = "full", segment_pos=None) -> list:
        """One operator per selected layer (all by default), in the order asked:
        ``ImplicitOperator`` for recurrent layers, ``AttentionOperator`` for attention layers
        (which ignore ``variant``)."""
        if variant not in VARIANTS:
            raise ValueError(f"Griffin variant must be one of {VARIANTS}, got {variant!r}")
        sel = check_layers(layers, len(self.layers))
        xs = self.mixer_inputs(input_ids, sel, segment_pos)
        return [self.layers[i].temporal_block.as_operator(xs[i], variant, segment_pos) for i in sel]

    def info(self) -> dict:
        c = self.config
        return {"family": self.family, "layers": c.num_hidden_layers, "layer_types": list(c.layer_types),
                "d_model": c.hidden_size, "lru_width": c.lru_width, "heads": c.num_attention_heads,
                "kv_heads": c.num_key_value_heads, "attention_window": c.attention_window_size,
                "conv_width": c.conv1d_width, "vocab_size": c.vocab_size, "parameters": self.num_params,
                "dtype": str(self.embed_tokens[...].dtype)}


__all__ = ["Config", "LM", "RecurrentBlock", "AttentionBlock", "GriffinLayer", "DocumentMaskedCore",
           "VARIANTS", "check_segment_pos", "segment_ids", "document_conv", "rglru_gates", "rglru_scan",
           "recurrent_parts", "recurrent_inner", "recurrent_forward", "recurrent_operator", "rotary",
           "attention_parts", "attention_inner", "attention_forward", "attention_operator", "mlp_forward",
           "rms_norm", "embed_scale", "init_params", "lm_forward", "layer_forward", "SCAN_METHODS"]
