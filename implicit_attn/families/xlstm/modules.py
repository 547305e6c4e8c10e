"""xLSTM NNX modules: the mLSTM layer (the token mixer, also ``block.mixer``), the feed-forward
part (RWKV-6's channel-mix module with xLSTM's function), the block and the LM."""
from __future__ import annotations

from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx

from ...nn import LanguageModel, Mixer, Weights, check_block_input, check_tap, held
from ...nn.hooks import MID_POINTS
from ..rwkv6.modules import ChannelMix
from .block import VARIANTS, block_forward_jit, ffn_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .config import Config


class MlstmLayer(Mixer):
    """transformers ``xLSTMLayer``: ``__call__(x)`` its forward (after ``out_proj``),
    ``as_operator(x, variant)`` its exact operator (channels = the value width). ``x`` is the
    ``norm_mlstm`` output ``(B, L, D)``."""

    label = "xLSTM"
    variants = VARIANTS
    input_name = "mLSTM input"
    forward_fn = staticmethod(mixer_forward_jit)
    operator_fn = staticmethod(mixer_operator_jit)


class FeedForward(ChannelMix):
    """transformers ``xLSTMFeedForward``: ``(B, L, D) -> (B, L, D)`` on the ``norm_ffn`` output."""

    forward_fn: ClassVar[Any] = staticmethod(ffn_forward_jit)


class Block(nnx.Module):
    """transformers ``xLSTMBlock``: ``h + mlstm_layer(norm_mlstm h)``, ``h + ffn(norm_ffn h)``."""

    def __init__(self, cfg: Config, layer: dict, index: int):
        self.cfg = cfg
        self.index = index
        self.norm_mlstm = Weights(layer["norm_mlstm"])
        self.norm_ffn = Weights(layer["norm_ffn"])
        self.mlstm_layer = MlstmLayer(cfg, layer["mlstm_layer"])
        self.ffn = FeedForward(cfg, layer["ffn"])

    @property
    def mixer(self):
        """The block's token mixer (its mLSTM layer)."""
        return self.mlstm_layer

    def params(self) -> dict:
        return {"pre_norm": None, "norm_mlstm": self.norm_mlstm.arrays(), "norm_ffn": self.norm_ffn.arrays(),
                "mlstm_layer": self.mlstm_layer.arrays(), "ffn": self.ffn.arrays()}

    def tap_shape(self, B: int, L: int) -> tuple:
        return (B, self.cfg.v_dim, L)

    def __call__(self, h, tap=None):
        """One block, as in the LM forward.

        Args:
          h: ``(B, L, D)`` floating residual stream entering the block.
          tap: optional ``(B, V, L)`` added to the mLSTM layer's operator output.
        Returns:
          ``(B, L, D)`` residual stream leaving the block.
        """
        h = check_block_input(h, self.cfg.hidden_size, "block input")
        if tap is not None:
            tap = check_tap(tap, self.tap_shape(h.shape[0], h.shape[1]))
        return block_forward_jit(self.params(), h, cfg=self.cfg, tap=tap)[0]


class LM(LanguageModel):
    """transformers ``xLSTMForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "xlstm"
    label = "xLSTM"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    hook_points = MID_POINTS

    def __init__(self, cfg: Config, params: dict):
        self.config = cfg
        self.embeddings = nnx.Param(jnp.asarray(params["embeddings"]))
        self.layers = nnx.List([Block(cfg, l, i) for i, l in enumerate(params["layers"])])
        self.out_norm = Weights(params["out_norm"])
        self.lm_head = nnx.Param(jnp.asarray(params["lm_head"]))

    def params(self) -> dict:
        return {"embeddings": held(self.embeddings), "layers": [l.params() for l in self.layers],
                "out_norm": self.out_norm.arrays(), "lm_head": held(self.lm_head)}

    def tap_shape(self, layer: int, B: int, L: int):
        return self.layers[layer].tap_shape(B, L), "(batch, channels, length)"

    def describe(self) -> dict:
        c = self.config
        return {"d_model": c.hidden_size, "heads": c.num_heads, "qk_dim": c.qk_dim, "v_dim": c.v_dim,
                "ffn_size": c.ffn_size, "chunk_size": c.chunk_size, "weight_mode": c.weight_mode}


__all__ = ["MlstmLayer", "FeedForward", "Block", "LM"]
