"""RWKV-5 checkpoints in the RWKV team's Hugging Face layout (``Rwkv5ForCausalLM``): RWKV-4's
layout and builder (``rwkv.checkpoint.blocks_checkpoint``) with RWKV-5's time-mix table.

Per block ``rwkv.blocks.{i}.`` besides the layer norms and the channel mix (RWKV-4's): the
time mix under ``attention.``: ``time_decay, time_faaaa (H, S)`` (``S = head_size``),
``time_mix_key, time_mix_value, time_mix_receptance, time_mix_gate (1, 1, C)``,
``key, value, receptance, gate .weight (C, C)``, ``output.weight (C, C)``, ``ln_x.{weight,bias} (C,)``.
Weights are kept as stored (training form): the eval-mode rescaling is applied at run time.
"""
from __future__ import annotations

import numpy as np

from ..rwkv.checkpoint import blocks_checkpoint, feed_forward_shapes, shared_init
from .config import Config


def attention_shapes(cfg: Config, i: int = 0) -> dict:
    """Local names (under ``attention.``) -> shapes of an RWKV-5 time mix."""
    C, A, H, S = cfg.hidden_size, cfg.attention_hidden_size, cfg.num_heads, cfg.head_size
    mix = (1, 1, C)
    return {"time_decay": (H, S), "time_faaaa": (H, S), "time_mix_key": mix, "time_mix_value": mix,
            "time_mix_receptance": mix, "time_mix_gate": mix, "key.weight": (A, C), "value.weight": (A, C),
            "receptance.weight": (A, C), "gate.weight": (A, C), "output.weight": (C, A), "ln_x.weight": (C,),
            "ln_x.bias": (C,)}


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Initial value of tensor ``name``: decays spread over fast and slow channels in every head
    (raw ``-6 ... 1``: per-step decays ``e^-e^raw`` from ~1 down to ~0.07), a small bonus, and
    RWKV-4's rules for the rest (``rwkv.checkpoint.shared_init``)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "time_decay":
        H, S = shape
        return np.tile(np.linspace(-6.0, 1.0, S), (H, 1)) + 0.1 * g.standard_normal(shape)
    if leaf == "time_faaaa":
        return 0.5 * g.standard_normal(shape)
    base = shared_init(name, shape, g)
    if base is None:
        raise KeyError(f"RWKV-5 init: no rule for {name!r} {shape}")
    return base


CHECKPOINT = blocks_checkpoint(Config, attention_shapes, feed_forward_shapes, init_rule, "RWKV-5")
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["attention_shapes", "init_rule", "CHECKPOINT", "expected_shapes", "params_from_tensors", "to_params",
           "from_params", "init_params"]
