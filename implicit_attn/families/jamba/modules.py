"""Jamba NNX modules: Bamba's classes (same parameter tree) with Mamba's mixer on the Mamba
layers and Jamba's layer and LM functions."""
from __future__ import annotations

from ..bamba.modules import LM as BambaLM
from ..bamba.modules import AttentionMixer as BambaAttentionMixer
from ..bamba.modules import BambaLayer
from ..mamba import MambaMixer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit


class AttentionMixer(BambaAttentionMixer):
    """Full causal GQA attention without positional encoding (HF ``JambaAttention``)."""

    label = "Jamba"
    variants = VARIANTS


class JambaLayer(BambaLayer):
    """Decoder layer: ``input_layernorm``, ``mixer`` (``mamba.MambaMixer`` or attention),
    ``pre_ff_layernorm``, ``feed_forward`` (MLP or mixture of experts)."""

    layer_forward_fn = staticmethod(layer_forward_jit)
    attention_class = AttentionMixer
    mamba_class = MambaMixer


class LM(BambaLM):
    """``JambaForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "jamba"
    label = "Jamba"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = JambaLayer

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "d_model": c.hidden_size, "d_inner": c.mamba_channels,
                "state_size": c.mamba_d_state, "dt_rank": c.mamba_dt_rank, "heads": c.num_attention_heads,
                "kv_heads": c.num_key_value_heads, "d_mlp": c.intermediate_size,
                "moe_layers": [i for i in range(c.num_hidden_layers) if c.is_moe(i)], "experts": c.num_experts,
                "experts_per_token": c.num_experts_per_tok}


__all__ = ["AttentionMixer", "JambaLayer", "LM"]
