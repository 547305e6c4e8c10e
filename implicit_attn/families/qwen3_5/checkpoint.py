"""Qwen3.5 checkpoints: Qwen3-Next's layout (``qwen3_next.checkpoint``) with the DeltaNet's four
plain projections (``in_proj_qkv.weight (2 H_k d_k + H_v d_v, D)``, ``in_proj_z.weight (H_v d_v,
D)``, ``in_proj_b.weight``, ``in_proj_a.weight (H_v, D)``; ``delta_shapes`` reads
``Config.projections``), a SwiGLU ``mlp.*`` per layer (``qwen3_5_text``) or the MoE with
experts stored one by one (``qwen3_5_moe_text``)."""
from __future__ import annotations

import dataclasses

from ..bamba.checkpoint import layout_checkpoint
from ..qwen3_next.checkpoint import LAYOUT, init_rule
from .config import Config, MoeConfig

TEXT = layout_checkpoint(Config, dataclasses.replace(LAYOUT, family=Config.model_type), init_rule)
MOE = layout_checkpoint(MoeConfig, dataclasses.replace(LAYOUT, family=MoeConfig.model_type), init_rule)

__all__ = ["TEXT", "MOE"]
