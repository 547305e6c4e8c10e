"""Zamba (Zamba-v1, HF ``ZambaConfig`` fields), our layer list, and the config of its
multi-head Mamba-1 mixer.

Zamba's layers are Zamba2's (``zamba2.config``): Mamba layers and hybrid layers whose shared
transformer block (attention on ``[h, embeddings]``, then a GELU MLP, then the layer's own
``linear``) feeds their Mamba mixer's input; there is one shared block, used by every hybrid
layer, and no adapters or RoPE. The Mamba mixer is Mamba-1 split into ``n_mamba_heads``
heads, each with its own ``x_proj`` / ``dt_proj`` and so its own ``B`` and ``C``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

from ...nn import HFConfig
from ...nn.config import MAX_LAYERS
from ..mamba import Config as MambaConfig
from ..zamba2.config import HF_LAYER_NAMES, LAYER_NAMES, SharedBlockLayers


@dataclasses.dataclass(frozen=True)
class MixerConfig(MambaConfig):
    """Zamba's Mamba mixer: Mamba-1 of width ``intermediate_size`` in ``num_heads`` heads of
    ``head_dim`` channels; head ``h`` is a Mamba-1 mixer of width ``head_dim`` (``head_config``)
    on channels ``h * head_dim ...``, with its own ``x_proj`` and ``dt_proj``."""

    num_heads: int = 1

    def __post_init__(self):
        super().__post_init__()
        self.check_ints("num_heads")
        if self.intermediate_size % self.num_heads:
            raise ValueError(f"Zamba n_mamba_heads ({self.num_heads}) must divide mamba_expand * hidden_size "
                             f"({self.intermediate_size})")

    @property
    def head_dim(self) -> int:
        return self.intermediate_size // self.num_heads

    @functools.cached_property  # built once per config (its fields are frozen)
    def head_config(self) -> MambaConfig:
        """The Mamba-1 config of one head (width ``head_dim``)."""
        return MambaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, state_size=self.state_size,
                           conv_kernel=self.conv_kernel, intermediate_size=self.head_dim,
                           time_step_rank=self.time_step_rank, use_bias=self.use_bias,
                           use_conv_bias=self.use_conv_bias)


def default_layers(n: int, period: int, offset: int) -> tuple[str, ...]:
    """HF's layer kinds when the config lists none: two Mamba layers, a hybrid, then a hybrid
    wherever ``i % period == offset`` among the other ``n - 3`` (ours: ``"mamba"`` / ``"hybrid"``)."""
    return ("mamba", "mamba", "hybrid") + tuple("hybrid" if i % period == offset else "mamba" for i in range(n - 3))


@dataclasses.dataclass(frozen=True)
class Config(SharedBlockLayers, HFConfig):
    """The fields of HF ``ZambaConfig`` the forward pass needs.

    ``layers_block_type`` holds HF's layer kinds (``"mamba"`` / ``"hybrid"``; read from
    ``layers_block_type`` or ``layer_types``, else HF's default from ``attn_layer_period`` /
    ``attn_layer_offset``); ``num_hidden_layers`` must be its length. The shared attention
    reads ``attention_hidden_size = 2 * hidden_size`` features in heads of
    ``attention_head_dim`` (default ``2 * hidden_size // num_attention_heads``), without
    positional encoding; the MLP is ``down(gelu(gate x) * up x)``. HF ties every hybrid layer's
    shared block to the first one's only with ``tie_word_embeddings`` (the default), as Zamba2.
    """

    model_type: ClassVar[str] = "zamba"
    architecture: ClassVar[str] = "ZambaForCausalLM"
    label: ClassVar[str] = "Zamba"
    num_mem_blocks: ClassVar[int] = 1  # one shared block
    rotary_dim: ClassVar[int] = 0  # no RoPE

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 76
    layers_block_type: tuple | None = None
    attn_layer_period: int = 6
    attn_layer_offset: int = 4
    intermediate_size: int = 14848
    hidden_act: str = "gelu"
    hidden_mamba_act: str = "silu"
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    attention_hidden_size: int | None = None
    attention_head_dim: int | None = None
    n_mamba_heads: int = 2
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it); resolve the ``None`` / ``"auto"``
        defaults as HF does."""
        self.check_ints("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "n_mamba_heads",
                        "mamba_d_state", "mamba_d_conv", "mamba_expand", "attn_layer_period")
        self.check_ints("attn_layer_offset", low=0)
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        defaults = {"num_key_value_heads": self.num_attention_heads, "attention_hidden_size": 2 * self.hidden_size,
                    "attention_head_dim": 2 * self.hidden_size // self.num_attention_heads}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.mamba_dt_rank == "auto":
            object.__setattr__(self, "mamba_dt_rank", math.ceil(self.hidden_size / 16))
        self.check_ints("num_key_value_heads", "attention_hidden_size", "attention_head_dim", "mamba_dt_rank")
        if self.attention_hidden_size != 2 * self.hidden_size:
            raise ValueError(f"attention_hidden_size ({self.attention_hidden_size}) must be 2 * hidden_size "
                             f"({2 * self.hidden_size}): the shared attention reads [h, embeddings]")
        self.check_multiple("num_attention_heads", "num_key_value_heads")
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_bools("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings")
        self.check_choice("hidden_act", ("gelu",), self.label)
        self.check_choice("hidden_mamba_act", ("silu",), self.label)
        default = default_layers(self.num_hidden_layers, self.attn_layer_period, self.attn_layer_offset)
        self.check_layer_kinds("layers_block_type", LAYER_NAMES, default)
        if self.num_hidden_layers != len(self.layers_block_type):
            raise ValueError(f"num_hidden_layers ({self.num_hidden_layers}) must equal the number of "
                             f"layers_block_type entries ({len(self.layers_block_type)})")
        self.mixer_config  # validates the Mamba fields with their messages

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def mamba_channels(self) -> int:
        """Operator channels of a Mamba layer (``mamba_expand * hidden_size``, all heads)."""
        return self.mixer_config.intermediate_size

    @functools.cached_property
    def mixer_config(self) -> MixerConfig:
        """The config of the Mamba layers' mixer (HF ``ZambaMambaMixer``)."""
        return MixerConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, state_size=self.mamba_d_state,
                           conv_kernel=self.mamba_d_conv, intermediate_size=self.mamba_expand * self.hidden_size,
                           time_step_rank=self.mamba_dt_rank, use_bias=self.mamba_proj_bias,
                           use_conv_bias=self.mamba_conv_bias, num_heads=self.n_mamba_heads)

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        if "layers_block_type" not in kw and d.get("layer_types") is not None:
            kw["layers_block_type"] = d["layer_types"]  # HF's alias
        return kw

    def write_hf(self, d: dict) -> dict:
        d["layers_block_type"] = [HF_LAYER_NAMES[t] for t in self.layers_block_type]
        return d


__all__ = ["Config", "MixerConfig", "default_layers"]
