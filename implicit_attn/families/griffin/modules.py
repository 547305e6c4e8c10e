"""RecurrentGemma NNX modules: the recurrent and local-attention temporal blocks, the
residual layer and the LM. Every layer's temporal block is also ``layer.mixer``."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...nn import LanguageModel, Mixer, Weights, check_block_input, check_tap, held
from ...nn.hooks import MID_POINTS
from .block import (VARIANTS, attention_forward_jit, attention_operator_jit, check_segment_pos,
                    layer_forward_jit, lm_forward_jit, recurrent_forward_jit, recurrent_operator_jit)
from .config import Config


def tap_shape(cfg: Config, kind: str, B: int, L: int) -> tuple[tuple, str]:
    """Shape of a ``kind`` block's operator output, and its axes for messages."""
    if kind == "recurrent":
        return (B, cfg.lru_width, L), "(batch, lru_width, length)"
    return (B, cfg.num_attention_heads, L, cfg.head_dim), "(batch, heads, length, head_dim)"


class TemporalBlock(Mixer):
    """A temporal block taking document positions: ``__call__(h, segment_pos)``,
    ``as_operator(x, variant, segment_pos)``."""

    label = "Griffin"
    variants = VARIANTS
    input_name = "temporal block input"

    def __call__(self, h, segment_pos=None):
        """``(B, L, d_model) -> (B, L, d_model)``."""
        h = self.check_input(h)
        pos = check_segment_pos(segment_pos, h.shape[:2])
        return type(self).forward_fn(self.arrays(), h, pos, cfg=self.cfg)


class RecurrentBlock(TemporalBlock):
    """NNX recurrent block: ``__call__(h, segment_pos)`` is HF ``RecurrentGemmaRecurrentBlock``;
    ``as_operator(x, variant, segment_pos)`` its operator (channels = lru_width)."""

    kind = "recurrent"
    forward_fn = staticmethod(recurrent_forward_jit)

    def as_operator(self, x, variant: str = "full", segment_pos=None):
        """Implicit operator for block input ``x (B, L, d_model)`` (see ``block.recurrent_operator``)."""
        x = self.check_input(x)
        self.check_variant(variant)
        pos = check_segment_pos(segment_pos, x.shape[:2])
        return recurrent_operator_jit(self.arrays(), x, pos, cfg=self.cfg, variant=variant,
                                      documents=segment_pos is not None)


class AttentionBlock(TemporalBlock):
    """NNX local attention block: ``__call__(h, segment_pos)`` is HF ``RecurrentGemmaAttention``;
    ``as_operator(x, variant, segment_pos)`` the explicit attention operator (channels = heads;
    the variant is checked for a uniform interface and otherwise ignored: attention has no
    ablations)."""

    kind = "attention"
    forward_fn = staticmethod(attention_forward_jit)

    def as_operator(self, x, variant: str = "full", segment_pos=None):
        """Attention operator for block input ``x (B, L, d_model)``."""
        x = self.check_input(x)
        self.check_variant(variant)
        pos = check_segment_pos(segment_pos, x.shape[:2])
        return attention_operator_jit(self.arrays(), x, pos, cfg=self.cfg)


class GriffinLayer(nnx.Module):
    """Residual layer: ``temporal_pre_norm``, ``temporal_block``, ``channel_pre_norm``, ``mlp_block``."""

    def __init__(self, cfg: Config, kind: str, layer: dict):
        self.cfg = cfg
        self.kind = kind
        self.temporal_pre_norm = nnx.Param(jnp.asarray(layer["temporal_pre_norm"]))
        self.channel_pre_norm = nnx.Param(jnp.asarray(layer["channel_pre_norm"]))
        block = RecurrentBlock if kind == "recurrent" else AttentionBlock
        self.temporal_block = block(cfg, layer["temporal_block"])
        self.mlp_block = Weights(layer["mlp_block"])

    @property
    def mixer(self) -> TemporalBlock:
        """The layer's token mixer (its temporal block)."""
        return self.temporal_block

    def params(self) -> dict:
        return {"temporal_pre_norm": held(self.temporal_pre_norm), "channel_pre_norm": held(self.channel_pre_norm),
                "temporal_block": self.temporal_block.arrays(), "mlp_block": self.mlp_block.arrays()}

    def __call__(self, h, segment_pos=None, tap=None):
        """One residual layer, as in the LM forward (the same pure ``layer_forward``).

        Args:
          h: ``(B, L, d_model)`` floating residual stream entering the layer.
          segment_pos: None or ``(B, L)`` document positions (see ``check_segment_pos``).
          tap: optional array added to the temporal block's operator output:
            ``(B, lru_width, L)`` (recurrent) or ``(B, heads, L, head_dim)`` (attention).
        Returns:
          ``(B, L, d_model)`` residual stream leaving the layer.
        """
        h = check_block_input(h, self.cfg.hidden_size, "layer input")
        B, L, _ = h.shape
        pos = check_segment_pos(segment_pos, (B, L))
        if tap is not None:
            shape, what = tap_shape(self.cfg, self.kind, B, L)
            tap = check_tap(tap, shape, what)
        return layer_forward_jit(self.params(), h, pos, cfg=self.cfg, kind=self.kind, tap=tap)[0]


class LM(LanguageModel):
    """``RecurrentGemmaForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``. Takes ``segment_pos``
    (packed documents) everywhere the base LM takes ids."""

    family = "recurrent_gemma"
    label = "Griffin"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    takes_segment_pos = True
    hook_points = MID_POINTS

    def __init__(self, cfg: Config, params: dict):
        if len(params["layers"]) != cfg.num_hidden_layers:
            raise ValueError(f"params have {len(params['layers'])} layers, config says {cfg.num_hidden_layers}")
        self.config = cfg
        self.embed_tokens = nnx.Param(jnp.asarray(params["embed_tokens"]))
        self.layers = nnx.List([GriffinLayer(cfg, k, l) for k, l in zip(cfg.layer_types, params["layers"])])
        self.final_norm = nnx.Param(jnp.asarray(params["final_norm"]))
        head = params.get("lm_head")
        self.lm_head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        return {"embed_tokens": held(self.embed_tokens), "layers": [l.params() for l in self.layers],
                "final_norm": held(self.final_norm),
                "lm_head": None if self.lm_head is None else held(self.lm_head)}

    def extra_inputs(self, ids, segment_pos) -> tuple:
        return (check_segment_pos(segment_pos, ids.shape),)

    def tap_shape(self, layer: int, B: int, L: int):
        return tap_shape(self.config, self.config.layer_types[layer], B, L)

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "d_model": c.hidden_size, "lru_width": c.lru_width,
                "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                "attention_window": c.attention_window_size, "conv_width": c.conv1d_width}


__all__ = ["RecurrentBlock", "AttentionBlock", "GriffinLayer", "LM", "tap_shape"]
