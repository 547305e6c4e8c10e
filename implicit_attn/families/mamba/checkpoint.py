"""Mamba checkpoints: the one shape table (HF names), HF tensors <-> params, and
``init_params`` drawn from the same table.

HF layout: ``backbone.embeddings.weight``, ``backbone.norm_f.weight``, per layer
``backbone.layers.{i}.norm.weight`` and ``backbone.layers.{i}.mixer.*``; ``lm_head.weight``
only when the embeddings are untied.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, fan_in_normal, hf_from_params, init_from_table, params_from_hf
from .block import BCDT_NORMS
from .config import Config


def mixer_shapes(cfg: Config) -> dict:
    """Local tensor names -> shapes of one mixer (``in_proj.weight``, ...)."""
    D, C, N, R, K = (cfg.hidden_size, cfg.intermediate_size, cfg.state_size, cfg.time_step_rank,
                     cfg.conv_kernel)
    m = {"in_proj.weight": (2 * C, D), "conv1d.weight": (C, 1, K), "x_proj.weight": (R + 2 * N, C),
         "dt_proj.weight": (C, R), "dt_proj.bias": (C,), "A_log": (C, N), "D": (C,),
         "out_proj.weight": (D, C)}
    if cfg.use_conv_bias:
        m["conv1d.bias"] = (C,)
    if cfg.use_bias:
        m["in_proj.bias"] = (2 * C,)
        m["out_proj.bias"] = (D,)
    if cfg.bcdt_norm_weights:
        m.update(zip(BCDT_NORMS, ((R,), (N,), (N,))))
    return m


def expected_shapes(cfg, mixer_table=mixer_shapes) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes (any ``backbone.*`` residual LM
    whose mixers follow ``mixer_table``; Mamba-2 passes its own)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    req = {"backbone.embeddings.weight": (V, D), "backbone.norm_f.weight": (D,)}
    opt = {}
    mixer = mixer_table(cfg)
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        req[p + "norm.weight"] = (D,)
        req.update({p + "mixer." + k: s for k, s in mixer.items()})
    if cfg.tie_word_embeddings:
        opt["lm_head.weight"] = (V, D)  # HF drops it when tied; ignored if present
    else:
        req["lm_head.weight"] = (V, D)
    return req, opt


def params_from_tensors(cfg, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        mixer = {k[len(p + "mixer."):]: v for k, v in tensors.items() if k.startswith(p + "mixer.")}
        layers.append({"norm": tensors[p + "norm.weight"], "mixer": mixer})
    return {"embeddings": tensors["backbone.embeddings.weight"], "layers": layers,
            "norm_f": tensors["backbone.norm_f.weight"],
            "lm_head": None if cfg.tie_word_embeddings else tensors["lm_head.weight"]}


def tensors_from_params(cfg, params: dict, label: str = "Mamba") -> dict:
    """The ``LM`` parameter tree -> HF tensors (numpy)."""
    t = {"backbone.embeddings.weight": params["embeddings"], "backbone.norm_f.weight": params["norm_f"]}
    for i, layer in enumerate(params["layers"]):
        p = f"backbone.layers.{i}."
        t[p + "norm.weight"] = layer["norm"]
        t.update({p + "mixer." + k: v for k, v in layer["mixer"].items()})
    if not cfg.tie_word_embeddings:
        if params.get("lm_head") is None:
            raise CheckpointError(f"untied {label} model has no lm_head")
        t["lm_head.weight"] = params["lm_head"]
    return t


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "mamba")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return hf_from_params(cfg, tensors_from_params(cfg, params), expected_shapes, "mamba")


def inverse_softplus_dt(n: int, g: np.random.Generator, lo: float = 1e-3, hi: float = 0.1) -> np.ndarray:
    """``dt`` log-uniform in ``[lo, hi]`` stored as its inverse softplus (HF's dt bias init)."""
    dt = np.exp(g.uniform(math.log(lo), math.log(hi), n))
    return dt + np.log(-np.expm1(-dt))


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """HF-like initial value of tensor ``name`` (Mamba and Mamba-2 names)."""
    leaf = name.rsplit(".", 1)[-1] if name.endswith(("A_log", "D", "dt_bias")) else name
    if leaf == "A_log":  # Mamba: log 1..N per channel; Mamba-2: one per head
        if len(shape) == 2:
            return np.log(np.broadcast_to(np.arange(1, shape[1] + 1, dtype=np.float32), shape))
        return np.log(g.uniform(1.0, 16.0, shape))
    if leaf == "D":
        return 1.0 + 0.1 * g.standard_normal(shape)
    if leaf == "dt_bias" or name.endswith("dt_proj.bias"):
        return inverse_softplus_dt(shape[0], g)
    if name.endswith("mixer.norm.weight"):
        return 1.0 + 0.1 * g.standard_normal(shape)
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return np.ones(shape)
    if name.endswith("embeddings.weight"):
        return 0.1 * g.standard_normal(shape)
    if name.endswith("conv1d.bias"):
        return 0.1 * g.standard_normal(shape)
    if name.endswith(".bias"):
        return 0.02 * g.standard_normal(shape)
    return fan_in_normal(shape, g)


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM`` (HF-like scales), drawn from the shape
    table. ``key``: int seed or JAX PRNG key."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["mixer_shapes", "expected_shapes", "params_from_tensors", "tensors_from_params", "to_params",
           "from_params", "init_rule", "init_params", "inverse_softplus_dt"]
