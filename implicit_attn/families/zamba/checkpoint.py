"""Zamba checkpoints: Zamba2's layout (``zamba2.checkpoint.layout_checkpoint``) under Zamba's
names: the shared block at ``model.layers.{i}.shared_transf.*`` (``input_layernorm.weight
(2D,)``, ``pre_ff_layernorm.weight``, ``self_attn.{q,k,v,o}_proj.weight``,
``feed_forward.{gate,up,down}_proj.weight``; stored under the first hybrid layer, the others'
tied copies optional and checked), no adapters, and the multi-head Mamba mixer's tensors
``in_proj.weight (2I, D)`` (x and z rows interleaved), ``conv1d.*``, ``x_proj_weight (H,
R + 2N, P)``, ``dt_proj_weight (H, P, R)``, ``dt_proj_bias (H, P)``, ``A_log (H, P, N)``,
``D (H, P)``, ``out_proj.*``.
"""
from __future__ import annotations

from ..bamba.checkpoint import attention_shapes
from ..zamba2.checkpoint import Layout, layout_checkpoint
from .config import Config, MixerConfig


def mamba_shapes(cfg: MixerConfig) -> dict:
    """Local names -> shapes of HF ``ZambaMambaMixer``."""
    D, I, H, P = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
    N, R, K = cfg.state_size, cfg.time_step_rank, cfg.conv_kernel
    m = {"in_proj.weight": (2 * I, D), "conv1d.weight": (I, 1, K), "x_proj_weight": (H, R + 2 * N, P),
         "dt_proj_weight": (H, P, R), "dt_proj_bias": (H, P), "A_log": (H, P, N), "D": (H, P),
         "out_proj.weight": (D, I)}
    if cfg.use_conv_bias:
        m["conv1d.bias"] = (I,)
    if cfg.use_bias:
        m.update({"in_proj.bias": (2 * I,), "out_proj.bias": (D,)})
    return m


def block_shapes(cfg: Config) -> dict:
    """Local names (under ``shared_transf.``) -> shapes of the shared block."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"input_layernorm.weight": (2 * D,), "pre_ff_layernorm.weight": (D,),
            **{"self_attn." + k: s for k, s in attention_shapes(cfg).items()},
            "feed_forward.gate_proj.weight": (F, D), "feed_forward.up_proj.weight": (F, D),
            "feed_forward.down_proj.weight": (D, F)}


def no_adapters(cfg: Config, j: int) -> dict:
    """Zamba has no adapters."""
    return {}


LAYOUT = Layout("zamba", "shared_transf.", block_shapes, no_adapters, no_adapters, no_adapters, mamba_shapes)
CHECKPOINT = layout_checkpoint(Config, LAYOUT)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params

__all__ = ["mamba_shapes", "block_shapes", "LAYOUT", "CHECKPOINT", "expected_shapes", "params_from_tensors",
           "to_params", "from_params", "init_params"]
