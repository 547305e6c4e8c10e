"""Falcon-H1 checkpoints: the shape table (HF names), HF tensors <-> params, and
``init_params`` drawn from the same table.

HF layout (Bamba's, ``bamba.checkpoint.layout_shapes``): ``model.embed_tokens.weight``,
``model.final_layernorm.weight``, ``lm_head.weight`` (unless tied); per layer
``model.layers.{i}.{input_layernorm,pre_ff_layernorm}.weight``, both mixers,
``mamba.*`` (HF Mamba-2 names; ``norm.weight`` only with ``mamba_rms_norm``,
``out_proj.bias`` with ``projectors_bias``) and ``self_attn.{q,k,v,o}_proj.*``, and
``feed_forward.{gate,up,down}_proj.*``. HF's ``mup_vector`` is a buffer computed from the
config and is not stored. The layer's ``mixer`` params keep the ``mamba.`` / ``self_attn.``
prefixes.
"""
from __future__ import annotations

from ..bamba.checkpoint import Layout, layout_checkpoint, mlp_shapes
from .config import Config

LAYOUT = Layout("falcon_h1", "model.final_layernorm.weight", "pre_ff_layernorm.weight", "feed_forward.",
                lambda cfg, i: mlp_shapes(cfg))


CHECKPOINT = layout_checkpoint(Config, LAYOUT)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params


__all__ = ["LAYOUT", "CHECKPOINT", "expected_shapes", "params_from_tensors", "to_params", "from_params", "init_params"]
