"""RWKV-6 checkpoints in flash-linear-attention's Hugging Face layout: one shape table, HF tensors
<-> params, ``init_params`` drawn from the same table. RWKV-7 reuses the builder
(``rwkv_checkpoint``) with its own mixer and channel-mix tables.

Names read (``i`` the layer; ``C`` hidden, ``K``/``V`` key/value width, ``R`` the mix LoRA rank,
``G`` the decay LoRA rank, ``F`` the channel-mix width, ``H`` heads):
``model.embeddings.weight (vocab, C)``, ``model.norm.{weight,bias}``, ``lm_head.weight`` (absent
when tied); per layer ``model.layers.{i}.``: ``pre_norm.*`` (layer 0, when ``norm_first``),
``attn_norm.*``, ``ffn_norm.*`` (each ``weight (C,)`` and, with ``norm_bias``, ``bias (C,)``), and
the time mix under ``attn.``: ``x_proj.0.mu (C,)``, ``x_proj.0.linear.weight (5R, C)``,
``x_proj.2.weight (C, 5R)``, ``x_bias (5, C)`` (rows r, w, k, v, g), ``{r,k}_proj.linear.weight (K,
C)``, ``{v,g}_proj.linear.weight (V, C)``, ``w_proj.linear.lora.0.weight (G, C)``,
``w_proj.linear.lora.2.weight (K, G)``, ``w_proj.linear.lora.2.bias (K,)``, ``bonus (H, K/H)``,
``g_norm.{weight,bias} (V,)``, ``o_proj.weight (C, V)``; the channel mix under ``ffn.``:
``key.mu (C,)``, ``key.linear.weight (F, C)``, ``value.weight (C, F)``, ``receptance.mu (C,)``,
``receptance.linear.weight (C, C)``.
"""
from __future__ import annotations

import numpy as np

from ...nn import fan_in_normal
from ..rwkv.checkpoint import BlocksCheckpoint, Names, blocks_checkpoint
from .config import Config

# fla's names (transformers' RWKV-4 layout's roles under other names)
NAMES = Names(root="model.", layers="layers", first_norm="pre_norm", norms=("attn_norm", "ffn_norm"), mixer="attn",
              ffn="ffn", final_norm="norm", head="lm_head")
# The five token-shift LoRA groups: their order in fla's ``x_bias`` rows and ``x_proj`` blocks, and
# in the official RWKV-LM checkpoint's ``time_maa_w1`` / ``time_maa_w2`` blocks.
MIX_GROUPS = "rwkvg"
OFFICIAL_MIX_GROUPS = "wkvrg"


def attn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``attn.``) -> shapes of an RWKV-6 time mix."""
    D, K, V, H = cfg.hidden_size, cfg.key_dim, cfg.value_dim, cfg.num_heads
    R, G = cfg.proj_low_rank_dim, cfg.gate_low_rank_dim
    return {"x_proj.0.mu": (D,), "x_proj.0.linear.weight": (5 * R, D), "x_proj.2.weight": (D, 5 * R),
            "x_bias": (5, D), "r_proj.linear.weight": (K, D), "k_proj.linear.weight": (K, D),
            "v_proj.linear.weight": (V, D), "g_proj.linear.weight": (V, D), "w_proj.linear.lora.0.weight": (G, D),
            "w_proj.linear.lora.2.weight": (K, G), "w_proj.linear.lora.2.bias": (K,), "bonus": (H, K // H),
            "g_norm.weight": (V,), "g_norm.bias": (V,), "o_proj.weight": (D, V)}


def ffn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``ffn.``) -> shapes of an RWKV-6 channel mix."""
    D, F = cfg.hidden_size, cfg.ffn_size
    return {"key.mu": (D,), "key.linear.weight": (F, D), "value.weight": (D, F), "receptance.mu": (D,),
            "receptance.linear.weight": (D, D)}


def rwkv_checkpoint(config_cls, attn_table, ffn_table, init_rule, standard_form=None) -> BlocksCheckpoint:
    """The checkpoint functions of an fla RWKV layout (``NAMES``) whose layer ``i`` holds
    ``attn_table(cfg, i)`` under ``attn.`` and ``ffn_table(cfg, i)`` under ``ffn.``:
    ``rwkv.checkpoint.blocks_checkpoint`` with fla's names."""
    return blocks_checkpoint(config_cls, attn_table, ffn_table, init_rule, config_cls.label, NAMES, standard_form)


def norm_init(name: str, shape: tuple, g: np.random.Generator):
    """Layer and group norms near the identity, embeddings of unit scale (None for other names)."""
    if name.endswith("embeddings.weight"):
        return g.standard_normal(shape)
    if "norm." in name:
        return (1.0 + 0.1 * g.standard_normal(shape)) if name.endswith("weight") else 0.1 * g.standard_normal(shape)
    return None


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Initial value of tensor ``name``: interpolation weights in (0, 1), decays spread over fast
    and slow channels (raw ``-6 ... 1``: per-step decays ``e^-e^raw`` from ~1 down to ~0.07),
    small bonus, fan-in scaled matrices."""
    base = norm_init(name, shape, g)
    if base is not None:
        return base
    if name.endswith((".mu", "x_bias")):
        return g.uniform(size=shape)
    if name.endswith("w_proj.linear.lora.2.bias"):
        return np.linspace(-6.0, 1.0, shape[0]) + 0.1 * g.standard_normal(shape)
    if name.endswith("bonus"):
        return 0.5 * g.standard_normal(shape)
    return fan_in_normal(shape, g)


CHECKPOINT = rwkv_checkpoint(Config, attn_shapes, ffn_shapes, init_rule)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["NAMES", "MIX_GROUPS", "OFFICIAL_MIX_GROUPS", "attn_shapes", "ffn_shapes", "rwkv_checkpoint", "norm_init",
           "init_rule", "CHECKPOINT", "expected_shapes", "params_from_tensors", "to_params", "from_params",
           "init_params"]
