"""RWKV-6 checkpoints in flash-linear-attention's Hugging Face layout: one shape table, HF tensors
<-> params, ``init_params`` drawn from the same table. RWKV-7 reuses the builder
(``rwkv_checkpoint``) with its own mixer and channel-mix tables.

Names read (``i`` the layer; ``C`` hidden, ``K``/``V`` key/value width, ``R`` the mix LoRA rank,
``G`` the decay LoRA rank, ``F`` the channel-mix width, ``H`` heads):
``model.embeddings.weight (vocab, C)``, ``model.norm.{weight,bias}``, ``lm_head.weight`` (absent
when tied); per layer ``model.layers.{i}.``: ``pre_norm.*`` (layer 0, when ``norm_first``),
``attn_norm.*``, ``ffn_norm.*`` (each ``weight (C,)`` and, with ``norm_bias``, ``bias (C,)``), and
the time mix under ``attn.``: ``x_proj.0.mu (C,)``, ``x_proj.0.linear.weight (5R, C)``,
``x_proj.2.weight (C, 5R)``, ``x_bias (5, C)`` (rows r, w, k, v, g), ``{r,k}_proj.linear.weight (K,
C)``, ``{v,g}_proj.linear.weight (V, C)``, ``w_proj.linear.lora.0.weight (G, C)``,
``w_proj.linear.lora.2.weight (K, G)``, ``w_proj.linear.lora.2.bias (K,)``, ``bonus (H, K/H)``,
``g_norm.{weight,bias} (V,)``, ``o_proj.weight (C, V)``; the channel mix under ``ffn.``:
``key.mu (C,)``, ``key.linear.weight (F, C)``, ``value.weight (C, F)``, ``receptance.mu (C,)``,
``receptance.linear.weight (C, C)``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, fan_in_normal, hf_from_params, init_from_table, params_from_hf
from .config import Config

PREFIX = "model.layers."


def norm_shapes(cfg, name: str) -> dict:
    D = cfg.hidden_size
    return {name + ".weight": (D,), **({name + ".bias": (D,)} if cfg.norm_bias else {})}


def attn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``attn.``) -> shapes of an RWKV-6 time mix."""
    D, K, V, H = cfg.hidden_size, cfg.key_dim, cfg.value_dim, cfg.num_heads
    R, G = cfg.proj_low_rank_dim, cfg.gate_low_rank_dim
    return {"x_proj.0.mu": (D,), "x_proj.0.linear.weight": (5 * R, D), "x_proj.2.weight": (D, 5 * R),
            "x_bias": (5, D), "r_proj.linear.weight": (K, D), "k_proj.linear.weight": (K, D),
            "v_proj.linear.weight": (V, D), "g_proj.linear.weight": (V, D), "w_proj.linear.lora.0.weight": (G, D),
            "w_proj.linear.lora.2.weight": (K, G), "w_proj.linear.lora.2.bias": (K,), "bonus": (H, K // H),
            "g_norm.weight": (V,), "g_norm.bias": (V,), "o_proj.weight": (D, V)}


def ffn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``ffn.``) -> shapes of an RWKV-6 channel mix."""
    D, F = cfg.hidden_size, cfg.ffn_size
    return {"key.mu": (D,), "key.linear.weight": (F, D), "value.weight": (D, F), "receptance.mu": (D,),
            "receptance.linear.weight": (D, D)}


@dataclasses.dataclass(frozen=True)
class RwkvCheckpoint:
    """The checkpoint functions of one RWKV-6/7 family (see ``rwkv_checkpoint``)."""

    expected_shapes: Callable
    params_from_tensors: Callable
    to_params: Callable
    from_params: Callable
    init_params: Callable


def rwkv_checkpoint(config_cls, attn_table: Callable, ffn_table: Callable, init_rule: Callable,
                    standard_form: Callable | None = None) -> RwkvCheckpoint:
    """The checkpoint functions of an fla RWKV layout whose layer ``i`` holds ``attn_table(cfg, i)``
    under ``attn.`` and ``ffn_table(cfg, i)`` under ``ffn.`` (params: ``{"embeddings", "layers":
    [{"pre_norm" (or None), "attn_norm", "ffn_norm", "attn", "ffn"}], "norm", "lm_head"}``).
    ``standard_form``: ``(Config, tensors) -> tensors`` turning older forms of the layout into the
    table's before the checks (None: none)."""
    label = config_cls.label

    def expected_shapes(cfg) -> tuple[dict, dict]:
        """``(required, optional)`` HF tensor names -> shapes for ``cfg``."""
        V, D = cfg.vocab_size, cfg.hidden_size
        req = {"model.embeddings.weight": (V, D), **norm_shapes(cfg, "model.norm")}
        opt = {}
        for i in range(cfg.num_hidden_layers):
            p = f"{PREFIX}{i}."
            if i == 0 and cfg.norm_first:
                req.update(norm_shapes(cfg, p + "pre_norm"))
            req.update(norm_shapes(cfg, p + "attn_norm"))
            req.update(norm_shapes(cfg, p + "ffn_norm"))
            req.update({p + "attn." + k: s for k, s in attn_table(cfg, i).items()})
            req.update({p + "ffn." + k: s for k, s in ffn_table(cfg, i).items()})
        if cfg.tie_word_embeddings:
            opt["lm_head.weight"] = (V, D)  # may be dropped when tied; ignored if present
        else:
            req["lm_head.weight"] = (V, D)
        return req, opt

    def params_from_tensors(cfg, tensors: dict) -> dict:
        """HF tensors (already checked) -> the ``LM`` parameter tree."""
        norm = lambda name: {k: tensors[f"{name}.{k}"] for k in ("weight", "bias") if f"{name}.{k}" in tensors}
        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"{PREFIX}{i}."
            layers.append({"pre_norm": norm(p + "pre_norm") if i == 0 and cfg.norm_first else None,
                           "attn_norm": norm(p + "attn_norm"), "ffn_norm": norm(p + "ffn_norm"),
                           "attn": {k: tensors[p + "attn." + k] for k in attn_table(cfg, i)},
                           "ffn": {k: tensors[p + "ffn." + k] for k in ffn_table(cfg, i)}})
        return {"embeddings": tensors["model.embeddings.weight"], "layers": layers, "norm": norm("model.norm"),
                "lm_head": None if cfg.tie_word_embeddings else tensors["lm_head.weight"]}

    def to_params(config: dict, tensors: dict):
        """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
        if standard_form is not None:
            try:
                cfg = config_cls.from_hf(config)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{label} config: {e}") from e
            tensors = standard_form(cfg, tensors)
        return params_from_hf(config_cls, expected_shapes, params_from_tensors, config, tensors, label)

    def from_params(cfg, params: dict) -> tuple[dict, dict]:
        """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
        t = {"model.embeddings.weight": params["embeddings"]}
        t.update({f"model.norm.{k}": v for k, v in params["norm"].items()})
        for i, layer in enumerate(params["layers"]):
            p = f"{PREFIX}{i}."
            for name in ("pre_norm", "attn_norm", "ffn_norm") if i == 0 and cfg.norm_first else ("attn_norm",
                                                                                                   "ffn_norm"):
                if layer.get(name) is None:
                    raise CheckpointError(f"{label} layer {i} has no {name}")
                t.update({f"{p}{name}.{k}": v for k, v in layer[name].items()})
            t.update({p + "attn." + k: v for k, v in layer["attn"].items()})
            t.update({p + "ffn." + k: v for k, v in layer["ffn"].items()})
        if not cfg.tie_word_embeddings:
            if params.get("lm_head") is None:
                raise CheckpointError(f"untied {label} model has no lm_head")
            t["lm_head.weight"] = params["lm_head"]
        return hf_from_params(cfg, t, expected_shapes, config_cls.model_type)

    def init_params(cfg, key, dtype=jnp.float32) -> dict:
        """Random parameters in the layout of ``LM``, drawn from the shape table. ``key``: int
        seed or JAX PRNG key."""
        return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)

    return RwkvCheckpoint(expected_shapes, params_from_tensors, to_params, from_params, init_params)


def norm_init(name: str, shape: tuple, g: np.random.Generator):
    """Layer and group norms near the identity, embeddings of unit scale (None for other names)."""
    if name.endswith("embeddings.weight"):
        return g.standard_normal(shape)
    if "norm." in name:
        return (1.0 + 0.1 * g.standard_normal(shape)) if name.endswith("weight") else 0.1 * g.standard_normal(shape)
    return None


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Initial value of tensor ``name``: interpolation weights in (0, 1), decays spread over fast
    and slow channels (raw ``-6 ... 1``: per-step decays ``e^-e^raw`` from ~1 down to ~0.07),
    small bonus, fan-in scaled matrices."""
    base = norm_init(name, shape, g)
    if base is not None:
        return base
    if name.endswith((".mu", "x_bias")):
        return g.uniform(size=shape)
    if name.endswith("w_proj.linear.lora.2.bias"):
        return np.linspace(-6.0, 1.0, shape[0]) + 0.1 * g.standard_normal(shape)
    if name.endswith("bonus"):
        return 0.5 * g.standard_normal(shape)
    return fan_in_normal(shape, g)


CHECKPOINT = rwkv_checkpoint(Config, attn_shapes, ffn_shapes, init_rule)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["PREFIX", "norm_shapes", "attn_shapes", "ffn_shapes", "RwkvCheckpoint", "rwkv_checkpoint", "norm_init",
           "init_rule", "CHECKPOINT", "expected_shapes", "params_from_tensors", "to_params", "from_params",
           "init_params"]
