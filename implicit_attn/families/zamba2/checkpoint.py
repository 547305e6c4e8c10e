"""Zamba2 checkpoints: the shape table (HF names as saved on disk), HF tensors <-> params,
and ``init_params`` drawn from the same table.

HF layout: ``model.embed_tokens.weight``, ``model.final_layernorm.weight``, ``lm_head.weight``
(absent when tied, the default). A Mamba layer ``i``: ``model.layers.{i}.input_layernorm.weight``
and ``model.layers.{i}.mamba.*`` (HF Mamba-2 names). A hybrid layer ``i``:
``model.layers.{i}.linear.weight``, ``mamba_decoder.input_layernorm.weight``,
``mamba_decoder.mamba.*`` and ``shared_transformer.*``: ``input_layernorm.weight (2D,)``,
``pre_ff_layernorm.weight (D,)``, ``self_attn.{q,k,v,o}_proj.weight``,
``feed_forward.{gate_up,down}_proj.*`` and the adapters of every hybrid layer ``j`` the block
serves, ``feed_forward.gate_up_proj_adapter_list.{j}.{0,1}.weight`` and (with
``use_shared_attention_adapter``) ``self_attn.linear_{q,k,v}_adapter_list.{j}.{0,1}.weight``.
With ``tie_word_embeddings`` (the default) HF ties the shared block of hybrid layer ``k >=
num_mem_blocks`` to that of hybrid layer ``k % num_mem_blocks``, and ``save_pretrained`` writes
only the first copy: the later copies are optional here and, where present, must equal the
first. Without it HF ties nothing: each hybrid layer's block is its own and holds, besides
its own adapters, those of the other slots ``j = k (mod num_mem_blocks)``, which HF never uses
(optional here, and not kept).

Params: ``{"embed_tokens", "shared_blocks": [{"input_layernorm", "pre_ff_layernorm",
"self_attn", "feed_forward"}], "layers": [...], "final_layernorm", "lm_head"}`` with our layers
``{"input_layernorm", "mixer"}`` (Mamba) and ``{"attention_adapters": {"{q,k,v}_proj.lora_a",
"lora_b"}, "mlp_adapters": {"gate_up_proj.lora_a", "lora_b"}, "linear"}`` (shared attention).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, hf_from_params, init_from_table, params_from_hf
from ..bamba.checkpoint import attention_shapes
from ..bamba.checkpoint import init_rule as bamba_init_rule
from ..mamba2.checkpoint import mixer_shapes as mamba_shapes
from .config import Config

ADAPTED = ("q", "k", "v")  # the attention projections with adapters


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def attention_adapter_names(cfg: Config, j: int) -> dict:
    """Our names -> HF's (under the block prefix) of hybrid layer ``j``'s q/k/v adapters
    (none without ``use_shared_attention_adapter``)."""
    if not cfg.use_shared_attention_adapter:
        return {}
    return {f"{x}_proj.lora_{ab}": f"self_attn.linear_{x}_adapter_list.{j}.{n}.weight"
            for x in ADAPTED for ab, n in (("a", 0), ("b", 1))}


def mlp_adapter_names(cfg: Config, j: int) -> dict:
    """Our names -> HF's (under the block prefix) of hybrid layer ``j``'s MLP adapter."""
    return {f"gate_up_proj.lora_{ab}": f"feed_forward.gate_up_proj_adapter_list.{j}.{n}.weight"
            for ab, n in (("a", 0), ("b", 1))}


def block_shapes(cfg: Config) -> dict:
    """Local names (under ``shared_transformer.``) -> shapes of a shared block without adapters."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    m = {"input_layernorm.weight": (2 * D,), "pre_ff_layernorm.weight": (D,),
         **{"self_attn." + k: s for k, s in attention_shapes(cfg).items()},
         "feed_forward.gate_up_proj.weight": (2 * F, D), "feed_forward.down_proj.weight": (D, F)}
    if cfg.add_bias_linear:
        m.update({"feed_forward.gate_up_proj.bias": (2 * F,), "feed_forward.down_proj.bias": (D,)})
    return m


def adapter_shapes(cfg: Config, j: int) -> dict:
    """Local names (under ``shared_transformer.``) -> shapes of hybrid layer ``j``'s adapters."""
    D, F, r, A = cfg.hidden_size, cfg.intermediate_size, cfg.adapter_rank, cfg.attention_input_size
    mlp = mlp_adapter_names(cfg, j)
    m = {mlp["gate_up_proj.lora_a"]: (r, D), mlp["gate_up_proj.lora_b"]: (2 * F, r)}
    m.update({hf: (r, A) if ours.endswith("lora_a") else (A, r) for ours, hf in attention_adapter_names(cfg, j).items()})
    return m


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a Zamba-like checkpoint names its tensors.

    Attributes:
      family: the model_type, for messages.
      shared: the prefix of a hybrid layer's shared block (``"shared_transformer."``).
      block_shapes: ``Config -> {local name: shape}`` of a shared block without adapters.
      adapter_shapes: ``(Config, j) -> {local name: shape}`` of hybrid ``j``'s adapters.
      attention_adapters, mlp_adapters: ``(Config, j) -> {our name: local name}``.
      mamba_shapes: ``mixer config -> {local name: shape}`` of a Mamba mixer.
    """

    family: str
    shared: str
    block_shapes: Callable
    adapter_shapes: Callable
    attention_adapters: Callable
    mlp_adapters: Callable
    mamba_shapes: Callable


LAYOUT = Layout("zamba2", "shared_transformer.", block_shapes, adapter_shapes, attention_adapter_names,
                mlp_adapter_names, mamba_shapes)


def adapter_slots(cfg, k: int) -> list[int]:
    """The adapter slots HF builds in hybrid layer ``k``'s block: every hybrid ``j = k (mod
    num_mem_blocks)``."""
    M = cfg.num_mem_blocks
    return [j for j in range(len(cfg.hybrid_layer_ids)) if j % M == k % M]


def block_source(cfg, layout: Layout, block: int) -> str:
    """The prefix HF stores shared block ``block`` under (its first hybrid layer's; blocks are
    numbered by the first hybrid layer that uses them)."""
    return layer_prefix(cfg.hybrid_layer_ids[block]) + layout.shared


def shared_block_table(cfg, layout: Layout, k: int) -> dict:
    """Local names (under ``layout.shared``) -> shapes of hybrid layer ``k``'s block as HF
    stores it: its weights and the adapters of its slots (``adapter_slots``)."""
    m = layout.block_shapes(cfg)
    for j in adapter_slots(cfg, k):
        m.update(layout.adapter_shapes(cfg, j))
    return m


def layout_shapes(cfg, layout: Layout) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes of a checkpoint in ``layout`` (the
    tied copies of the shared blocks are optional)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    req = {"model.embed_tokens.weight": (V, D), "model.final_layernorm.weight": (D,)}
    opt = {}
    mamba = layout.mamba_shapes(cfg.mixer_config)
    hybrid = {i: k for k, i in enumerate(cfg.hybrid_layer_ids)}
    for i in range(cfg.num_hidden_layers):
        p = layer_prefix(i)
        if i not in hybrid:
            req[p + "input_layernorm.weight"] = (D,)
            req.update({p + "mamba." + k: s for k, s in mamba.items()})
            continue
        k, shared = hybrid[i], p + layout.shared
        req[p + "linear.weight"] = (D, D)
        req[p + "mamba_decoder.input_layernorm.weight"] = (D,)
        req.update({p + "mamba_decoder.mamba." + n: s for n, s in mamba.items()})
        if cfg.tie_word_embeddings:  # later hybrids' copies are tied: saved or not
            table = shared_block_table(cfg, layout, k)
            (req if k < cfg.num_mem_blocks else opt).update({shared + n: s for n, s in table.items()})
        else:  # every block its own; the other slots' adapters HF never uses
            own = {**layout.block_shapes(cfg), **layout.adapter_shapes(cfg, k)}
            req.update({shared + n: s for n, s in own.items()})
            opt.update({shared + n: s for j in adapter_slots(cfg, k) if j != k
                        for n, s in layout.adapter_shapes(cfg, j).items()})
    (opt if cfg.tie_word_embeddings else req)["lm_head.weight"] = (V, D)
    return req, opt


def check_tied_copies(cfg, tensors: dict, layout: Layout):
    """``CheckpointError`` naming the first tied copy of a shared-block tensor that differs
    from the copy HF uses (the first; tied checkpoints only)."""
    if not cfg.tie_word_embeddings:
        return
    for k, i in enumerate(cfg.hybrid_layer_ids):
        if k < cfg.num_mem_blocks:
            continue
        first = block_source(cfg, layout, k % cfg.num_mem_blocks)
        for n in shared_block_table(cfg, layout, k):
            name = layer_prefix(i) + layout.shared + n
            if name in tensors and not np.array_equal(np.asarray(tensors[name]), np.asarray(tensors[first + n])):
                raise CheckpointError(f"{layout.family} checkpoint: {name} differs from {first + n}, the shared "
                                      f"block it is tied to (HF would use the latter)")


def layout_params(cfg, tensors: dict, layout: Layout) -> dict:
    """HF tensors (already checked) in ``layout`` -> the ``LM`` parameter tree."""
    check_tied_copies(cfg, tensors, layout)
    blocks = []
    for b in range(cfg.num_shared_blocks):
        src = block_source(cfg, layout, b)
        own = {n: tensors[src + n] for n in layout.block_shapes(cfg)}
        blocks.append({"input_layernorm": own["input_layernorm.weight"],
                       "pre_ff_layernorm": own["pre_ff_layernorm.weight"],
                       "self_attn": {n[len("self_attn."):]: v for n, v in own.items() if n.startswith("self_attn.")},
                       "feed_forward": {n[len("feed_forward."):]: v for n, v in own.items()
                                        if n.startswith("feed_forward.")}})
    mamba = layout.mamba_shapes(cfg.mixer_config)
    layers = []
    for kind, i, k, b in zip(cfg.layer_types, cfg.hf_layers, cfg.hybrid_ordinals, cfg.shared_block_index):
        p = layer_prefix(i)
        if kind == "attention":
            src = block_source(cfg, layout, b)
            layers.append({"attention_adapters": {ours: tensors[src + hf]
                                                  for ours, hf in layout.attention_adapters(cfg, k).items()},
                           "mlp_adapters": {ours: tensors[src + hf] for ours, hf in layout.mlp_adapters(cfg, k).items()},
                           "linear": tensors[p + "linear.weight"]})
        else:
            p = p if k is None else p + "mamba_decoder."
            layers.append({"input_layernorm": tensors[p + "input_layernorm.weight"],
                           "mixer": {n: tensors[p + "mamba." + n] for n in mamba}})
    return {"embed_tokens": tensors["model.embed_tokens.weight"], "shared_blocks": blocks, "layers": layers,
            "final_layernorm": tensors["model.final_layernorm.weight"],
            "lm_head": None if cfg.tie_word_embeddings else tensors["lm_head.weight"]}


def layout_tensors(cfg, params: dict, layout: Layout) -> dict:
    """The inverse of ``layout_params`` (unchecked; the tied copies are not written, as
    ``save_pretrained`` does)."""
    t = {"model.embed_tokens.weight": params["embed_tokens"], "model.final_layernorm.weight": params["final_layernorm"]}
    for b, block in enumerate(params["shared_blocks"]):
        src = block_source(cfg, layout, b)
        t[src + "input_layernorm.weight"] = block["input_layernorm"]
        t[src + "pre_ff_layernorm.weight"] = block["pre_ff_layernorm"]
        t.update({src + "self_attn." + n: v for n, v in block["self_attn"].items()})
        t.update({src + "feed_forward." + n: v for n, v in block["feed_forward"].items()})
    for kind, i, k, b, layer in zip(cfg.layer_types, cfg.hf_layers, cfg.hybrid_ordinals, cfg.shared_block_index,
                                    params["layers"]):
        p = layer_prefix(i)
        if kind == "attention":
            src = block_source(cfg, layout, b)
            names = {**layout.attention_adapters(cfg, k), **layout.mlp_adapters(cfg, k)}
            t.update({src + names[n]: v for n, v in {**layer["attention_adapters"], **layer["mlp_adapters"]}.items()})
            t[p + "linear.weight"] = layer["linear"]
        else:
            p = p if k is None else p + "mamba_decoder."
            t[p + "input_layernorm.weight"] = layer["input_layernorm"]
            t.update({p + "mamba." + n: v for n, v in layer["mixer"].items()})
    if not cfg.tie_word_embeddings:
        if params.get("lm_head") is None:
            raise CheckpointError(f"untied {layout.family} model has no lm_head")
        t["lm_head.weight"] = params["lm_head"]
    return t


def layout_checkpoint(config_cls, layout: Layout) -> SimpleNamespace:
    """The checkpoint functions of a family stored in ``layout`` (Zamba2, Zamba): a namespace
    of ``expected_shapes``, ``params_from_tensors``, ``tensors_from_params``, ``to_params``,
    ``from_params`` and ``init_params`` (Bamba's init rules: norm weights near 1, Mamba's for
    the mixers), as ``bamba.checkpoint.layout_checkpoint``'s."""
    family = layout.family

    def expected_shapes(cfg) -> tuple[dict, dict]:
        """``(required, optional)`` HF tensor names -> shapes (tied copies optional)."""
        return layout_shapes(cfg, layout)

    def params_from_tensors(cfg, tensors: dict) -> dict:
        """HF tensors (already checked) -> the ``LM`` parameter tree."""
        return layout_params(cfg, tensors, layout)

    def tensors_from_params(cfg, params: dict) -> dict:
        """The ``LM`` parameter tree -> HF tensors (each shared block once)."""
        return layout_tensors(cfg, params, layout)

    def to_params(config: dict, tensors: dict) -> tuple:
        """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
        return params_from_hf(config_cls, expected_shapes, params_from_tensors, config, tensors, family)

    def from_params(cfg, params: dict) -> tuple[dict, dict]:
        """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
        return hf_from_params(cfg, tensors_from_params(cfg, params), expected_shapes, family)

    def init_params(cfg, key, dtype=jnp.float32) -> dict:
        """Random parameters in the layout of ``LM``, drawn from the shape table."""
        return init_from_table(cfg, expected_shapes, bamba_init_rule, params_from_tensors, key, dtype)

    return SimpleNamespace(expected_shapes=expected_shapes, params_from_tensors=params_from_tensors,
                           tensors_from_params=tensors_from_params, to_params=to_params, from_params=from_params,
                           init_params=init_params)


CHECKPOINT = layout_checkpoint(Config, LAYOUT)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["Layout", "LAYOUT", "layer_prefix", "attention_adapter_names", "mlp_adapter_names", "block_shapes",
           "adapter_shapes", "adapter_slots", "block_source", "shared_block_table", "layout_shapes",
           "check_tied_copies", "layout_params", "layout_tensors", "layout_checkpoint", "CHECKPOINT",
           "expected_shapes", "params_from_tensors", "to_params", "from_params", "init_params"]
