"""Kimi-Linear checkpoints: Bamba's layout builder (``bamba.checkpoint.layout_checkpoint``) under
the names HF writes: ``model.norm.weight``; per layer ``input_layernorm.weight``,
``post_attention_layernorm.weight``, the mixer under ``self_attn.`` (KDA: ``{q,k,v}_proj``,
``{q,k,v}_conv1d``, ``f_a_proj``, ``f_b_proj``, ``dt_bias (H d,)``, ``A_log (1, 1, H, 1)``,
``b_proj``, ``g_a_proj``, ``g_b_proj``, ``o_norm``, ``o_proj``; MLA: ``q_proj`` or
``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, ``o_proj``), and the feed-forward part: a SwiGLU MLP under ``mlp.`` (as in the
released files; transformers' writer puts it under ``block_sparse_moe.``, also read), or under
``block_sparse_moe.`` ``gate.weight``, ``gate.e_score_correction_bias``, experts one by one
(``experts.{e}.w1/w3/w2.weight``: gate, up, down; stacked in the params as
``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj (E, D, I)``) and ``shared_experts.*``.
"""
from __future__ import annotations

import numpy as np

from ...nn.checkpoint import StateDictNames
from ...nn.moe import split_experts, stack_experts
from ..bamba.checkpoint import Layout, layout_checkpoint
from ..bamba.checkpoint import init_rule as bamba_init_rule
from .block import CONVS
from .config import Config

FUSED = {"experts.gate_up_proj": ["w1.weight", "w3.weight"], "experts.down_proj": ["w2.weight"]}
# transformers' state_dict() names every feed-forward part ``mlp.`` (the MoE's, saved under
# ``block_sparse_moe.``), and its writer every one ``block_sparse_moe.`` (the dense MLP's too, which
# the released files keep under ``mlp.``); the forget gate's tensors sit under
# ``self_attn.forget_gate.``, the three convs are one
STATE_DICT_NAMES = StateDictNames(
    renamed=((r"\.self_attn\.forget_gate\.", ".self_attn."), (r"\.mlp\.", ".block_sparse_moe."),
             (r"\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$", r".mlp.\1")),
    stacked=FUSED, concatenated=(("self_attn.conv1d.weight", tuple("self_attn." + c for c in CONVS)),))


def swiglu_shapes(D: int, F: int, prefix: str = "") -> dict:
    return {prefix + "gate_proj.weight": (F, D), prefix + "up_proj.weight": (F, D), prefix + "down_proj.weight": (D, F)}


def kda_shapes(cfg: Config) -> dict:
    """Local names (under ``self_attn.``) -> shapes of a KDA mixer."""
    D, H, d, K = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    C = H * d
    m = {f"{n}_proj.weight": (C, D) for n in "qkv"}
    m.update({name: (C, 1, K) for name in CONVS})
    m.update({"f_a_proj.weight": (d, D), "f_b_proj.weight": (C, d), "dt_bias": (C,), "A_log": (1, 1, H, 1),
              "b_proj.weight": (H, D), "g_a_proj.weight": (d, D), "g_b_proj.weight": (C, d), "o_norm.weight": (d,),
              "o_proj.weight": (D, C)})
    return m


def mla_shapes(cfg: Config) -> dict:
    """Local names (under ``self_attn.``) -> shapes of an MLA attention mixer."""
    D, H, dv = cfg.hidden_size, cfg.num_attention_heads, cfg.v_head_dim
    r, dq = cfg.kv_lora_rank, cfg.qk_head_dim
    m = {"kv_a_proj_with_mqa.weight": (r + cfg.qk_rope_head_dim, D), "kv_a_layernorm.weight": (r,),
         "kv_b_proj.weight": (H * (cfg.qk_nope_head_dim + dv), r), "o_proj.weight": (D, H * dv)}
    if cfg.q_lora_rank is None:
        m["q_proj.weight"] = (H * dq, D)
    else:
        m.update({"q_a_proj.weight": (cfg.q_lora_rank, D), "q_a_layernorm.weight": (cfg.q_lora_rank,),
                  "q_b_proj.weight": (H * dq, cfg.q_lora_rank)})
    if cfg.attention_bias:
        m.update({"kv_a_proj_with_mqa.bias": (r + cfg.qk_rope_head_dim,), "o_proj.bias": (D,)})
        if cfg.q_lora_rank is not None:
            m["q_a_proj.bias"] = (cfg.q_lora_rank,)
    return m


def mixer_tables(cfg: Config, layout) -> dict:
    return {"delta": kda_shapes(cfg), "attention": mla_shapes(cfg)}


def ffn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``mlp.`` or ``block_sparse_moe.``) -> shapes of layer ``i``'s MLP or MoE as stored."""
    D, E = cfg.hidden_size, cfg.num_experts
    if cfg.mlp_layer_types[i] == "mlp":
        return swiglu_shapes(D, cfg.intermediate_size)
    I = cfg.moe_intermediate_size
    m = {"gate.weight": (E, D), "gate.e_score_correction_bias": (E,),
         **swiglu_shapes(D, I * cfg.num_shared_experts, "shared_experts.")}
    for e in range(E):
        m.update({f"experts.{e}.w1.weight": (I, D), f"experts.{e}.w3.weight": (I, D), f"experts.{e}.w2.weight": (D, I)})
    return m


LAYOUT = Layout(
    "kimi_linear", "model.norm.weight", "post_attention_layernorm.weight",
    lambda cfg, i: "mlp." if cfg.ffn_kinds[i] == "mlp" else "block_sparse_moe.", ffn_shapes,
    ffn_params=lambda cfg, i, t: stack_experts(t, cfg.num_experts, FUSED) if cfg.ffn_kinds[i] == "moe" else t,
    ffn_tensors=lambda cfg, i, p: split_experts(p, cfg.num_experts, FUSED) if cfg.ffn_kinds[i] == "moe" else p,
    mixer_prefix={"delta": "self_attn.", "attention": "self_attn."}, mixer_tables=mixer_tables)


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Bamba's rules; the KDA's decay rates and biases, the router's correction bias and the norm
    weights at HF-like scales."""
    if name.endswith("A_log"):
        return np.log(g.uniform(0.5, 8.0, shape))
    if name.endswith("dt_bias"):
        return g.uniform(-1.0, 1.0, shape)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * g.standard_normal(shape)
    if name.endswith(("o_norm.weight", "layernorm.weight")):
        return 1.0 + 0.1 * g.standard_normal(shape)
    return bamba_init_rule(name, shape, g)


CHECKPOINT = layout_checkpoint(Config, LAYOUT, init_rule)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["FUSED", "STATE_DICT_NAMES", "kda_shapes", "mla_shapes", "ffn_shapes", "LAYOUT", "init_rule", "CHECKPOINT", "expected_shapes",
           "params_from_tensors", "to_params", "from_params", "init_params"]
