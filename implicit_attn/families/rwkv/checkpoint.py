"""RWKV-4 checkpoints: the one shape table (HF names), HF tensors <-> params, and
``init_params`` drawn from the same table. RWKV-5 (the RWKV team's HF port, the same layout
with its own time mix) reuses the builder (``blocks_checkpoint``).

Layout (``i`` the block): ``rwkv.embeddings.weight (vocab, D)``, ``rwkv.blocks.{i}.ln1`` /
``ln2`` (and ``pre_ln`` on block 0), each ``weight, bias (D,)``, the time mix under
``rwkv.blocks.{i}.attention.``, the channel mix under ``rwkv.blocks.{i}.feed_forward.``,
``rwkv.ln_out.{weight,bias}``, ``head.weight (vocab, D)`` (absent when tied).

Weights are kept as stored (HF's training form); the eval-mode ``rescale_every`` division
is applied by the model at run time, so a save/load round trip is lossless.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, fan_in_normal, hf_from_params, init_from_table, params_from_hf
from .config import Config

LAYER_NORMS = ("pre_ln", "ln1", "ln2")


def attention_shapes(cfg: Config) -> dict:
    """Local names (under ``attention.``) -> shapes of an RWKV-4 time mix (``A`` the attention width)."""
    D, A = cfg.hidden_size, cfg.attention_hidden_size
    mix = (1, 1, D)
    return {"time_decay": (A,), "time_first": (A,), "time_mix_key": mix, "time_mix_value": mix,
            "time_mix_receptance": mix, "key.weight": (A, D), "value.weight": (A, D), "receptance.weight": (A, D),
            "output.weight": (D, A)}


def feed_forward_shapes(cfg) -> dict:
    """Local names (under ``feed_forward.``) -> shapes of the RWKV-4/5 channel mix (``F`` its
    width, ``cfg.intermediate_size``)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    mix = (1, 1, D)
    return {"time_mix_key": mix, "time_mix_receptance": mix, "key.weight": (F, D), "receptance.weight": (D, D),
            "value.weight": (D, F)}


@dataclasses.dataclass(frozen=True)
class BlocksCheckpoint:
    """The checkpoint functions of one family in the HF RWKV layout (see ``blocks_checkpoint``)."""

    expected_shapes: Callable
    params_from_tensors: Callable
    to_params: Callable
    from_params: Callable
    init_params: Callable


def blocks_checkpoint(config_cls, attention_table: Callable, ffn_table: Callable, init_rule: Callable,
                      where: str) -> BlocksCheckpoint:
    """The checkpoint functions of the HF RWKV layout (module docstring) whose blocks hold
    ``attention_table(cfg)`` under ``attention.`` and ``ffn_table(cfg)`` under
    ``feed_forward.`` (params: ``{"embeddings", "layers": [{"pre_ln" (or None), "ln1", "ln2",
    "attention", "feed_forward"}], "ln_out", "head"}``); ``where`` names the family in errors."""

    def expected_shapes(cfg) -> tuple[dict, dict]:
        """``(required, optional)`` HF tensor names -> shapes for ``cfg``."""
        D, V = cfg.hidden_size, cfg.vocab_size
        req = {"rwkv.embeddings.weight": (V, D), "rwkv.ln_out.weight": (D,), "rwkv.ln_out.bias": (D,)}
        opt = {}
        att, ffn = attention_table(cfg), ffn_table(cfg)
        for i in range(cfg.num_hidden_layers):
            p = f"rwkv.blocks.{i}."
            for ln in LAYER_NORMS if i == 0 else LAYER_NORMS[1:]:
                req[p + ln + ".weight"] = (D,)
                req[p + ln + ".bias"] = (D,)
            req.update({p + "attention." + k: s for k, s in att.items()})
            req.update({p + "feed_forward." + k: s for k, s in ffn.items()})
        if cfg.tie_word_embeddings:
            opt["head.weight"] = (V, D)  # HF may drop it when tied; ignored if present
        else:
            req["head.weight"] = (V, D)
        return req, opt

    def params_from_tensors(cfg, tensors: dict) -> dict:
        """HF tensors (already checked) -> the ``LM`` parameter tree."""
        ln = lambda name: {"weight": tensors[name + ".weight"], "bias": tensors[name + ".bias"]}
        att, ffn = attention_table(cfg), ffn_table(cfg)
        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"rwkv.blocks.{i}."
            layers.append({"pre_ln": ln(p + "pre_ln") if i == 0 else None, "ln1": ln(p + "ln1"), "ln2": ln(p + "ln2"),
                           "attention": {k: tensors[p + "attention." + k] for k in att},
                           "feed_forward": {k: tensors[p + "feed_forward." + k] for k in ffn}})
        return {"embeddings": tensors["rwkv.embeddings.weight"], "layers": layers, "ln_out": ln("rwkv.ln_out"),
                "head": None if cfg.tie_word_embeddings else tensors["head.weight"]}

    def to_params(config: dict, tensors: dict):
        """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
        return params_from_hf(config_cls, expected_shapes, params_from_tensors, config, tensors, where)

    def from_params(cfg, params: dict) -> tuple[dict, dict]:
        """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
        t = {"rwkv.embeddings.weight": params["embeddings"],
             "rwkv.ln_out.weight": params["ln_out"]["weight"], "rwkv.ln_out.bias": params["ln_out"]["bias"]}
        for i, layer in enumerate(params["layers"]):
            p = f"rwkv.blocks.{i}."
            for ln in LAYER_NORMS if i == 0 else LAYER_NORMS[1:]:
                if layer.get(ln) is None:
                    raise CheckpointError(f"{where} block {i} has no {ln}")
                t[p + ln + ".weight"] = layer[ln]["weight"]
                t[p + ln + ".bias"] = layer[ln]["bias"]
            t.update({p + "attention." + k: v for k, v in layer["attention"].items()})
            t.update({p + "feed_forward." + k: v for k, v in layer["feed_forward"].items()})
        if not cfg.tie_word_embeddings:
            if params.get("head") is None:
                raise CheckpointError(f"untied {where} model has no head")
            t["head.weight"] = params["head"]
        return hf_from_params(cfg, t, expected_shapes, config_cls.model_type)

    def init_params(cfg, key, dtype=jnp.float32) -> dict:
        """Random parameters in the layout of ``LM``, drawn from the shape table. ``key``: int
        seed or JAX PRNG key."""
        return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)

    return BlocksCheckpoint(expected_shapes, params_from_tensors, to_params, from_params, init_params)


def shared_init(name: str, shape: tuple, g: np.random.Generator):
    """Initial values RWKV-4 and RWKV-5 share (None for other names): interpolation weights in
    (0, 1), unit-scale embeddings, layer norms near the identity, fan-in scaled matrices."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith("time_mix_"):
        return g.uniform(size=shape)
    if name.endswith("embeddings.weight"):
        return g.standard_normal(shape)
    if ".ln" in name or "ln_out" in name or "pre_ln" in name:
        return (1.0 + 0.1 * g.standard_normal(shape)) if leaf == "weight" else 0.1 * g.standard_normal(shape)
    if leaf == "weight" and len(shape) == 2:
        return fan_in_normal(shape, g)
    return None


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Initial value of tensor ``name``: roughly HF's scales, decays spread over fast and slow
    channels."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "time_decay":
        return np.linspace(-5.0, 3.0, shape[0]) + 0.1 * g.standard_normal(shape)
    if leaf == "time_first":
        return np.log(0.3) + 0.5 * g.standard_normal(shape)
    base = shared_init(name, shape, g)
    return fan_in_normal(shape, g) if base is None else base


CHECKPOINT = blocks_checkpoint(Config, attention_shapes, feed_forward_shapes, init_rule, "rwkv")
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params
ATTENTION = ("time_decay", "time_first", "time_mix_key", "time_mix_value", "time_mix_receptance",
             "key.weight", "value.weight", "receptance.weight", "output.weight")
FEED_FORWARD = ("time_mix_key", "time_mix_receptance", "key.weight", "receptance.weight", "value.weight")


__all__ = ["expected_shapes", "to_params", "from_params", "params_from_tensors", "init_rule", "init_params",
           "ATTENTION", "FEED_FORWARD", "LAYER_NORMS", "attention_shapes", "feed_forward_shapes", "BlocksCheckpoint",
           "blocks_checkpoint", "shared_init", "CHECKPOINT"]
