"""Jamba checkpoints: the shape table (HF names as saved on disk), HF tensors <-> params, and
``init_params`` drawn from the same table.

HF layout (Bamba's, ``bamba.checkpoint.layout_shapes``): ``model.embed_tokens.weight``,
``model.final_layernorm.weight``, ``lm_head.weight`` (unless tied); per layer
``model.layers.{i}.{input_layernorm,pre_ff_layernorm}.weight``, the mixer (``mamba.*``, HF
Mamba names plus ``{dt,b,c}_layernorm.weight``, or ``self_attn.{q,k,v,o}_proj.weight``) and
``feed_forward.*``: ``{gate,up,down}_proj.weight`` (MLP) or ``router.weight`` and
``experts.{e}.{gate,up,down}_proj.weight`` per expert (MoE). In the params the experts are
stacked as HF holds them in memory: ``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj
(E, D, I)``.
"""
from __future__ import annotations

from ...nn.checkpoint import StateDictNames
from ...nn.moe import split_experts, stack_experts
from ..bamba.checkpoint import Layout, layout_checkpoint, mlp_shapes
from ..mamba.checkpoint import mixer_shapes as mamba_shapes
from .config import Config


def ffn_shapes(cfg: Config, layer: int) -> dict:
    """Local tensor names -> shapes of layer ``layer``'s feed-forward part as stored."""
    if not cfg.is_moe(layer):
        return mlp_shapes(cfg)
    D, F = cfg.hidden_size, cfg.intermediate_size
    m = {"router.weight": (cfg.num_experts, D)}
    for e in range(cfg.num_experts):
        m.update({f"experts.{e}.gate_proj.weight": (F, D), f"experts.{e}.up_proj.weight": (F, D),
                  f"experts.{e}.down_proj.weight": (D, F)})
    return m


# The per-expert tensors stacked as HF holds them in memory.
FUSED = {"experts.gate_up_proj": ["gate_proj.weight", "up_proj.weight"], "experts.down_proj": ["down_proj.weight"]}
# transformers' state_dict() holds the experts stacked as in the params
STATE_DICT_NAMES = StateDictNames(stacked=FUSED)


def stacked_ffn(cfg: Config, layer: int, t: dict) -> dict:
    """Layer ``layer``'s feed-forward tensors as stored -> params (experts stacked)."""
    return stack_experts(t, cfg.num_experts, FUSED) if cfg.is_moe(layer) else t


def stored_ffn(cfg: Config, layer: int, p: dict) -> dict:
    """The inverse of ``stacked_ffn``."""
    return split_experts(p, cfg.num_experts, FUSED) if cfg.is_moe(layer) else p


LAYOUT = Layout("jamba", "model.final_layernorm.weight", "pre_ff_layernorm.weight", "feed_forward.", ffn_shapes,
                mamba_shapes, stacked_ffn, stored_ffn)


CHECKPOINT = layout_checkpoint(Config, LAYOUT)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params


__all__ = ["LAYOUT", "FUSED", "STATE_DICT_NAMES", "ffn_shapes", "stacked_ffn", "stored_ffn", "CHECKPOINT", "expected_shapes",
           "params_from_tensors", "to_params", "from_params", "init_params"]
