"""Bailing-Hybrid checkpoints: Bamba's layout builder under the names HF writes:
``model.word_embeddings.weight``, ``model.norm.weight``; per layer ``input_layernorm.weight``,
``post_attention_layernorm.weight``, the mixer under ``attention.`` (KDA: ``{q,k,v}_proj``,
``{q,k,v}_conv1d``, ``f_proj``, ``dt_bias (H d,)``, ``A_log (H,)``, ``b_proj``, ``g_proj (H d,
D)``, ``o_norm``, ``dense``; MLA: ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, ``g_proj (H, D)``, ``dense``), and ``mlp.*``: a SwiGLU MLP, or ``gate.weight``,
``gate.expert_bias``, experts one by one (``experts.{e}.{gate,up,down}_proj.weight``; stacked in
the params) and ``shared_experts.*``.
"""
from __future__ import annotations

import dataclasses

from ...nn.checkpoint import StateDictNames
from ...nn.moe import split_experts, stack_experts
from ..bamba.checkpoint import layout_checkpoint
from ..kimi_linear.block import CONVS
from ..kimi_linear.checkpoint import LAYOUT as KIMI_LAYOUT
from ..kimi_linear.checkpoint import init_rule as kimi_init_rule
from ..kimi_linear.checkpoint import kda_shapes as kimi_kda_shapes
from ..kimi_linear.checkpoint import mla_shapes as kimi_mla_shapes
from ..kimi_linear.checkpoint import swiglu_shapes
from .config import Config

FUSED = {"experts.gate_up_proj": ["gate_proj.weight", "up_proj.weight"], "experts.down_proj": ["down_proj.weight"]}
# transformers' state_dict(): Kimi's module names (``embed_tokens``, ``self_attn``, ``o_proj``, the
# forget gate's own module, ``e_score_correction_bias``), the three convs as one, the experts stacked
STATE_DICT_NAMES = StateDictNames(
    renamed=((r"^model\.embed_tokens\.", "model.word_embeddings."), (r"\.self_attn\.forget_gate\.", ".self_attn."),
             (r"\.self_attn\.o_proj\.", ".self_attn.dense."), (r"\.self_attn\.", ".attention."),
             (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.expert_bias")),
    stacked=FUSED, concatenated=(("attention.conv1d.weight", tuple("attention." + c for c in CONVS)),))


def kda_shapes(cfg: Config) -> dict:
    """Local names (under ``attention.``) -> shapes of a KDA mixer."""
    D, H, d = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    m = {k: s for k, s in kimi_kda_shapes(cfg).items()
         if k not in ("f_a_proj.weight", "f_b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_proj.weight")}
    m.update({"f_proj.weight": (H * d, D), "g_proj.weight": (H * d, D), "A_log": (H,), "dense.weight": (D, H * d)})
    return m


def mla_shapes(cfg: Config) -> dict:
    """Local names (under ``attention.``) -> shapes of an MLA mixer with its per-head gate."""
    m = {("dense" + k[len("o_proj"):] if k.startswith("o_proj") else k): s for k, s in kimi_mla_shapes(cfg).items()}
    m["g_proj.weight"] = (cfg.num_attention_heads, cfg.hidden_size)
    return m


def ffn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``mlp.``) -> shapes of layer ``i``'s MLP or MoE as stored."""
    D, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if cfg.mlp_layer_types[i] == "mlp":
        return swiglu_shapes(D, cfg.intermediate_size)
    m = {"gate.weight": (E, D), "gate.expert_bias": (E,),
         **swiglu_shapes(D, I * cfg.num_shared_experts, "shared_experts.")}
    for e in range(E):
        m.update(swiglu_shapes(D, I, f"experts.{e}."))
    return m


LAYOUT = dataclasses.replace(
    KIMI_LAYOUT, family="bailing_hybrid", ffn_prefix="mlp.", ffn_shapes=ffn_shapes,
    embed="model.word_embeddings.weight",
    ffn_params=lambda cfg, i, t: stack_experts(t, cfg.num_experts, FUSED) if cfg.ffn_kinds[i] == "moe" else t,
    ffn_tensors=lambda cfg, i, p: split_experts(p, cfg.num_experts, FUSED) if cfg.ffn_kinds[i] == "moe" else p,
    mixer_prefix={"delta": "attention.", "attention": "attention."},
    mixer_tables=lambda cfg, layout: {"delta": kda_shapes(cfg), "attention": mla_shapes(cfg)})


def init_rule(name, shape, g):
    """Kimi-Linear's rules; the router's bias as Kimi's correction bias."""
    return kimi_init_rule(name.replace("gate.expert_bias", "gate.e_score_correction_bias"), shape, g)


CHECKPOINT = layout_checkpoint(Config, LAYOUT, init_rule)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["FUSED", "STATE_DICT_NAMES", "kda_shapes", "mla_shapes", "ffn_shapes", "LAYOUT", "init_rule", "CHECKPOINT", "expected_shapes",
           "params_from_tensors", "to_params", "from_params", "init_params"]
