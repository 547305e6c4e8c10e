"""LFM2 / LFM2-MoE / LFM3 checkpoints: Bamba's layout builder under the names HF writes:
``model.embed_tokens.weight``, ``model.embedding_norm.weight`` (the final norm), ``lm_head.weight``
(unless tied); per layer ``operator_norm.weight``, ``ffn_norm.weight`` (LFM3 with sandwich norms
also ``post_operator_norm.weight``, ``post_ffn_norm.weight``), the mixer under ``conv.``
(``in_proj (3D, D)``, ``conv.weight (D, 1, K)``, ``out_proj``; biases if ``conv_bias``) or
``self_attn.`` (``{q,k,v}_proj``; LFM2: ``q_layernorm``, ``k_layernorm``, ``out_proj``; LFM3:
``q_norm``, ``k_norm``, ``o_proj``, ``gate_proj (H, D)``, biases if ``attention_bias``), and
``feed_forward.``: ``w1``, ``w3``, ``w2`` (SwiGLU), or LFM2-MoE's ``gate.weight (E, D)``,
``expert_bias (E,)`` and experts one by one (``experts.{e}.w{1,2,3}.weight``; stacked in the params).
"""
from __future__ import annotations

import numpy as np

from ...nn.checkpoint import StateDictNames
from ...nn.moe import split_experts, stack_experts
from ..bamba.checkpoint import Layout, layout_checkpoint
from ..bamba.checkpoint import init_rule as bamba_init_rule
from .config import Config, Lfm3Config, MoeConfig

FUSED = {"experts.gate_up_proj": ["w1.weight", "w3.weight"], "experts.down_proj": ["w2.weight"]}
SANDWICH = {"post_mixer_norm": "post_operator_norm.weight", "post_ffn_norm": "post_ffn_norm.weight"}


def conv_shapes(cfg) -> dict:
    """Local names (under ``conv.``) -> shapes of a gated short conv."""
    D = cfg.hidden_size
    m = {"in_proj.weight": (3 * D, D), "conv.weight": (D, 1, cfg.conv_L_cache), "out_proj.weight": (D, D)}
    if cfg.conv_bias:
        m.update({"in_proj.bias": (3 * D,), "conv.bias": (D,), "out_proj.bias": (D,)})
    return m


def attention_shapes(cfg) -> dict:
    """Local names (under ``self_attn.``) -> shapes of an attention mixer."""
    D, H, KV, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    names = cfg.attention_names
    out = names["out"]
    m = {"q_proj.weight": (H * d, D), "k_proj.weight": (KV * d, D), "v_proj.weight": (KV * d, D),
         out + ".weight": (D, H * d), names["q_norm"]: (d,), names["k_norm"]: (d,)}
    if getattr(cfg, "use_attention_gate", False):
        m[names["gate"]] = (H, D)
    if getattr(cfg, "attention_bias", False):
        m.update({"q_proj.bias": (H * d,), "k_proj.bias": (KV * d,), "v_proj.bias": (KV * d,), out + ".bias": (D,)})
    return m


def mixer_tables(cfg, layout) -> dict:
    attention = attention_shapes(cfg)
    return {"conv": conv_shapes(cfg), "attention": attention, "sliding": attention}


def swiglu_shapes(D: int, F: int, prefix: str = "") -> dict:
    return {prefix + "w1.weight": (F, D), prefix + "w3.weight": (F, D), prefix + "w2.weight": (D, F)}


def ffn_shapes(cfg, i: int) -> dict:
    """Local names (under ``feed_forward.``) -> shapes of layer ``i``'s MLP or MoE as stored."""
    D = cfg.hidden_size
    if cfg.ffn_kinds[i] == "mlp":
        return swiglu_shapes(D, cfg.ff_size(i))
    m = {"gate.weight": (cfg.num_experts, D)}
    if cfg.use_expert_bias:
        m["expert_bias"] = (cfg.num_experts,)
    for e in range(cfg.num_experts):
        m.update(swiglu_shapes(D, cfg.moe_intermediate_size, f"experts.{e}."))
    return m


def stacked(cfg, i: int, t: dict) -> dict:
    return stack_experts(t, cfg.num_experts, FUSED) if cfg.ffn_kinds[i] == "moe" else t


def unstacked(cfg, i: int, p: dict) -> dict:
    return split_experts(p, cfg.num_experts, FUSED) if cfg.ffn_kinds[i] == "moe" else p


def layout(family: str, extra_norms=lambda cfg: {}) -> Layout:
    """The layout every LFM generation shares (``extra_norms``: LFM3's sandwich norms)."""
    return Layout(family, "model.embedding_norm.weight", "ffn_norm.weight", "feed_forward.", ffn_shapes,
                  ffn_params=stacked, ffn_tensors=unstacked, mixer_norm="operator_norm.weight",
                  mixer_prefix={"conv": "conv.", "attention": "self_attn.", "sliding": "self_attn."},
                  mixer_tables=mixer_tables, extra_norms=extra_norms)


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Bamba's rules; every norm weight near 1, the experts' router bias small."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1.0 + 0.1 * g.standard_normal(shape)
    if name.endswith("expert_bias"):
        return 0.1 * g.standard_normal(shape)
    return bamba_init_rule(name, shape, g)


# transformers' state_dict(): LFM2-MoE's experts stacked; LFM3's attention output gate named ``g_proj``
MOE_STATE_DICT_NAMES = StateDictNames(stacked=FUSED)
LFM3_STATE_DICT_NAMES = StateDictNames(renamed=((r"\.self_attn\.g_proj\.", ".self_attn.gate_proj."),))

LAYOUT = layout("lfm2")
MOE_LAYOUT = layout("lfm2_moe")
LFM3_LAYOUT = layout("lfm3", lambda cfg: SANDWICH if cfg.use_sandwich_norm else {})
CHECKPOINT = layout_checkpoint(Config, LAYOUT, init_rule)
MOE_CHECKPOINT = layout_checkpoint(MoeConfig, MOE_LAYOUT, init_rule)
LFM3_CHECKPOINT = layout_checkpoint(Lfm3Config, LFM3_LAYOUT, init_rule)

__all__ = ["FUSED", "SANDWICH", "conv_shapes", "attention_shapes", "mixer_tables", "swiglu_shapes", "ffn_shapes",
           "layout", "init_rule", "LAYOUT", "MOE_LAYOUT", "LFM3_LAYOUT", "CHECKPOINT", "MOE_CHECKPOINT",
           "LFM3_CHECKPOINT", "MOE_STATE_DICT_NAMES", "LFM3_STATE_DICT_NAMES"]
