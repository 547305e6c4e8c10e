"""Mamba (HF ``MambaForCausalLM``) checkpoints <-> ``implicit_attn.models.mamba`` params."""
from __future__ import annotations

import numpy as np

from implicit_attn.models.mamba import Config

from . import CheckpointError, check_tensors

PREFIX = "backbone."


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes for ``cfg``."""
    D, C, N, R, K, V = (cfg.hidden_size, cfg.intermediate_size, cfg.state_size,
                        cfg.time_step_rank, cfg.conv_kernel, cfg.vocab_size)
    req = {"backbone.embeddings.weight": (V, D), "backbone.norm_f.weight": (D,)}
    opt = {}
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        req[p + "norm.weight"] = (D,)
        m = p + "mixer."
        req.update({m + "in_proj.weight": (2 * C, D), m + "conv1d.weight": (C, 1, K),
                    m + "x_proj.weight": (R + 2 * N, C), m + "dt_proj.weight": (C, R),
                    m + "dt_proj.bias": (C,), m + "A_log": (C, N), m + "D": (C,),
                    m + "out_proj.weight": (D, C)})
        if cfg.use_conv_bias:
            req[m + "conv1d.bias"] = (C,)
        if cfg.use_bias:
            req[m + "in_proj.bias"] = (2 * C,)
            req[m + "out_proj.bias"] = (D,)
    if cfg.tie_word_embeddings:
        opt["lm_head.weight"] = (V, D)  # HF drops it when tied; ignored if present
    else:
        req["lm_head.weight"] = (V, D)
    return req, opt


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    cfg = Config.from_hf(config)
    req, opt = expected_shapes(cfg)
    check_tensors(tensors, req, opt, where="mamba checkpoint")
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        mixer = {k[len(p + "mixer."):]: v for k, v in tensors.items() if k.startswith(p + "mixer.")}
        layers.append({"norm": tensors[p + "norm.weight"], "mixer": mixer})
    params = {"embeddings": tensors["backbone.embeddings.weight"], "layers": layers,
              "norm_f": tensors["backbone.norm_f.weight"],
              "lm_head": None if cfg.tie_word_embeddings else tensors["lm_head.weight"]}
    return cfg, params


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    t = {"backbone.embeddings.weight": params["embeddings"], "backbone.norm_f.weight": params["norm_f"]}
    for i, layer in enumerate(params["layers"]):
        p = f"backbone.layers.{i}."
        t[p + "norm.weight"] = layer["norm"]
        t.update({p + "mixer." + k: v for k, v in layer["mixer"].items()})
    if not cfg.tie_word_embeddings:
        if params.get("lm_head") is None:
            raise CheckpointError("untied Mamba model has no lm_head")
        t["lm_head.weight"] = params["lm_head"]
    return cfg.to_hf(), {k: np.asarray(v) for k, v in t.items()}
