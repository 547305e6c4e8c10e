"""Qwen3-Next checkpoints: Bamba's layout (``bamba.checkpoint.layout_checkpoint``) under
Qwen3-Next's names: ``model.norm.weight``; per layer ``input_layernorm.weight``,
``post_attention_layernorm.weight``, ``linear_attn.*`` (``in_proj_qkvz.weight``,
``in_proj_ba.weight``, ``conv1d.weight``, ``dt_bias``, ``A_log``, ``norm.weight``,
``out_proj.weight``) or ``self_attn.*`` (``q_proj`` of twice the heads' width: query and output
gate, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``), and ``mlp.*``: a SwiGLU MLP, or
``gate.weight``, experts stored one by one (``experts.{e}.{gate,up,down}_proj.weight``; stacked
in the params as ``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj (E, D, I)``), the
``shared_expert.*`` MLP and ``shared_expert_gate.weight (1, D)``.
"""
from __future__ import annotations

import numpy as np

from ...nn.checkpoint import StateDictNames
from ...nn.moe import split_experts, stack_experts
from ..bamba.checkpoint import Layout, layout_checkpoint
from ..bamba.checkpoint import init_rule as bamba_init_rule
from .config import Config

FUSED = {"experts.gate_up_proj": ["gate_proj.weight", "up_proj.weight"], "experts.down_proj": ["down_proj.weight"]}
# transformers' state_dict() holds the experts stacked as in the params
STATE_DICT_NAMES = StateDictNames(stacked=FUSED)


def swiglu_shapes(D: int, F: int, prefix: str = "") -> dict:
    return {prefix + "gate_proj.weight": (F, D), prefix + "up_proj.weight": (F, D), prefix + "down_proj.weight": (D, F)}


def delta_shapes(cfg: Config) -> dict:
    """Local names (under ``linear_attn.``) -> shapes of a Gated DeltaNet mixer."""
    D, Hv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    conv = 2 * cfg.key_dim + cfg.value_dim
    if cfg.projections == "split":
        proj = {"in_proj_qkv.weight": (2 * cfg.key_dim + cfg.value_dim, D), "in_proj_z.weight": (cfg.value_dim, D),
                "in_proj_b.weight": (Hv, D), "in_proj_a.weight": (Hv, D)}
    else:
        proj = {"in_proj_qkvz.weight": (2 * cfg.key_dim + 2 * cfg.value_dim, D), "in_proj_ba.weight": (2 * Hv, D)}
    return {**proj, "conv1d.weight": (conv, 1, cfg.linear_conv_kernel_dim), "dt_bias": (Hv,), "A_log": (Hv,),
            "norm.weight": (dv,), "out_proj.weight": (D, cfg.value_dim)}


def attention_shapes(cfg: Config) -> dict:
    """Local names (under ``self_attn.``) -> shapes of a gated attention mixer."""
    D, H, KV, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    m = {"q_proj.weight": (2 * H * d, D), "k_proj.weight": (KV * d, D), "v_proj.weight": (KV * d, D),
         "o_proj.weight": (D, H * d), "q_norm.weight": (d,), "k_norm.weight": (d,)}
    if cfg.attention_bias:
        m.update({"q_proj.bias": (2 * H * d,), "k_proj.bias": (KV * d,), "v_proj.bias": (KV * d,), "o_proj.bias": (D,)})
    return m


def mixer_tables(cfg: Config, layout) -> dict:
    return {"delta": delta_shapes(cfg), "attention": attention_shapes(cfg)}


def ffn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``mlp.``) -> shapes of layer ``i``'s MLP or MoE as stored."""
    D = cfg.hidden_size
    if cfg.ffn_kinds[i] == "mlp":
        return swiglu_shapes(D, cfg.intermediate_size)
    m = {"gate.weight": (cfg.num_experts, D), "shared_expert_gate.weight": (1, D),
         **swiglu_shapes(D, cfg.shared_expert_intermediate_size, "shared_expert.")}
    for e in range(cfg.num_experts):
        m.update(swiglu_shapes(D, cfg.moe_intermediate_size, f"experts.{e}."))
    return m


LAYOUT = Layout(
    "qwen3_next", "model.norm.weight", "post_attention_layernorm.weight", "mlp.", ffn_shapes,
    ffn_params=lambda cfg, i, t: stack_experts(t, cfg.num_experts, FUSED) if cfg.ffn_kinds[i] == "moe" else t,
    ffn_tensors=lambda cfg, i, p: split_experts(p, cfg.num_experts, FUSED) if cfg.ffn_kinds[i] == "moe" else p,
    mixer_prefix={"delta": "linear_attn.", "attention": "self_attn."}, mixer_tables=mixer_tables)


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Bamba's rules; zero-centred norm weights near 0 (HF starts them at 0: the norm's scale is
    ``1 + w``), the conv, gate and DeltaNet tensors at HF-like scales."""
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
        return 0.1 * g.standard_normal(shape)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * g.standard_normal(shape)
    if name.endswith("A_log"):
        return np.log(g.uniform(0.5, 8.0, shape))
    if name.endswith("dt_bias"):
        return g.uniform(-1.0, 1.0, shape)
    return bamba_init_rule(name, shape, g)


CHECKPOINT = layout_checkpoint(Config, LAYOUT, init_rule)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["FUSED", "STATE_DICT_NAMES", "delta_shapes", "attention_shapes", "ffn_shapes", "LAYOUT", "init_rule", "CHECKPOINT",
           "expected_shapes", "params_from_tensors", "to_params", "from_params", "init_params"]
