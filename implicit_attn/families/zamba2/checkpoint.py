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

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, hf_from_params, init_from_table, params_from_hf
from ..bamba.checkpoint import attention_shapes
from ..bamba.checkpoint import init_rule as bamba_init_rule
from ..mamba2.checkpoint import mixer_shapes as mamba_shapes
from .config import Config

ADAPTED = ("q", "k", "v")  # the attention projections with adapters
SHARED = "shared_transformer."


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def attention_adapter_names(j: int) -> dict:
    """Our names -> HF's (under ``shared_transformer.``) of hybrid layer ``j``'s q/k/v adapters."""
    return {f"{x}_proj.lora_{ab}": f"self_attn.linear_{x}_adapter_list.{j}.{n}.weight"
            for x in ADAPTED for ab, n in (("a", 0), ("b", 1))}


def mlp_adapter_names(j: int) -> dict:
    """Our names -> HF's (under ``shared_transformer.``) of hybrid layer ``j``'s MLP adapter."""
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
    D, F, r = cfg.hidden_size, cfg.intermediate_size, cfg.adapter_rank
    mlp = mlp_adapter_names(j)
    m = {mlp["gate_up_proj.lora_a"]: (r, D), mlp["gate_up_proj.lora_b"]: (2 * F, r)}
    if cfg.use_shared_attention_adapter:
        A = cfg.attention_input_size
        m.update({hf: (r, A) if ours.endswith("lora_a") else (A, r) for ours, hf in attention_adapter_names(j).items()})
    return m


def adapter_slots(cfg: Config, k: int) -> list[int]:
    """The adapter slots HF builds in hybrid layer ``k``'s block: every hybrid ``j = k (mod
    num_mem_blocks)``."""
    M = cfg.num_mem_blocks
    return [j for j in range(len(cfg.hybrid_layer_ids)) if j % M == k % M]


def shared_block_table(cfg: Config, k: int) -> dict:
    """Local names (under ``shared_transformer.``) -> shapes of hybrid layer ``k``'s block as HF
    stores it: its weights and the adapters of its slots (``adapter_slots``)."""
    m = block_shapes(cfg)
    for j in adapter_slots(cfg, k):
        m.update(adapter_shapes(cfg, j))
    return m


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes (the tied copies of the shared
    blocks are optional)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    req = {"model.embed_tokens.weight": (V, D), "model.final_layernorm.weight": (D,)}
    opt = {}
    mamba = mamba_shapes(cfg.mixer_config)
    M = cfg.num_mem_blocks
    hybrid = {i: k for k, i in enumerate(cfg.hybrid_layer_ids)}
    for i in range(cfg.num_hidden_layers):
        p = layer_prefix(i)
        if i not in hybrid:
            req[p + "input_layernorm.weight"] = (D,)
            req.update({p + "mamba." + k: s for k, s in mamba.items()})
            continue
        k = hybrid[i]
        req[p + "linear.weight"] = (D, D)
        req[p + "mamba_decoder.input_layernorm.weight"] = (D,)
        req.update({p + "mamba_decoder.mamba." + n: s for n, s in mamba.items()})
        if cfg.tie_word_embeddings:  # later hybrids' copies are tied: saved or not
            (req if k < M else opt).update({p + SHARED + n: s for n, s in shared_block_table(cfg, k).items()})
        else:  # every block its own; the other slots' adapters HF never uses
            req.update({p + SHARED + n: s for n, s in {**block_shapes(cfg), **adapter_shapes(cfg, k)}.items()})
            opt.update({p + SHARED + n: s for j in adapter_slots(cfg, k) if j != k
                        for n, s in adapter_shapes(cfg, j).items()})
    (opt if cfg.tie_word_embeddings else req)["lm_head.weight"] = (V, D)
    return req, opt


def block_source(cfg: Config, block: int) -> str:
    """The prefix HF stores shared block ``block`` under (its first hybrid layer's; blocks are
    numbered by the first hybrid layer that uses them)."""
    return layer_prefix(cfg.hybrid_layer_ids[block]) + SHARED


def check_tied_copies(cfg: Config, tensors: dict):
    """``CheckpointError`` naming the first tied copy of a shared-block tensor that differs
    from the copy HF uses (the first; tied checkpoints only)."""
    if not cfg.tie_word_embeddings:
        return
    for k, i in enumerate(cfg.hybrid_layer_ids):
        if k < cfg.num_mem_blocks:
            continue
        b = k % cfg.num_mem_blocks
        for n in shared_block_table(cfg, k):
            name = layer_prefix(i) + SHARED + n
            if name in tensors and not np.array_equal(np.asarray(tensors[name]),
                                                      np.asarray(tensors[block_source(cfg, b) + n])):
                raise CheckpointError(f"zamba2 checkpoint: {name} differs from {block_source(cfg, b) + n}, the "
                                      f"shared block it is tied to (HF would use the latter)")


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree."""
    check_tied_copies(cfg, tensors)
    blocks = []
    for b in range(cfg.num_shared_blocks):
        src = block_source(cfg, b)
        own = {n: tensors[src + n] for n in block_shapes(cfg)}
        blocks.append({"input_layernorm": own["input_layernorm.weight"],
                       "pre_ff_layernorm": own["pre_ff_layernorm.weight"],
                       "self_attn": {n[len("self_attn."):]: v for n, v in own.items() if n.startswith("self_attn.")},
                       "feed_forward": {n[len("feed_forward."):]: v for n, v in own.items()
                                        if n.startswith("feed_forward.")}})
    mamba = mamba_shapes(cfg.mixer_config)
    layers = []
    for kind, i, k, b in zip(cfg.layer_types, cfg.hf_layers, cfg.hybrid_ordinals, cfg.shared_block_index):
        p = layer_prefix(i)
        if kind == "attention":
            src = block_source(cfg, b)
            attn = attention_adapter_names(k) if cfg.use_shared_attention_adapter else {}
            layers.append({"attention_adapters": {ours: tensors[src + hf] for ours, hf in attn.items()},
                           "mlp_adapters": {ours: tensors[src + hf] for ours, hf in mlp_adapter_names(k).items()},
                           "linear": tensors[p + "linear.weight"]})
        else:
            p = p if k is None else p + "mamba_decoder."
            layers.append({"input_layernorm": tensors[p + "input_layernorm.weight"],
                           "mixer": {n: tensors[p + "mamba." + n] for n in mamba}})
    return {"embed_tokens": tensors["model.embed_tokens.weight"], "shared_blocks": blocks, "layers": layers,
            "final_layernorm": tensors["model.final_layernorm.weight"],
            "lm_head": None if cfg.tie_word_embeddings else tensors["lm_head.weight"]}


def tensors_from_params(cfg: Config, params: dict) -> dict:
    """The inverse of ``params_from_tensors`` (unchecked; the tied copies are not written, as
    ``save_pretrained`` does)."""
    t = {"model.embed_tokens.weight": params["embed_tokens"], "model.final_layernorm.weight": params["final_layernorm"]}
    for b, block in enumerate(params["shared_blocks"]):
        src = block_source(cfg, b)
        t[src + "input_layernorm.weight"] = block["input_layernorm"]
        t[src + "pre_ff_layernorm.weight"] = block["pre_ff_layernorm"]
        t.update({src + "self_attn." + n: v for n, v in block["self_attn"].items()})
        t.update({src + "feed_forward." + n: v for n, v in block["feed_forward"].items()})
    for kind, i, k, b, layer in zip(cfg.layer_types, cfg.hf_layers, cfg.hybrid_ordinals, cfg.shared_block_index,
                                    params["layers"]):
        p = layer_prefix(i)
        if kind == "attention":
            src = block_source(cfg, b)
            names = {**attention_adapter_names(k), **mlp_adapter_names(k)}
            t.update({src + names[n]: v for n, v in {**layer["attention_adapters"], **layer["mlp_adapters"]}.items()})
            t[p + "linear.weight"] = layer["linear"]
        else:
            p = p if k is None else p + "mamba_decoder."
            t[p + "input_layernorm.weight"] = layer["input_layernorm"]
            t.update({p + "mamba." + n: v for n, v in layer["mixer"].items()})
    if not cfg.tie_word_embeddings:
        if params.get("lm_head") is None:
            raise CheckpointError("untied zamba2 model has no lm_head")
        t["lm_head.weight"] = params["lm_head"]
    return t


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "zamba2")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return hf_from_params(cfg, tensors_from_params(cfg, params), expected_shapes, "zamba2")


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table (Bamba's rules:
    norm weights near 1, Mamba-2's for the mixers)."""
    return init_from_table(cfg, expected_shapes, bamba_init_rule, params_from_tensors, key, dtype)


__all__ = ["block_shapes", "adapter_shapes", "adapter_slots", "shared_block_table", "expected_shapes", "check_tied_copies",
           "params_from_tensors", "tensors_from_params", "to_params", "from_params", "init_params"]
