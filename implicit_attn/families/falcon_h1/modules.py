"""Falcon-H1 NNX modules: the parallel mixer (Mamba-2 and attention on one input), and
Bamba's layer and LM classes with it."""
from __future__ import annotations

import functools

from ...nn import Mixer
from ..bamba.modules import LM as BambaLM
from ..bamba.modules import BambaLayer
from .block import VARIANTS, layer_forward_jit, lm_forward_jit, mixer_forward_jit, mixer_operator_jit
from .config import Config


class ParallelMixer(Mixer):
    """HF ``FalconH1Mixer`` and ``FalconH1Attention`` side by side on the same input, their
    outputs summed with ``ssm_out_multiplier`` / ``attention_out_multiplier``; tensors
    ``mamba.*`` and ``self_attn.*``. ``as_operator`` gives both paths' channels (see
    ``block.mixer_operator``); the variant applies to the Mamba channels."""

    label = "Falcon-H1"
    variants = VARIANTS
    forward_fn = staticmethod(functools.partial(mixer_forward_jit, kind="parallel"))
    operator_fn = staticmethod(functools.partial(mixer_operator_jit, kind="parallel"))


class FalconH1Layer(BambaLayer):
    """Decoder layer: ``input_layernorm``, ``mixer`` (a ``ParallelMixer``),
    ``pre_ff_layernorm``, ``feed_forward`` (the SwiGLU MLP)."""

    layer_forward_fn = staticmethod(layer_forward_jit)

    def make_mixer(self, cfg: Config, kind: str, params: dict):
        return ParallelMixer(cfg, params)


class LM(BambaLM):
    """``FalconH1ForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``checkpoint.to_params`` or ``checkpoint.init_params``."""

    family = "falcon_h1"
    label = "Falcon-H1"
    variants = VARIANTS
    forward_fn = staticmethod(lm_forward_jit)
    layer_class = FalconH1Layer

    def describe(self) -> dict:
        c = self.config
        return {"d_model": c.hidden_size, "mamba_heads": c.mamba_n_heads, "mamba_head_dim": c.mamba_d_head,
                "state_size": c.mamba_d_state, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                "head_dim": c.head_dim, "channels": c.mamba_channels + c.attention_channels,
                "d_mlp": c.intermediate_size}


__all__ = ["ParallelMixer", "FalconH1Layer", "LM"]
