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

def attention_shapes(cfg: Config, i: int = 0) -> dict:
    """Local names (under ``attention.``) -> shapes of an RWKV-4 time mix (``A`` the attention width)."""
    D, A = cfg.hidden_size, cfg.attention_hidden_size
    mix = (1, 1, D)
    return {"time_decay": (A,), "time_first": (A,), "time_mix_key": mix, "time_mix_value": mix,
            "time_mix_receptance": mix, "key.weight": (A, D), "value.weight": (A, D), "receptance.weight": (A, D),
            "output.weight": (D, A)}


def feed_forward_shapes(cfg, i: int = 0) -> dict:
    """Local names (under ``feed_forward.``) -> shapes of the RWKV-4/5 channel mix (``F`` its
    width, ``cfg.intermediate_size``)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    mix = (1, 1, D)
    return {"time_mix_key": mix, "time_mix_receptance": mix, "key.weight": (F, D), "receptance.weight": (D, D),
            "value.weight": (D, F)}


@dataclasses.dataclass(frozen=True)
class Names:
    """Where an RWKV layout keeps its tensors; the parameter tree uses the same local names.

    Attributes:
      root: the backbone's prefix (``"rwkv."``; fla: ``"model."``); ``layers``: the list's name
        (``"blocks"`` / ``"layers"``); ``first_norm``: layer 0's norm of the embeddings
        (``"pre_ln"`` / ``"pre_norm"``, only with ``cfg.norm_first`` where the config has it);
        ``norms``: each layer's two norms; ``mixer``, ``ffn``: the time and channel mixes'
        prefixes; ``final_norm``; ``head``: the output head (absent when tied).
    """

    root: str = "rwkv."
    layers: str = "blocks"
    first_norm: str = "pre_ln"
    norms: tuple = ("ln1", "ln2")
    mixer: str = "attention"
    ffn: str = "feed_forward"
    final_norm: str = "ln_out"
    head: str = "head"
    final_norm_bias: bool = True


@dataclasses.dataclass(frozen=True)
class BlocksCheckpoint:
    """The checkpoint functions of one family in an RWKV layout (see ``blocks_checkpoint``)."""

    expected_shapes: Callable
    params_from_tensors: Callable
    to_params: Callable
    from_params: Callable
    init_params: Callable


def blocks_checkpoint(config_cls, mixer_table: Callable, ffn_table: Callable, init_rule: Callable, where: str,
                      names: Names = Names(), standard_form: Callable | None = None) -> BlocksCheckpoint:
    """The checkpoint functions of an RWKV layout (``names``; default transformers' RWKV-4 names,
    the module docstring) whose layer ``i`` holds ``mixer_table(cfg, i)`` under ``names.mixer``
    and ``ffn_table(cfg, i)`` under ``names.ffn``. Params: ``{"embeddings", "layers": [{first_norm
    (or None), *norms, mixer, ffn}], final_norm, head}``, norms ``{"weight", "bias"}`` (no bias
    where ``cfg.norm_bias`` is false). ``where`` names the family in errors; ``standard_form``:
    ``(Config, tensors) -> tensors`` turning older forms of the layout into the table's before
    the checks (None: none)."""
    n = names
    emb, final = f"{n.root}embeddings", f"{n.root}{n.final_norm}"
    has_first = lambda cfg, i: i == 0 and getattr(cfg, "norm_first", True)

    def norm_shapes(cfg, name: str, bias: bool = True) -> dict:
        D = cfg.hidden_size
        bias = bias and getattr(cfg, "norm_bias", True)
        return {name + ".weight": (D,), **({name + ".bias": (D,)} if bias else {})}

    def layer_norms(cfg, i: int) -> tuple:
        return ((n.first_norm,) if has_first(cfg, i) else ()) + n.norms

    def expected_shapes(cfg) -> tuple[dict, dict]:
        """``(required, optional)`` HF tensor names -> shapes for ``cfg``."""
        V, D = cfg.vocab_size, cfg.hidden_size
        req = {emb + ".weight": (V, D), **norm_shapes(cfg, final, n.final_norm_bias)}
        opt = {}
        for i in range(cfg.num_hidden_layers):
            p = f"{n.root}{n.layers}.{i}."
            for name in layer_norms(cfg, i):
                req.update(norm_shapes(cfg, p + name))
            req.update({f"{p}{n.mixer}.{k}": v for k, v in mixer_table(cfg, i).items()})
            req.update({f"{p}{n.ffn}.{k}": v for k, v in ffn_table(cfg, i).items()})
        if cfg.tie_word_embeddings:
            opt[n.head + ".weight"] = (V, D)  # may be dropped when tied; ignored if present
        else:
            req[n.head + ".weight"] = (V, D)
        return req, opt

    def params_from_tensors(cfg, tensors: dict) -> dict:
        """HF tensors (already checked) -> the ``LM`` parameter tree."""
        norm = lambda name: {k: tensors[f"{name}.{k}"] for k in ("weight", "bias") if f"{name}.{k}" in tensors}
        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"{n.root}{n.layers}.{i}."
            layer = {n.first_norm: norm(p + n.first_norm) if has_first(cfg, i) else None}
            layer.update({name: norm(p + name) for name in n.norms})
            layer[n.mixer] = {k: tensors[f"{p}{n.mixer}.{k}"] for k in mixer_table(cfg, i)}
            layer[n.ffn] = {k: tensors[f"{p}{n.ffn}.{k}"] for k in ffn_table(cfg, i)}
            layers.append(layer)
        return {"embeddings": tensors[emb + ".weight"], "layers": layers, n.final_norm: norm(final),
                n.head: None if cfg.tie_word_embeddings else tensors[n.head + ".weight"]}

    def to_params(config: dict, tensors: dict):
        """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
        if standard_form is not None:
            try:
                cfg = config_cls.from_hf(config)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{where} config: {e}") from e
            tensors = standard_form(cfg, tensors)
        return params_from_hf(config_cls, expected_shapes, params_from_tensors, config, tensors, where)

    def from_params(cfg, params: dict) -> tuple[dict, dict]:
        """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
        t = {emb + ".weight": params["embeddings"]}
        t.update({f"{final}.{k}": v for k, v in params[n.final_norm].items()})
        for i, layer in enumerate(params["layers"]):
            p = f"{n.root}{n.layers}.{i}."
            for name in layer_norms(cfg, i):
                if layer.get(name) is None:
                    raise CheckpointError(f"{where} layer {i} has no {name}")
                t.update({f"{p}{name}.{k}": v for k, v in layer[name].items()})
            t.update({f"{p}{n.mixer}.{k}": v for k, v in layer[n.mixer].items()})
            t.update({f"{p}{n.ffn}.{k}": v for k, v in layer[n.ffn].items()})
        if not cfg.tie_word_embeddings:
            if params.get(n.head) is None:
                raise CheckpointError(f"untied {where} model has no {n.head}")
            t[n.head + ".weight"] = params[n.head]
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
           "ATTENTION", "FEED_FORWARD", "attention_shapes", "feed_forward_shapes", "Names", "BlocksCheckpoint",
           "blocks_checkpoint", "shared_init", "CHECKPOINT"]
