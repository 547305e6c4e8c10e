"""RWKV-4 checkpoints: the one shape table (HF names), HF tensors <-> params, and
``init_params`` drawn from the same table.

Weights are kept as stored (HF's training form); the eval-mode ``rescale_every`` division
is applied by the model at run time, so a save/load round trip is lossless.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, fan_in_normal, hf_from_params, init_from_table, params_from_hf
from .config import Config

ATTENTION = ("time_decay", "time_first", "time_mix_key", "time_mix_value", "time_mix_receptance",
             "key.weight", "value.weight", "receptance.weight", "output.weight")
FEED_FORWARD = ("time_mix_key", "time_mix_receptance", "key.weight", "receptance.weight", "value.weight")


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes for ``cfg``."""
    D, A, F, V = cfg.hidden_size, cfg.attention_hidden_size, cfg.intermediate_size, cfg.vocab_size
    mix = (1, 1, D)
    att = {"time_decay": (A,), "time_first": (A,), "time_mix_key": mix, "time_mix_value": mix,
           "time_mix_receptance": mix, "key.weight": (A, D), "value.weight": (A, D),
           "receptance.weight": (A, D), "output.weight": (D, A)}
    ffn = {"time_mix_key": mix, "time_mix_receptance": mix, "key.weight": (F, D),
           "receptance.weight": (D, D), "value.weight": (D, F)}
    req = {"rwkv.embeddings.weight": (V, D), "rwkv.ln_out.weight": (D,), "rwkv.ln_out.bias": (D,)}
    opt = {}
    for i in range(cfg.num_hidden_layers):
        p = f"rwkv.blocks.{i}."
        lns = ("pre_ln", "ln1", "ln2") if i == 0 else ("ln1", "ln2")
        for ln in lns:
            req[p + ln + ".weight"] = (D,)
            req[p + ln + ".bias"] = (D,)
        req.update({p + "attention." + k: s for k, s in att.items()})
        req.update({p + "feed_forward." + k: s for k, s in ffn.items()})
    if cfg.tie_word_embeddings:
        opt["head.weight"] = (V, D)  # HF may drop it when tied; ignored if present
    else:
        req["head.weight"] = (V, D)
    return req, opt


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "rwkv")


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree."""
    ln = lambda name: {"weight": tensors[name + ".weight"], "bias": tensors[name + ".bias"]}
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"rwkv.blocks.{i}."
        layers.append({
            "pre_ln": ln(p + "pre_ln") if i == 0 else None,
            "ln1": ln(p + "ln1"), "ln2": ln(p + "ln2"),
            "attention": {k: tensors[p + "attention." + k] for k in ATTENTION},
            "feed_forward": {k: tensors[p + "feed_forward." + k] for k in FEED_FORWARD},
        })
    params = {"embeddings": tensors["rwkv.embeddings.weight"], "layers": layers,
              "ln_out": ln("rwkv.ln_out"),
              "head": None if cfg.tie_word_embeddings else tensors["head.weight"]}
    return params


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    t = {"rwkv.embeddings.weight": params["embeddings"],
         "rwkv.ln_out.weight": params["ln_out"]["weight"], "rwkv.ln_out.bias": params["ln_out"]["bias"]}
    for i, layer in enumerate(params["layers"]):
        p = f"rwkv.blocks.{i}."
        lns = ("ln1", "ln2") + (("pre_ln",) if i == 0 else ())
        for ln in lns:
            if layer.get(ln) is None:
                raise CheckpointError(f"RWKV block {i} has no {ln}")
            t[p + ln + ".weight"] = layer[ln]["weight"]
            t[p + ln + ".bias"] = layer[ln]["bias"]
        t.update({p + "attention." + k: v for k, v in layer["attention"].items()})
        t.update({p + "feed_forward." + k: v for k, v in layer["feed_forward"].items()})
    if not cfg.tie_word_embeddings:
        if params.get("head") is None:
            raise CheckpointError("untied RWKV model has no head")
        t["head.weight"] = params["head"]
    return hf_from_params(cfg, t, expected_shapes, "rwkv")


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Initial value of tensor ``name``: roughly HF's scales, decays spread over fast and slow
    channels."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "time_decay":
        return np.linspace(-5.0, 3.0, shape[0]) + 0.1 * g.standard_normal(shape)
    if leaf == "time_first":
        return np.log(0.3) + 0.5 * g.standard_normal(shape)
    if leaf.startswith("time_mix_"):
        return g.uniform(size=shape)
    if name.endswith("embeddings.weight"):
        return g.standard_normal(shape)
    if ".ln" in name or "ln_out" in name or "pre_ln" in name:
        return (1.0 + 0.1 * g.standard_normal(shape)) if leaf == "weight" else 0.1 * g.standard_normal(shape)
    return fan_in_normal(shape, g)


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table. ``key``: int
    seed or JAX PRNG key."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["expected_shapes", "to_params", "from_params", "params_from_tensors", "init_rule", "init_params",
           "ATTENTION", "FEED_FORWARD"]
