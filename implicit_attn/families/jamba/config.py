"""Jamba configuration (HF ``JambaConfig`` fields) and the Mamba config its Mamba layers
run with."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import NoPositionFields
from ...nn.config import MAX_LAYERS
from ..falcon_mamba import Config as FalconMambaConfig

@dataclasses.dataclass(frozen=True)
class MixerConfig(FalconMambaConfig):
    """The Mamba config of Jamba's Mamba layers: Falcon-Mamba's RMSNorm on ``dt``, ``B`` and
    ``C``, with weights (HF ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``)."""

    @property
    def bcdt_norm_weights(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Config(NoPositionFields, HFConfig):
    """The fields of HF ``JambaConfig`` the forward pass needs.

    Layer ``i`` is attention if ``i % attn_layer_period == attn_layer_offset``, Mamba
    otherwise; its feed-forward part is a mixture of ``num_experts`` SwiGLU experts if
    ``num_experts > 1`` and ``i % expert_layer_period == expert_layer_offset``, a SwiGLU MLP
    otherwise (HF ``layers_block_type``, ``layers_num_experts``).
    """

    model_type: ClassVar[str] = "jamba"
    architecture: ClassVar[str] = "JambaForCausalLM"
    label: ClassVar[str] = "Jamba"
    attention_bias: ClassVar[bool] = False  # HF Jamba's projections have no biases
    mlp_bias: ClassVar[bool] = False

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    num_experts: int = 16
    num_experts_per_tok: int = 2
    expert_layer_period: int = 2
    expert_layer_offset: int = 1
    attn_layer_period: int = 8
    attn_layer_offset: int = 4
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it); resolve ``num_key_value_heads=None``
        and ``mamba_dt_rank="auto"`` (``ceil(hidden_size / 16)``) as HF does."""
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "num_experts", "num_experts_per_tok", "expert_layer_period",
                        "attn_layer_period", "mamba_d_state", "mamba_d_conv", "mamba_expand")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_ints("expert_layer_offset", "attn_layer_offset", low=0)
        for what in ("attn", "expert"):
            period, offset = getattr(self, f"{what}_layer_period"), getattr(self, f"{what}_layer_offset")
            if offset >= period:
                raise ValueError(f"{what}_layer_offset ({offset}) must be smaller than {what}_layer_period ({period})")
        if self.num_experts > 1 and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_experts "
                             f"({self.num_experts})")
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_bools("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings")
        self.check_choice("hidden_act", ("silu",), self.label)
        if self.mamba_dt_rank == "auto":
            object.__setattr__(self, "mamba_dt_rank", math.ceil(self.hidden_size / 16))
        self.check_ints("mamba_dt_rank")
        self.check_attention_fields()
        self.mixer_config  # validates the Mamba fields with their messages

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"attention"`` or ``"mamba"`` per layer."""
        return tuple("attention" if i % self.attn_layer_period == self.attn_layer_offset else "mamba"
                     for i in range(self.num_hidden_layers))

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward part is the mixture of experts."""
        return self.num_experts > 1 and layer % self.expert_layer_period == self.expert_layer_offset

    @property
    def mamba_channels(self) -> int:
        """Operator channels of a Mamba layer (``mamba_expand * hidden_size``)."""
        return self.mixer_config.intermediate_size

    @functools.cached_property  # built once per config (its fields are frozen)
    def mixer_config(self) -> MixerConfig:
        """The Mamba config of the Mamba layers (HF ``JambaMambaMixer``)."""
        try:
            return MixerConfig(
                vocab_size=self.vocab_size, hidden_size=self.hidden_size, state_size=self.mamba_d_state,
                conv_kernel=self.mamba_d_conv, expand=self.mamba_expand, time_step_rank=self.mamba_dt_rank,
                use_bias=self.mamba_proj_bias, use_conv_bias=self.mamba_conv_bias, mixer_rms_eps=self.rms_norm_eps)
        except ValueError as e:
            raise ValueError(f"{self.label} {e}") from None

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        if "num_experts" not in kw and d.get("num_local_experts") is not None:
            kw["num_experts"] = d["num_local_experts"]  # HF's alias
        return kw


__all__ = ["Config", "MixerConfig"]
