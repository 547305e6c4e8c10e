"""Nemotron-H NNX modules: Bamba's attention mixer and LM, and a layer holding a token
mixer (``mamba2.Mamba2Mixer`` or attention) with the MLP / MoE layers after it."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...nn import Weights, held
from ..bamba.modules import LM as BambaLM
from ..bamba.modules import AttentionMixer as BambaAttentionMixer
from ..bamba.modules import BambaLayer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit
from .config import Config


class AttentionMixer(BambaAttentionMixer):
    """Full causal GQA attention without positional encoding (HF ``NemotronHAttention``)."""

    label = "Nemotron-H"
    variants = VARIANTS


class FeedForwardLayer(nnx.Module):
    """An HF MLP or MoE layer: its ``norm`` weight and its mixer's tensors ``ffn`` (experts
    stacked)."""

    def __init__(self, layer: dict):
        self.norm = nnx.Param(jnp.asarray(layer["norm"]))
        self.ffn = Weights(layer["ffn"])

    def params(self) -> dict:
        return {"norm": held(self.norm), "ffn": self.ffn.arrays()}


class NemotronLayer(BambaLayer):
    """One layer of ours: ``input_layernorm`` and ``mixer`` (HF's token-mixing layer), then
    ``feed_forward``, the ``FeedForwardLayer`` of each MLP / MoE layer up to the next
    token-mixing layer (``Config.blocks``)."""

    layer_forward_fn = staticmethod(layer_forward_jit)
    attention_class = AttentionMixer

    def __init__(self, cfg: Config, kind: str, layer: dict):
        self.cfg = cfg
        self.kind = kind
        self.input_layernorm = nnx.Param(jnp.asarray(layer["input_layernorm"]))
        self.mixer = self.make_mixer(cfg, kind, layer["mixer"])
        self.feed_forward = nnx.List([FeedForwardLayer(f) for f in layer["feed_forward"]])

    def params(self) -> dict:
        return {"input_layernorm": held(self.input_layernorm), "mixer": self.mixer.arrays(),
                "feed_forward": [f.params() for f in self.feed_forward]}


class LM(BambaLM):
    """``NemotronHForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``. ``layers[k]`` is HF's ``k``-th
    token-mixing layer with the MLP / MoE layers after it (HF indices: ``config.blocks[k]``)."""

    family = "nemotron_h"
    label = "Nemotron-H"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = NemotronLayer

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "hf_layers": [list(b) for b in c.blocks],
                "hf_layer_types": list(c.layers_block_type), "d_model": c.hidden_size,
                "mamba_heads": c.mamba_num_heads, "mamba_head_dim": c.mamba_head_dim, "state_size": c.ssm_state_size,
                "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                "d_mlp": c.intermediate_size, "experts": c.n_routed_experts, "experts_per_token": c.num_experts_per_tok,
                "d_expert": c.moe_intermediate_size}


__all__ = ["AttentionMixer", "FeedForwardLayer", "NemotronLayer", "LM"]
