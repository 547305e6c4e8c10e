"""Bamba NNX modules: the attention mixer, the decoder layer and the LM (the Mamba layers'
mixer is ``mamba2.Mamba2Mixer`` with ``Config.mixer_config``).

The classes read their pure functions from class attributes, so a hybrid with the same
parameter tree and other layer math (GraniteMoeHybrid) is a subclass that sets them."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from ...nn import LanguageModel, Mixer, Weights, check_block_input, check_tap, held
from ...nn.hooks import MID_POINTS
from ..mamba2 import Mamba2Mixer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .config import Config


def tap_shape(cfg: Config, kind: str, B: int, L: int) -> tuple[tuple, str]:
    """Shape of a ``kind`` mixer's operator output, and its axes for messages."""
    if kind == "mamba":
        return (B, cfg.mamba_channels, L), "(batch, channels, length)"
    if kind == "delta":  # Gated DeltaNet: value heads x value head width
        return (B, cfg.delta_channels, L), "(batch, channels, length)"
    if kind == "parallel":  # Mamba channels, then every attention head's value features
        return (B, cfg.mamba_channels + cfg.num_attention_heads * cfg.head_dim, L), "(batch, channels, length)"
    return (B, cfg.num_attention_heads, L, cfg.head_dim), "(batch, heads, length, head_dim)"


class AttentionMixer(Mixer):
    """Full causal GQA attention with partial RoPE (HF ``BambaAttention``); ``as_operator``
    gives the explicit attention operator (channels = heads; the variant is checked for a
    uniform interface and otherwise ignored)."""

    label = "Bamba"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))

    def as_operator(self, x, variant: str = "full"):
        """Attention operator for mixer input ``x (B, L, d_model)``."""
        x = self.check_input(x)
        self.check_variant(variant)
        return type(self).operator_fn(self.arrays(), x, cfg=self.cfg)


class BambaLayer(nnx.Module):
    """Decoder layer: ``input_layernorm``, ``mixer``, ``pre_ff_layernorm``, ``feed_forward``.

    Attributes:
      layer_forward_fn: jitted ``(params, h, cfg=, kind=, tap=) -> (h_next, mixer input)``.
      attention_class: the ``Mixer`` of the attention layers.
      mamba_class: the ``Mixer`` of the Mamba layers (built with ``cfg.mixer_config``).
      tap_shape_fn: ``(cfg, kind, B, L) -> (shape, axes)`` of a layer's operator output.
    """

    layer_forward_fn = staticmethod(layer_forward_jit)
    attention_class = AttentionMixer
    mamba_class = Mamba2Mixer
    tap_shape_fn = staticmethod(tap_shape)

    def __init__(self, cfg: Config, kind: str, layer: dict):
        self.cfg = cfg
        self.kind = kind
        self.input_layernorm = nnx.Param(jnp.asarray(layer["input_layernorm"]))
        self.pre_ff_layernorm = nnx.Param(jnp.asarray(layer["pre_ff_layernorm"]))
        self.mixer = self.make_mixer(cfg, kind, layer["mixer"])
        self.feed_forward = Weights(layer["feed_forward"])

    def make_mixer(self, cfg: Config, kind: str, params: dict):
        """The ``Mixer`` of a ``kind`` layer: ``mamba_class`` (with ``cfg.mixer_config``) or
        ``attention_class``."""
        return self.mamba_class(cfg.mixer_config, params) if kind == "mamba" else self.attention_class(cfg, params)

    def params(self) -> dict:
        return {"input_layernorm": held(self.input_layernorm), "pre_ff_layernorm": held(self.pre_ff_layernorm),
                "mixer": self.mixer.arrays(), "feed_forward": self.feed_forward.arrays()}

    def __call__(self, h, tap=None):
        """One decoder layer, as in the LM forward (the same pure ``layer_forward``).

        Args:
          h: ``(B, L, d_model)`` floating residual stream entering the layer.
          tap: optional array added to the mixer's operator output: ``(B, channels, L)``
            (Mamba) or ``(B, heads, L, head_dim)`` (attention).
        Returns:
          ``(B, L, d_model)`` residual stream leaving the layer.
        """
        h = check_block_input(h, self.cfg.hidden_size, "layer input")
        if tap is not None:
            shape, what = type(self).tap_shape_fn(self.cfg, self.kind, *h.shape[:2])
            tap = check_tap(tap, shape, what)
        return type(self).layer_forward_fn(self.params(), h, cfg=self.cfg, kind=self.kind, tap=tap)[0]


class LM(LanguageModel):
    """``BambaForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``. ``layer_class``: the decoder
    layer module."""

    family = "bamba"
    label = "Bamba"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    hook_points = MID_POINTS
    layer_class = BambaLayer

    def __init__(self, cfg: Config, params: dict):
        if len(params["layers"]) != cfg.num_hidden_layers:
            raise ValueError(f"params have {len(params['layers'])} layers, config says {cfg.num_hidden_layers}")
        self.config = cfg
        self.embed_tokens = nnx.Param(jnp.asarray(params["embed_tokens"]))
        self.layers = nnx.List([self.layer_class(cfg, k, l) for k, l in zip(cfg.layer_types, params["layers"])])
        self.final_layernorm = nnx.Param(jnp.asarray(params["final_layernorm"]))
        head = params.get("lm_head")
        self.lm_head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        return {"embed_tokens": held(self.embed_tokens), "layers": [l.params() for l in self.layers],
                "final_layernorm": held(self.final_layernorm),
                "lm_head": None if self.lm_head is None else held(self.lm_head)}

    def tap_shape(self, layer: int, B: int, L: int):
        return self.layer_class.tap_shape_fn(self.config, self.config.layer_types[layer], B, L)

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "d_model": c.hidden_size, "mamba_heads": c.mamba_n_heads,
                "mamba_head_dim": c.mamba_d_head, "state_size": c.mamba_d_state, "heads": c.num_attention_heads,
                "kv_heads": c.num_key_value_heads, "d_mlp": c.intermediate_size}


__all__ = ["AttentionMixer", "BambaLayer", "LM", "tap_shape"]
