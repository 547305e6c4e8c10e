"""Mamba-2 (HF ``Mamba2ForCausalLM``) checkpoints <-> ``implicit_attn.models.mamba2`` params."""
from __future__ import annotations

import numpy as np

from implicit_attn.models.mamba2 import Config

from . import CheckpointError, check_tensors

PREFIX = "backbone."


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes for ``cfg``.

    ``in_proj`` rows are ``[z0, x0 (d_mlp each), z (C), xBC (C + 2 G N), dt (H)]`` with
    ``C = num_heads * head_dim`` and ``d_mlp = expand * hidden_size - C`` (0 in HF configs).
    """
    D, H, K, V = cfg.hidden_size, cfg.num_heads, cfg.conv_kernel, cfg.vocab_size
    req = {"backbone.embeddings.weight": (V, D), "backbone.norm_f.weight": (D,)}
    opt = {}
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        req[p + "norm.weight"] = (D,)
        m = p + "mixer."
        req.update({m + "in_proj.weight": (cfg.proj_size, D), m + "conv1d.weight": (cfg.conv_dim, 1, K),
                    m + "dt_bias": (H,), m + "A_log": (H,), m + "D": (H,),
                    m + "norm.weight": (cfg.d_ssm,), m + "out_proj.weight": (D, cfg.intermediate_size)})
        if cfg.use_conv_bias:
            req[m + "conv1d.bias"] = (cfg.conv_dim,)
        if cfg.use_bias:
            req[m + "in_proj.bias"] = (cfg.proj_size,)
            req[m + "out_proj.bias"] = (D,)
    if cfg.tie_word_embeddings:
        opt["lm_head.weight"] = (V, D)  # HF drops it when tied; ignored if present
    else:
        req["lm_head.weight"] = (V, D)
    return req, opt


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    try:
        cfg = Config.from_hf(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"mamba2 config: {e}") from e
    # Old checkpoints name the embedding "embedding" (HF renames it on load too).
    if "backbone.embedding.weight" in tensors and "backbone.embeddings.weight" not in tensors:
        tensors = dict(tensors)
        tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
    req, opt = expected_shapes(cfg)
    check_tensors(tensors, req, opt, where="mamba2 checkpoint")
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
            raise CheckpointError("untied Mamba-2 model has no lm_head")
        t["lm_head.weight"] = params["lm_head"]
    out = {k: np.asarray(v) for k, v in t.items()}
    check_tensors(out, *expected_shapes(cfg), where="mamba2 params")
    return cfg.to_hf(), out
