"""GraniteMoeHybrid checkpoints: the shape table (HF names as saved on disk), HF tensors
<-> params, and ``init_params`` drawn from the same table.

HF layout: ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` (unless
tied); per layer ``model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight``, the
mixer (``mamba.*``, HF Mamba-2 names, or ``self_attn.{q,k,v,o}_proj.*``),
``shared_mlp.{input_linear,output_linear}.weight`` and, with experts,
``block_sparse_moe.{input_linear,output_linear,router.layer}.weight`` (experts fused:
``(E, 2I, D)`` and ``(E, D, I)``; what ``save_pretrained`` writes and hub checkpoints hold).
"""
from __future__ import annotations

from ...nn.checkpoint import StateDictNames
from ..bamba.checkpoint import Layout, layout_checkpoint
from .config import Config


def ffn_shapes(cfg: Config) -> dict:
    """Local tensor names -> shapes of one layer's shared MLP and MoE."""
    D, S, I, E = cfg.hidden_size, cfg.shared_intermediate_size, cfg.intermediate_size, cfg.num_local_experts
    m = {"shared_mlp.input_linear.weight": (2 * S, D), "shared_mlp.output_linear.weight": (D, S)}
    if E:
        m.update({"block_sparse_moe.input_linear.weight": (E, 2 * I, D),
                  "block_sparse_moe.output_linear.weight": (E, D, I),
                  "block_sparse_moe.router.layer.weight": (E, D)})
    return m


# transformers' state_dict() names the fused experts and the router as its MoE modules do
STATE_DICT_NAMES = StateDictNames(renamed=(
    (r"\.block_sparse_moe\.experts\.gate_up_proj$", ".block_sparse_moe.input_linear.weight"),
    (r"\.block_sparse_moe\.experts\.down_proj$", ".block_sparse_moe.output_linear.weight"),
    (r"\.block_sparse_moe\.router\.weight$", ".block_sparse_moe.router.layer.weight")))

LAYOUT = Layout("granitemoehybrid", "model.norm.weight", "post_attention_layernorm.weight", "",
                lambda cfg, i: ffn_shapes(cfg))


CHECKPOINT = layout_checkpoint(Config, LAYOUT)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params


__all__ = ["LAYOUT", "STATE_DICT_NAMES", "ffn_shapes", "CHECKPOINT", "expected_shapes", "params_from_tensors", "to_params", "from_params",
           "init_params"]
