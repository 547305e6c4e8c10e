"""Zamba2 NNX modules: the shared blocks, the shared-attention mixer (a view of a shared
block's attention with one hybrid layer's adapters), our two layer kinds and the LM."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from ...nn import LanguageModel, Mixer, Weights, check_block_input, check_tap, held
from ...nn.hooks import RESIDUAL_POINTS, parse_name
from ..bamba.modules import tap_shape
from ..mamba2 import Mamba2Mixer
from .block import (VARIANTS, attention_params, lm_forward_jit, mamba_layer_forward_jit, mixer_forward_jit,
                    mixer_operator_jit, shared_layer_forward_jit)
from .config import Config


def check_layer_call(cfg: Config, kind: str, h, extra, extra_name: str, tap):
    """The checked inputs of a layer call: ``h (B, L, d_model)``, ``extra`` (None or ``h``'s
    shape, named ``extra_name``) and ``tap`` (None or the layer's operator-output shape)."""
    h = check_block_input(h, cfg.hidden_size, "layer input")
    if extra is not None:
        extra = check_block_input(extra, cfg.hidden_size, extra_name)
        if extra.shape != h.shape:
            raise ValueError(f"{extra_name} must have the layer input's shape {h.shape}, got {extra.shape}")
    if tap is not None:
        shape, what = tap_shape(cfg, kind, *h.shape[:2])
        tap = check_tap(tap, shape, what)
    return h, extra, tap


class SharedBlock(nnx.Module):
    """One of the ``num_mem_blocks`` shared transformer blocks: ``input_layernorm (2D,)``,
    ``pre_ff_layernorm (D,)``, ``self_attn`` (q/k/v/o) and ``feed_forward`` (gate_up/down)."""

    def __init__(self, block: dict):
        self.input_layernorm = nnx.Param(jnp.asarray(block["input_layernorm"]))
        self.pre_ff_layernorm = nnx.Param(jnp.asarray(block["pre_ff_layernorm"]))
        self.self_attn = Weights(block["self_attn"])
        self.feed_forward = Weights(block["feed_forward"])

    def params(self) -> dict:
        return {"input_layernorm": held(self.input_layernorm), "pre_ff_layernorm": held(self.pre_ff_layernorm),
                "self_attn": self.self_attn.arrays(), "feed_forward": self.feed_forward.arrays()}


class AttentionMixer(Mixer):
    """The shared attention as one hybrid layer runs it: full causal GQA softmax attention on
    ``x (B, L, 2 d_model)`` (the normed ``[h, embeddings]``), RoPE with ``use_mem_rope``, logits
    scaled by ``(head_dim / 2) ** -0.5``, q/k/v with this layer's adapters. Holds the adapters
    and the shared block it reads (``arrays()`` merges them); ``as_operator`` gives the
    explicit attention operator (channels = heads)."""

    label = "Zamba2"
    variants = VARIANTS
    input_name = "shared attention input"
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))

    def __init__(self, cfg: Config, block: SharedBlock, adapters: dict):
        super().__init__(cfg, adapters)
        self.block = block

    def adapters(self) -> dict:
        """This layer's own tensors: ``{q,k,v}_proj.lora_{a,b}`` (empty without adapters)."""
        return super().arrays()

    def arrays(self) -> dict:
        return attention_params({"self_attn": self.block.self_attn.arrays()}, {"attention_adapters": self.adapters()})

    def check_input(self, x):
        """``x (B, L, 2 d_model)`` validated (see ``check_block_input``)."""
        return check_block_input(x, self.cfg.attention_input_size, self.input_name)

    def as_operator(self, x, variant: str = "full"):
        """Attention operator for the shared attention's input ``x (B, L, 2 d_model)``."""
        x = self.check_input(x)
        self.check_variant(variant)
        return type(self).operator_fn(self.arrays(), x, cfg=self.cfg)


class SharedAttentionLayer(nnx.Module):
    """Our layer for the first half of an HF hybrid layer: ``mixer`` (the shared attention),
    ``block`` (the shared block, held by the LM too), ``mlp_adapters`` and ``linear (D, D)``.

    Attributes:
      layer_forward_fn: jitted ``(block, layer, h, emb, cfg=, tap=) -> (t, x)``.
      mixer_class: the attention ``Mixer``.
    """

    kind = "attention"
    layer_forward_fn = staticmethod(shared_layer_forward_jit)
    mixer_class = AttentionMixer

    def __init__(self, cfg: Config, block: SharedBlock, layer: dict):
        self.cfg = cfg
        self.block = block
        self.mixer = self.mixer_class(cfg, block, layer["attention_adapters"])
        self.mlp_adapters = Weights(layer["mlp_adapters"])
        self.linear = nnx.Param(jnp.asarray(layer["linear"]))

    def params(self) -> dict:
        return {"attention_adapters": self.mixer.adapters(), "mlp_adapters": self.mlp_adapters.arrays(),
                "linear": held(self.linear)}

    def __call__(self, h, embeddings, tap=None):
        """The hybrid layer's shared-block output, which HF adds to its Mamba mixer's input.

        Args:
          h: ``(B, L, d_model)`` residual stream entering the layer (it leaves unchanged).
          embeddings: ``(B, L, d_model)`` token embeddings.
          tap: optional ``(B, heads, L, head_dim)`` added to the attention's per-head output.
        Returns:
          ``t (B, L, d_model)``: ``linear(mlp(rms_norm(attention(rms_norm([h, embeddings])))))``.
        """
        if embeddings is None:
            raise ValueError("embeddings (B, L, d_model) are required: the shared block reads them")
        h, embeddings, tap = check_layer_call(self.cfg, self.kind, h, embeddings, "embeddings", tap)
        return type(self).layer_forward_fn(self.block.params(), self.params(), h, embeddings, cfg=self.cfg,
                                           tap=tap)[0]


class MambaLayer(nnx.Module):
    """A Mamba layer: ``input_layernorm`` and ``mixer`` (``mixer_class`` with
    ``Config.mixer_config``: ``mamba2.Mamba2Mixer``).

    Attributes:
      layer_forward_fn: jitted ``(layer, h, shared, cfg=, tap=) -> (h_next, x)``.
      mixer_class: the Mamba ``Mixer``.
    """

    kind = "mamba"
    layer_forward_fn = staticmethod(mamba_layer_forward_jit)
    mixer_class = Mamba2Mixer

    def __init__(self, cfg: Config, layer: dict):
        self.cfg = cfg
        self.input_layernorm = nnx.Param(jnp.asarray(layer["input_layernorm"]))
        self.mixer = self.mixer_class(cfg.mixer_config, layer["mixer"])

    def params(self) -> dict:
        return {"input_layernorm": held(self.input_layernorm), "mixer": self.mixer.arrays()}

    def __call__(self, h, shared=None, tap=None):
        """One Mamba layer, as in the LM forward: ``h + mamba(rms_norm(h + shared))``.

        Args:
          h: ``(B, L, d_model)`` residual stream entering the layer.
          shared: optional ``(B, L, d_model)``, the shared block's output of the hybrid layer
            this Mamba layer belongs to (``SharedAttentionLayer.__call__``).
          tap: optional ``(B, channels, L)`` added to the mixer's operator output.
        Returns:
          ``(B, L, d_model)`` residual stream leaving the layer.
        """
        h, shared, tap = check_layer_call(self.cfg, self.kind, h, shared, "shared", tap)
        return type(self).layer_forward_fn(self.params(), h, shared, cfg=self.cfg, tap=tap)[0]


class LM(LanguageModel):
    """``Zamba2ForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``. ``layers`` are the token mixers in
    the order they run (``config.layer_types``; HF layer of each: ``config.hf_layers``): a
    ``MambaLayer`` per HF Mamba layer, a ``SharedAttentionLayer`` and a ``MambaLayer`` per
    hybrid layer. ``shared_blocks`` holds the shared blocks the attention layers read.
    ``shared_layer_class`` / ``mamba_layer_class``: the two layer modules."""

    family = "zamba2"
    label = "Zamba2"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    hook_points = RESIDUAL_POINTS
    shared_layer_class = SharedAttentionLayer
    mamba_layer_class = MambaLayer

    def __init__(self, cfg: Config, params: dict):
        if len(params["layers"]) != len(cfg.layer_types):
            raise ValueError(f"params have {len(params['layers'])} layers, the config's layer_types "
                             f"{len(cfg.layer_types)}")
        if len(params["shared_blocks"]) != cfg.num_shared_blocks:
            raise ValueError(f"params have {len(params['shared_blocks'])} shared blocks, the config "
                             f"{cfg.num_shared_blocks}")
        self.config = cfg
        self.embed_tokens = nnx.Param(jnp.asarray(params["embed_tokens"]))
        self.shared_blocks = nnx.List([SharedBlock(b) for b in params["shared_blocks"]])
        self.layers = nnx.List([
            self.mamba_layer_class(cfg, layer) if kind == "mamba"
            else self.shared_layer_class(cfg, self.shared_blocks[b], layer)
            for kind, b, layer in zip(cfg.layer_types, cfg.shared_block_index, params["layers"])])
        self.final_layernorm = nnx.Param(jnp.asarray(params["final_layernorm"]))
        head = params.get("lm_head")
        self.lm_head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        return {"embed_tokens": held(self.embed_tokens), "shared_blocks": [b.params() for b in self.shared_blocks],
                "layers": [l.params() for l in self.layers], "final_layernorm": held(self.final_layernorm),
                "lm_head": None if self.lm_head is None else held(self.lm_head)}

    def tap_shape(self, layer: int, B: int, L: int):
        return tap_shape(self.config, self.config.layer_types[layer], B, L)

    def hook_shape(self, name: str, B: int, L: int) -> tuple:
        """As ``LanguageModel.hook_shape``; a shared attention's ``mixer.hook_in`` is ``(B, L, 2 d_model)``."""
        layer, point = parse_name(name)
        if point == "mixer.hook_in" and self.config.layer_types[layer] == "attention":
            return (B, L, self.config.attention_input_size)
        return super().hook_shape(name, B, L)

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "hf_layers": list(c.hf_layers),
                "hf_layer_types": list(c.layers_block_type), "shared_blocks": c.num_shared_blocks,
                "shared_block_of_layer": list(c.shared_block_index), "d_model": c.hidden_size,
                "mamba_heads": c.n_mamba_heads, "mamba_head_dim": c.mixer_config.head_dim,
                "state_size": c.mamba_d_state, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                "head_dim": c.head_dim, "d_mlp": c.intermediate_size,
                "adapter_rank": c.adapter_rank, "attention_adapters": c.use_shared_attention_adapter}


__all__ = ["check_layer_call", "SharedBlock", "AttentionMixer", "SharedAttentionLayer", "MambaLayer", "LM"]
