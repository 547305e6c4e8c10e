"""RecurrentGemma checkpoints: the one shape table (HF names), HF tensors <-> params, and
``init_params`` drawn from the same table.

HF layout: ``model.embed_tokens.weight``, ``model.final_norm.weight`` and per layer
``model.layers.{i}.{temporal_pre_norm,channel_pre_norm}.weight``,
``...temporal_block.*`` (recurrent: ``linear_{x,y,out}``, ``conv_1d.weight (W, 1, K)``,
``rg_lru.*``; attention: ``{q,k,v,o}_proj``) and ``...mlp_block.{gate,up,down}_proj.*``.
``lm_head.weight`` only when embeddings are untied.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, fan_in_normal, hf_from_params, init_from_table, params_from_hf
from .config import Config


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes for ``cfg``."""
    D, C, V, K = cfg.hidden_size, cfg.lru_width, cfg.vocab_size, cfg.conv1d_width
    H, KV, d, I = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size // 2
    bw = C // H
    req = {"model.embed_tokens.weight": (V, D), "model.final_norm.weight": (D,)}
    opt = {}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        req.update({p + "temporal_pre_norm.weight": (D,), p + "channel_pre_norm.weight": (D,)})
        m = p + "mlp_block."
        req.update({m + "gate_proj.weight": (I, D), m + "gate_proj.bias": (I,), m + "up_proj.weight": (I, D),
                    m + "up_proj.bias": (I,), m + "down_proj.weight": (D, I), m + "down_proj.bias": (D,)})
        t = p + "temporal_block."
        if kind == "recurrent":
            req.update({t + "linear_y.weight": (C, D), t + "linear_y.bias": (C,),
                        t + "linear_x.weight": (C, D), t + "linear_x.bias": (C,),
                        t + "linear_out.weight": (D, C), t + "linear_out.bias": (D,),
                        t + "conv_1d.weight": (C, 1, K), t + "conv_1d.bias": (C,),
                        t + "rg_lru.recurrent_param": (C,),
                        t + "rg_lru.input_gate_weight": (H, bw, bw), t + "rg_lru.input_gate_bias": (H, bw),
                        t + "rg_lru.recurrent_gate_weight": (H, bw, bw),
                        t + "rg_lru.recurrent_gate_bias": (H, bw)})
        else:
            req.update({t + "q_proj.weight": (H * d, D), t + "k_proj.weight": (KV * d, D),
                        t + "v_proj.weight": (KV * d, D), t + "o_proj.weight": (D, H * d), t + "o_proj.bias": (D,)})
            if cfg.attention_bias:
                req.update({t + "q_proj.bias": (H * d,), t + "k_proj.bias": (KV * d,), t + "v_proj.bias": (KV * d,)})
    if cfg.tie_word_embeddings:
        opt["lm_head.weight"] = (V, D)  # HF drops it when tied; ignored if present
    else:
        req["lm_head.weight"] = (V, D)
    return req, opt


def _sub(tensors: dict, prefix: str) -> dict:
    """The tensors under ``prefix``, with it removed."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "recurrent_gemma")


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append({"temporal_pre_norm": tensors[p + "temporal_pre_norm.weight"],
                       "channel_pre_norm": tensors[p + "channel_pre_norm.weight"],
                       "temporal_block": _sub(tensors, p + "temporal_block."),
                       "mlp_block": _sub(tensors, p + "mlp_block.")})
    params = {"embed_tokens": tensors["model.embed_tokens.weight"], "layers": layers,
              "final_norm": tensors["model.final_norm.weight"],
              "lm_head": None if cfg.tie_word_embeddings else tensors["lm_head.weight"]}
    return params


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    t = {"model.embed_tokens.weight": params["embed_tokens"], "model.final_norm.weight": params["final_norm"]}
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        t[p + "temporal_pre_norm.weight"] = layer["temporal_pre_norm"]
        t[p + "channel_pre_norm.weight"] = layer["channel_pre_norm"]
        t.update({p + "temporal_block." + k: v for k, v in layer["temporal_block"].items()})
        t.update({p + "mlp_block." + k: v for k, v in layer["mlp_block"].items()})
    if not cfg.tie_word_embeddings:
        if params.get("lm_head") is None:
            raise CheckpointError("untied RecurrentGemma model has no lm_head")
        t["lm_head.weight"] = params["lm_head"]
    return hf_from_params(cfg, t, expected_shapes, "recurrent_gemma")


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Initial value of tensor ``name``: HF-like scales, plus non-zero biases and norm weights
    so that every term matters in tests."""
    if name.endswith("rg_lru.recurrent_param"):  # |a| in [0.9, 0.999] at r = 1
        rad = g.uniform(0.9 ** 2, 0.999 ** 2, shape)
        return np.log(np.exp(-0.5 * np.log(rad)) - 1.0)
    if name.endswith("rg_lru.input_gate_weight") or name.endswith("rg_lru.recurrent_gate_weight"):
        return fan_in_normal(shape, g)
    if name.endswith("conv_1d.bias"):
        return 0.3 * g.standard_normal(shape)
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return 0.1 * g.standard_normal(shape)
    return fan_in_normal(shape, g)  # embeddings: hidden_size ** -0.5 as well


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table. ``key``: int
    seed or JAX PRNG key."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["expected_shapes", "to_params", "from_params", "params_from_tensors", "init_rule", "init_params"]
