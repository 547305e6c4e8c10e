"""MiniMax checkpoints: Bamba's layout (``bamba.checkpoint``) under the names HF writes:
``model.norm.weight``; per layer ``input_layernorm.weight``, ``post_attention_layernorm.weight``,
the mixer under ``self_attn.`` (lightning: ``qkv_proj``, ``output_gate``, ``norm``, ``out_proj``;
softmax attention: ``{q,k,v,o}_proj``) and the MoE under ``block_sparse_moe.``: ``gate.weight`` and
the experts one by one (``experts.{e}.w1/w3/w2.weight``: gate, up, down; stacked in the params as
``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj (E, D, I)``, Kimi-Linear's ``FUSED``).

HF also saves four buffers of each lightning layer: ``slope_rate (H, 1, 1)`` and the decay tables
``query_decay``, ``key_decay`` ``(H, block_size, 1)`` and ``diagonal_decay (1, H, block_size,
block_size)``. They are optional: the params hold ``slope_rate`` (the checkpoint's, which HF uses,
else ``block.slope_rates``), and a stored decay table must be the one its slopes give (else a
``CheckpointError``: HF would compute with it). ``from_params`` writes ``slope_rate`` only.
"""
from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, hf_from_params, init_from_table, params_from_hf
from ...nn.checkpoint import StateDictNames
from ...nn.moe import split_experts, stack_experts
from ..bamba.checkpoint import Layout, attention_shapes, layout_params, layout_shapes
from ..bamba.checkpoint import init_rule as bamba_init_rule
from ..bamba.checkpoint import layout_tensors as bamba_layout_tensors
from ..kimi_linear.checkpoint import FUSED
from .block import decay_tables, slope_rates
from .config import Config

BUFFERS = ("query_decay", "key_decay", "diagonal_decay")
# transformers' state_dict() names the MoE ``mlp.`` and holds its experts stacked
STATE_DICT_NAMES = StateDictNames(renamed=((r"\.mlp\.", ".block_sparse_moe."),), stacked=FUSED)


def lightning_shapes(cfg: Config) -> dict:
    """Local names (under ``self_attn.``) -> shapes of a lightning attention mixer."""
    D, C = cfg.hidden_size, cfg.lightning_channels
    return {"qkv_proj.weight": (3 * C, D), "output_gate.weight": (C, D), "norm.weight": (C,),
            "out_proj.weight": (D, C)}


def buffer_shapes(cfg: Config) -> dict:
    """Local names -> shapes of the optional buffers of a lightning mixer."""
    H, bs = cfg.num_attention_heads, cfg.block_size
    return {"slope_rate": (H, 1, 1), "query_decay": (H, bs, 1), "key_decay": (H, bs, 1),
            "diagonal_decay": (1, H, bs, bs)}


def mixer_tables(cfg: Config, layout) -> dict:
    return {"lightning": lightning_shapes(cfg), "attention": attention_shapes(cfg)}


def ffn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``block_sparse_moe.``) -> shapes of a layer's MoE as stored."""
    D, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    m = {"gate.weight": (E, D)}
    for e in range(E):
        m.update({f"experts.{e}.w1.weight": (I, D), f"experts.{e}.w3.weight": (I, D), f"experts.{e}.w2.weight": (D, I)})
    return m


LAYOUT = Layout(
    "minimax", "model.norm.weight", "post_attention_layernorm.weight", "block_sparse_moe.", ffn_shapes,
    ffn_params=lambda cfg, i, t: stack_experts(t, cfg.num_local_experts, FUSED),
    ffn_tensors=lambda cfg, i, p: split_experts(p, cfg.num_local_experts, FUSED),
    mixer_prefix={"lightning": "self_attn.", "attention": "self_attn."}, mixer_tables=mixer_tables)


def lightning_layers(cfg: Config) -> list[int]:
    return [i for i, kind in enumerate(cfg.layer_types) if kind == "lightning"]


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes (the lightning buffers optional)."""
    req, opt = layout_shapes(cfg, LAYOUT)
    for i in lightning_layers(cfg):
        opt.update({f"model.layers.{i}.self_attn.{k}": s for k, s in buffer_shapes(cfg).items()})
    return req, opt


def checked_slope(cfg: Config, tensors: dict, i: int):
    """Layer ``i``'s ``slope_rate (H, 1, 1)``: the checkpoint's if it has one, else HF's formula
    (float32, as decays are kept);
    ``CheckpointError`` if a stored decay table is not the one these slopes give."""
    p = f"model.layers.{i}.self_attn."
    stored = tensors.get(p + "slope_rate")
    slope = (slope_rates(cfg.num_attention_heads, i, cfg.num_hidden_layers) if stored is None
             else np.asarray(stored, np.float32).reshape(-1))
    present = [k for k in BUFFERS if p + k in tensors]
    if present:
        want = decay_tables(slope, cfg.block_size)
        for k in present:
            got = np.asarray(tensors[p + k], np.float32)
            tol = 1e-5 if np.dtype(tensors[p + k].dtype).itemsize >= 4 else 1e-2
            if not np.allclose(got, want[k], rtol=tol, atol=tol * 1e-3):
                raise CheckpointError(f"minimax checkpoint: {p + k} is not the decay table of the layer's slopes "
                                      f"(slope_rate {'stored' if stored is not None else 'from HF formula'})")
    if stored is not None:
        return stored
    return slope.reshape(-1, 1, 1)


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree (Bamba's; each lightning mixer with
    its ``slope_rate``)."""
    params = layout_params(cfg, tensors, LAYOUT)
    for i in lightning_layers(cfg):
        params["layers"][i]["mixer"]["slope_rate"] = checked_slope(cfg, tensors, i)
    return params


def to_params(config: dict, tensors: dict) -> tuple:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "minimax")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy; with ``slope_rate``)."""
    return hf_from_params(cfg, bamba_layout_tensors(cfg, params, LAYOUT), expected_shapes, "minimax")


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Bamba's rules (norm weights near 1); the lightning output norm's weight near 1 too."""
    if name.endswith("self_attn.norm.weight"):
        return 1.0 + 0.1 * g.standard_normal(shape)
    return bamba_init_rule(name, shape, g)


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table (``init_rule``), the
    slopes from HF's formula."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


CHECKPOINT = SimpleNamespace(expected_shapes=expected_shapes, params_from_tensors=params_from_tensors,
                             to_params=to_params, from_params=from_params, init_params=init_params)

__all__ = ["LAYOUT", "BUFFERS", "STATE_DICT_NAMES", "lightning_shapes", "buffer_shapes", "mixer_tables", "ffn_shapes", "lightning_layers",
           "expected_shapes", "checked_slope", "params_from_tensors", "init_rule", "to_params", "from_params",
           "init_params", "CHECKPOINT"]
