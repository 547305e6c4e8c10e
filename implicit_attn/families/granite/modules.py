"""GraniteMoeHybrid NNX modules: Bamba's modules (same parameter tree) with Granite's
layer and LM functions."""
from __future__ import annotations

from ..bamba.modules import LM as BambaLM
from ..bamba.modules import AttentionMixer as BambaAttentionMixer
from ..bamba.modules import BambaLayer
from .block import layer_forward_jit, lm_forward_jit


class AttentionMixer(BambaAttentionMixer):
    """Full causal GQA attention (HF ``GraniteMoeHybridAttention``; logits scaled by
    ``attention_multiplier``, RoPE only with ``position_embedding_type="rope"``)."""

    label = "GraniteMoeHybrid"


class GraniteLayer(BambaLayer):
    """Decoder layer: ``input_layernorm``, ``mixer``, ``pre_ff_layernorm`` (HF
    ``post_attention_layernorm``), ``feed_forward`` (the MoE and the shared MLP)."""

    layer_forward_fn = staticmethod(layer_forward_jit)
    attention_class = AttentionMixer


class LM(BambaLM):
    """``GraniteMoeHybridForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "granitemoehybrid"
    label = "GraniteMoeHybrid"
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = GraniteLayer

    def describe(self) -> dict:
        c = self.config
        return {**super().describe(), "d_mlp": c.shared_intermediate_size, "experts": c.num_local_experts,
                "experts_per_token": c.num_experts_per_tok, "d_expert": c.intermediate_size}


__all__ = ["AttentionMixer", "GraniteLayer", "LM"]
