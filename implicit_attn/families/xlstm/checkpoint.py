"""xLSTM checkpoints in transformers' layout: one shape table, HF tensors <-> params, ``init_params``
drawn from the same table (``rwkv.checkpoint.blocks_checkpoint`` with xLSTM's names).

Names read (``i`` the block; ``D`` hidden, ``QK``/``V`` the query-key and value widths, ``H``
heads, ``F`` the feed-forward width; ``.bias`` of every projection and norm only with
``use_bias``, except the gates' biases, always there, and the output norm's, never):
``backbone.embeddings.weight (vocab, D)``, ``backbone.out_norm.weight (D,)``, ``lm_head.weight
(vocab, D)``; per block ``backbone.blocks.{i}.``: ``norm_mlstm.weight``, ``norm_ffn.weight``
``(D,)``; under ``mlstm_layer.``: ``weight_mode="single"``: ``q.weight``, ``k.weight (QK, D)``,
``v.weight``, ``ogate_preact.weight (V, D)``, ``igate_preact.{weight (H, D), bias (H,)}``,
``fgate_preact.{weight, bias}``; ``"fused"``: ``qkv_opreact.weight (2 QK + 2 V, D)`` (rows q, k, v,
o), ``ifgate_preact.{weight (2H, D), bias (2H,)}`` (rows i, f); then ``multihead_norm.weight
(V,)``, ``out_proj.weight (D, V)``; under ``ffn.``: ``proj_up_gate.weight``, ``proj_up.weight (F,
D)`` ("single") or ``proj_up_gate_z.weight (2F, D)`` ("fused", rows gate, up), ``proj_down.weight
(D, F)``.
"""
from __future__ import annotations

import numpy as np

from ...nn import fan_in_normal
from ..rwkv.checkpoint import Names, blocks_checkpoint
from .config import Config

NAMES = Names(root="backbone.", layers="blocks", first_norm="pre_norm", norms=("norm_mlstm", "norm_ffn"),
              mixer="mlstm_layer", ffn="ffn", final_norm="out_norm", head="lm_head", final_norm_bias=False)


def linears(table: dict, bias: bool) -> dict:
    """``{name: (out, in)}`` -> ``name.weight`` and, with ``bias``, ``name.bias (out,)``."""
    out = {}
    for name, (o, i) in table.items():
        out[name + ".weight"] = (o, i)
        if bias:
            out[name + ".bias"] = (o,)
    return out


def mixer_shapes(cfg: Config, i: int = 0) -> dict:
    """Local names (under ``mlstm_layer.``) -> shapes of an mLSTM layer."""
    D, QK, V, H, bias = cfg.hidden_size, cfg.qk_dim, cfg.v_dim, cfg.num_heads, cfg.use_bias
    if cfg.weight_mode == "single":
        shapes = linears({"q": (QK, D), "k": (QK, D), "v": (V, D), "ogate_preact": (V, D)}, bias)
        shapes.update(linears({"igate_preact": (H, D), "fgate_preact": (H, D)}, True))
    else:
        shapes = linears({"qkv_opreact": (2 * QK + 2 * V, D)}, bias)
        shapes.update(linears({"ifgate_preact": (2 * H, D)}, True))
    shapes["multihead_norm.weight"] = (V,)
    if bias:
        shapes["multihead_norm.bias"] = (V,)
    shapes.update(linears({"out_proj": (D, V)}, bias))
    return shapes


def ffn_shapes(cfg: Config, i: int = 0) -> dict:
    """Local names (under ``ffn.``) -> shapes of the gated feed-forward part."""
    D, F = cfg.hidden_size, cfg.ffn_size
    up = {"proj_up_gate": (F, D), "proj_up": (F, D)} if cfg.weight_mode == "single" else {"proj_up_gate_z": (2 * F, D)}
    return linears({**up, "proj_down": (D, F)}, cfg.use_bias)


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Initial value of tensor ``name``: norms near the identity, unit-scale embeddings, input gates
    spread over ``-3 ... 3`` and forget gates over ``1 ... 5`` (fused: the first half of the bias is
    the input gates'), small biases, fan-in scaled matrices."""
    if name.endswith("embeddings.weight"):
        return g.standard_normal(shape)
    if "norm" in name:
        return (1.0 + 0.1 * g.standard_normal(shape)) if name.endswith("weight") else 0.1 * g.standard_normal(shape)
    if name.endswith(("igate_preact.bias", "fgate_preact.bias", "ifgate_preact.bias")):
        n = shape[0] // 2 if "ifgate" in name else shape[0]
        i_b, f_b = np.linspace(-3.0, 3.0, n), np.linspace(1.0, 5.0, n)
        base = np.concatenate([i_b, f_b]) if "ifgate" in name else (i_b if "igate" in name else f_b)
        return base + 0.1 * g.standard_normal(shape)
    if name.endswith(".bias"):
        return 0.1 * g.standard_normal(shape)
    return fan_in_normal(shape, g)


CHECKPOINT = blocks_checkpoint(Config, mixer_shapes, ffn_shapes, init_rule, Config.label, NAMES)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["NAMES", "linears", "mixer_shapes", "ffn_shapes", "init_rule", "CHECKPOINT", "expected_shapes",
           "params_from_tensors", "to_params", "from_params", "init_params"]
