"""OLMo-Hybrid NNX modules: the Gated DeltaNet and attention mixers (Qwen3-Next's mixer classes
with OLMo-Hybrid's pure functions), the decoder layer (its two norms named as HF names them per
layer kind) and the LM (Bamba's LM class with OLMo-Hybrid's layer)."""
from __future__ import annotations

import functools

from ...nn import Weights
from ..bamba.modules import LM as BambaLM
from ..bamba.modules import BambaLayer
from ..qwen3_next.modules import AttentionMixer as Qwen3NextAttentionMixer
from ..qwen3_next.modules import DeltaMixer as Qwen3NextDeltaMixer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .checkpoint import layer_norm_names
from .config import Config


class DeltaMixer(Qwen3NextDeltaMixer):
    """HF ``OlmoHybridGatedDeltaNet``: ``__call__(h)`` its forward, ``as_operator(x, variant)`` its
    exact operator (channels = value heads x value head width)."""

    label = "OLMo-Hybrid"
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="delta"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="delta"))


class AttentionMixer(Qwen3NextAttentionMixer):
    """HF ``OlmoHybridAttention``: full causal GQA attention, q/k RMS-normed over all heads, full
    RoPE or none; ``as_operator`` gives the explicit attention (channels = heads)."""

    label = "OLMo-Hybrid"
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="attention"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="attention", variant="full"))


class OlmoHybridLayer(BambaLayer):
    """HF ``OlmoHybridLinearAttentionDecoderLayer`` (norms ``input_layernorm``,
    ``post_attention_layernorm``; pre-norm) or ``OlmoHybridAttentionDecoderLayer`` (norms
    ``post_attention_layernorm``, ``post_feedforward_layernorm``; post-norm), with ``mixer`` and
    ``mlp``."""

    layer_forward_fn = staticmethod(layer_forward_jit)
    attention_class = AttentionMixer

    def __init__(self, cfg: Config, kind: str, layer: dict):
        self.cfg = cfg
        self.kind = kind
        self.norms = Weights({n: layer[n] for n in layer_norm_names(kind)})
        self.mixer = DeltaMixer(cfg, layer["mixer"]) if kind == "delta" else AttentionMixer(cfg, layer["mixer"])
        self.mlp = Weights(layer["mlp"])

    def params(self) -> dict:
        return {**self.norms.arrays(), "mixer": self.mixer.arrays(), "mlp": self.mlp.arrays()}


class LM(BambaLM):
    """``OlmoHybridForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "olmo_hybrid"
    label = "OLMo-Hybrid"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = OlmoHybridLayer

    def describe(self) -> dict:
        c = self.config
        return {"layer_types": list(c.layer_types), "d_model": c.hidden_size,
                "key_heads": c.linear_num_key_heads, "value_heads": c.linear_num_value_heads,
                "key_head_dim": c.linear_key_head_dim, "value_head_dim": c.linear_value_head_dim,
                "negative_eigenvalues": c.linear_allow_neg_eigval, "heads": c.num_attention_heads,
                "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rope": c.rotary_dim > 0,
                "d_mlp": c.intermediate_size}


__all__ = ["DeltaMixer", "AttentionMixer", "OlmoHybridLayer", "LM"]
