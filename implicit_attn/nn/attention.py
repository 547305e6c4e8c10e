"""Softmax attention layers of the hybrid families (RecurrentGemma's local attention,
the full causal attention of Bamba and its relatives): GQA, partial rotate-half RoPE,
document masks, and the explicit attention operator (channels = heads).

The functions take a config with ``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``rotary_dim`` (0: no RoPE), ``rope_theta``, ``attention_scale`` and ``attention_window_size``
(keys at distance ``>= window`` are masked; ``FULL_WINDOW`` for full causal attention).
A projection may carry a low-rank adapter (Zamba2): ``{q,k,v}_proj.lora_a (r, d_in)`` and
``lora_b (d_out, r)`` next to its weight add ``lora_b @ lora_a @ x`` to it (``projection``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels import cpu as cpu_kernels
from ..operator import AttentionCore, AttentionOperator
from ..ops import attention_output, from_first, linear, mark_nan, zero_nan

f32 = jnp.float32
FULL_WINDOW = 2 ** 31 - 1  # no key is ever this far back: full causal attention


class AttentionFields:
    """Mixin of an ``HFConfig`` with ``hidden_size``, ``num_attention_heads``,
    ``num_key_value_heads`` and ``partial_rotary_factor`` fields: the derived sizes the
    functions below read, and their checks."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def attention_input_size(self) -> int:
        """Width of the attention layers' input (``hidden_size``; Zamba2's is twice that)."""
        return self.hidden_size

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary_note(self) -> str:
        """What sets ``rotary_dim`` besides ``head_dim``, for messages."""
        return f" * partial_rotary_factor {self.partial_rotary_factor}"

    @property
    def attention_scale(self) -> float:
        """The factor of the query-key logits (``head_dim ** -0.5``; Granite sets its own)."""
        return self.head_dim ** -0.5

    def check_attention_fields(self):
        """``ValueError`` naming the fields unless the heads divide the width (where
        ``head_dim`` is derived from it, not a config field), the key/value heads divide
        the heads and the rotary dimension is even."""
        derived = ""
        if "head_dim" in {f.name for f in dataclasses.fields(self)}:
            self.check_ints("head_dim")
        else:
            self.check_multiple("hidden_size", "num_attention_heads")
            derived = f" = hidden_size {self.hidden_size} / num_attention_heads {self.num_attention_heads}"
        self.check_multiple("num_attention_heads", "num_key_value_heads")
        if self.rotary_dim % 2:
            raise ValueError(f"the rotary dimension ({self.rotary_dim}, from head_dim {self.head_dim}{derived}"
                             f"{self.rotary_note}) must be even")


class NoPositionFields(AttentionFields):
    """``AttentionFields`` of full causal attention without positional encoding (Jamba's
    and Nemotron-H's attention layers)."""

    @property
    def rotary_dim(self) -> int:
        return 0

    @property
    def rotary_note(self) -> str:
        return ""

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW


def segment_ids(pos):
    """``(B, L)`` document index of every token (0, 1, ...) from positions ``(B, L)``."""
    return jnp.cumsum(pos == 0, axis=-1) - 1


def rope(x, pos, inv):
    """Rotate-half rotary embedding of the first ``2 * len(inv)`` features of ``x (B, h, L, d)``
    at positions ``pos (B, L)`` with angular frequencies ``inv (R/2,)`` float32 (a zero
    frequency leaves its feature pair as it is); the other features pass unchanged."""
    R = 2 * inv.shape[0]
    if R == 0:
        return x
    fr = pos.astype(f32)[..., None] * inv  # (B, L, R/2)
    emb = jnp.concatenate([fr, fr], axis=-1)[:, None]  # (B, 1, L, R)
    cos, sin = cpu_kernels.computed_once(jnp.stack([jnp.cos(emb), jnp.sin(emb)]).astype(x.dtype))
    xr, xp = x[..., :R], x[..., R:]
    rot = jnp.concatenate([-xr[..., R // 2:], xr[..., :R // 2]], axis=-1)
    return jnp.concatenate([xr * cos + rot * sin, xp], axis=-1)


def rope_frequencies(theta: float, R: int, count: int | None = None) -> np.ndarray:
    """HF's default RoPE frequencies ``theta ** (-2i / R)`` for ``i < count`` (default ``R/2``),
    computed in float32 as HF does: ``(count,)`` float32 numpy (a constant of the config)."""
    count = R // 2 if count is None else count
    return (1.0 / np.float32(theta) ** (np.arange(0, 2 * count, 2, dtype=np.float32) / R)).astype(np.float32)


def rotary(x, pos, cfg):
    """HF partial rotary embedding on the first ``rotary_dim`` features of ``x (B, h, L, d)``
    at positions ``pos (B, L)`` (rotate-half convention; none where ``rotary_dim`` is 0)."""
    if cfg.rotary_dim == 0:
        return x
    return rope(x, pos, jnp.asarray(rope_frequencies(cfg.rope_theta, cfg.rotary_dim)))


def projection(p: dict, x, name: str):
    """``linear`` of ``x (..., d_in)`` by ``p[name + ".weight"] (d_out, d_in)`` (and its bias if
    any), plus the low-rank adapter ``p[name + ".lora_b"] @ p[name + ".lora_a"] @ x`` where
    ``p`` has one (HF computes the two products separately and adds them, as here)."""
    y = linear(x, p[name + ".weight"], p.get(name + ".bias"))
    a = p.get(name + ".lora_a")
    if a is not None:
        y = y + linear(linear(x, a), p[name + ".lora_b"])
    return y


def attention_parts(p: dict, h, pos, cfg) -> dict:
    """Queries (scaled, rotated) ``(B, H, L, d)``, keys ``(B, KV, L, d)``, values
    ``(B, KV, L, d)`` and document ids ``seg (B, L)`` of the attention block."""
    B, L, _ = h.shape
    d = cfg.head_dim
    heads = lambda t, n: jnp.swapaxes(t.reshape(B, L, n, d), 1, 2)
    q = heads(projection(p, h, "q_proj"), cfg.num_attention_heads)
    k = heads(projection(p, h, "k_proj"), cfg.num_key_value_heads)
    v = heads(projection(p, h, "v_proj"), cfg.num_key_value_heads)
    q, k = rotary(q, pos, cfg), rotary(k, pos, cfg)
    return dict(q=q * jnp.asarray(cfg.attention_scale, q.dtype), k=k, v=v, seg=segment_ids(pos))


def repeat_kv(t, cfg):
    """Repeat the shared key/value heads ``(B, KV, L, d)`` for every query head: ``(B, H, L, d)``."""
    return jnp.repeat(t, cfg.num_attention_heads // cfg.num_key_value_heads, axis=1)


def attend(a: dict, cfg):
    """Per-head attention output ``(B, H, L, d)`` of the parts ``a`` (``attention_parts``' keys:
    ``q`` scaled and rotated, ``k``, ``v``, ``seg``), in the values' dtype."""
    k, v = a["k"], a["v"]
    # NaN stays causal (ops.nan): a NaN key or value reaches every later row, a NaN query its own.
    bad = repeat_kv(from_first(jnp.isnan(k).any(-1) | jnp.isnan(v).any(-1), axis=2), cfg) | jnp.isnan(a["q"]).any(-1)
    o = attention_values(zero_nan(a["q"]), zero_nan(k), zero_nan(v), a["seg"], cfg.attention_window_size)
    return mark_nan(o, bad[..., None])


def attention_values(q, k, v, seg, window: int):
    """``ops.attention_output`` (same arguments and result), on CPU by the fused kernel
    (``kernels.cpu.attention_forward``) for float32 inputs where ``kernels.cpu.attention_pays_off``;
    derivatives through ``ops.attention_output`` either way."""
    if all(t.dtype == f32 for t in (q, k, v)) and cpu_kernels.attention_pays_off(q, v):
        return jax.lax.platform_dependent(q, k, v, seg, cpu=lambda *t: cpu_kernels.attention_forward(*t, window),
                                          default=lambda *t: attention_output(*t, window))
    return attention_output(q, k, v, seg, window)


def attention_inner(p: dict, h, pos, cfg):
    """Per-head attention output before ``o_proj``: ``(B, H, L, d)`` in the parameter dtype."""
    return attend(attention_parts(p, h, pos, cfg), cfg)


def attention_forward(p: dict, h, pos, cfg, hook=None):
    """HF softmax attention (``RecurrentGemmaAttention``, ``BambaAttention``, ...; GQA, partial RoPE):
    ``(B, L, d_model) -> (B, L, d_model)``. ``hook``: optional ``(B, H, L, d) -> (B, H, L, d)``
    applied to the per-head output (the operator's ``output``; ``mixer.hook_out``)."""
    o = attention_inner(p, h, pos, cfg)
    if hook is not None:
        o = hook(o)
    B, H, L, d = o.shape
    return linear(jnp.swapaxes(o, 1, 2).reshape(B, L, H * d), p["o_proj.weight"], p.get("o_proj.bias"))


def attention_operator(p: dict, h, pos, cfg) -> AttentionOperator:
    """The attention block's explicit operator: per-head softmax probabilities acting on
    the value vectors (channels = heads)."""
    return operator_of_parts(attention_parts(p, h, pos, cfg), cfg)


def operator_of_parts(a: dict, cfg) -> AttentionOperator:
    """The explicit attention operator of the parts ``a`` (``attention_parts``' keys): the
    softmax probabilities on the value vectors, output ``attend(a)``."""
    values = repeat_kv(a["v"], cfg).astype(f32)
    core = AttentionCore(q=a["q"].astype(f32), k=a["k"].astype(f32), seg=a["seg"],
                         window=cfg.attention_window_size)
    return AttentionOperator(values=values, offset=jnp.zeros_like(values), output=attend(a, cfg).astype(f32),
                             core=core)


__all__ = ["FULL_WINDOW", "AttentionFields", "attention_values", "NoPositionFields", "segment_ids", "rope", "rope_frequencies", "rotary",
           "projection", "attention_parts", "repeat_kv", "attend", "attention_inner", "attention_forward", "attention_operator", "operator_of_parts"]
