"""Falcon-H1 configuration (HF ``FalconH1Config`` fields) and the Mamba-2 config of its
Mamba path."""
from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import FULL_WINDOW, AttentionFields
from ...nn.config import MAX_LAYERS, float_to_json, read_rope_parameters, write_rope_parameters
from ..bamba.config import Mamba2Fields
from ..mamba2.config import MixerConfig as Mamba2MixerConfig


@dataclasses.dataclass(frozen=True)
class MixerConfig(Mamba2MixerConfig):
    """The Mamba-2 config of Falcon-H1's Mamba path: inner width ``num_heads * head_dim``,
    the input times ``ssm_in_multiplier`` before ``in_proj``, ``in_proj``'s ``(z, x, B, C,
    dt)`` rows times ``ssm_multipliers`` (HF's ``mup_vector``), the output norm before the
    gate, after it or none, and ``out_proj``'s bias from ``projectors_bias``."""

    ssm_in_multiplier: float = 1.0
    ssm_multipliers: tuple = (1.0, 1.0, 1.0, 1.0, 1.0)
    rms_norm: bool = False
    norm_before_gate: bool = True
    projectors_bias: bool = False

    @property
    def norm_mode(self) -> str:
        if not self.rms_norm:
            return "none"
        return "norm_then_gate" if self.norm_before_gate else "gate_then_norm"

    @property
    def in_multiplier(self) -> float:
        return self.ssm_in_multiplier

    @property
    def proj_multipliers(self) -> tuple:
        return self.ssm_multipliers

    @property
    def out_proj_bias(self) -> bool:
        return self.projectors_bias


def real_tuple(v, n: int, name: str) -> tuple:
    """``v`` as a tuple of ``n`` finite floats (``ValueError`` naming ``name`` otherwise)."""
    if (not isinstance(v, (tuple, list)) or len(v) != n
            or any(isinstance(t, bool) or not isinstance(t, numbers.Real) or t != t or abs(t) == float("inf")
                   for t in v)):
        raise ValueError(f"{name} must be a list of {n} finite numbers, got {v!r}")
    return tuple(float(t) for t in v)


@dataclasses.dataclass(frozen=True)
class Config(Mamba2Fields, AttentionFields, HFConfig):
    """The fields of HF ``FalconH1Config`` the forward pass needs.

    Every layer runs a Mamba-2 mixer and full causal GQA attention (RoPE over the whole
    head, keys times ``key_multiplier``) in parallel on the same normed input, then a
    SwiGLU MLP; the muP multipliers scale the embeddings, the paths' inputs and outputs,
    the MLP's gate and output, the logits, and (``ssm_multipliers``) the Mamba ``in_proj``
    rows. The Mamba width is ``mamba_d_ssm`` (``mamba_expand * hidden_size`` if None).
    """

    model_type: ClassVar[str] = "falcon_h1"
    architecture: ClassVar[str] = "FalconH1ForCausalLM"
    label: ClassVar[str] = "Falcon-H1"
    mixer_config_class: ClassVar[type] = MixerConfig
    mamba_width_source: ClassVar[str] = "mamba_d_ssm"

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    mamba_d_ssm: int | None = 1024
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    projectors_bias: bool = False
    lm_head_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    mlp_multipliers: tuple = (1.0, 1.0)
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_multipliers: tuple = (1.0, 1.0, 1.0, 1.0, 1.0)
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it); resolve ``num_key_value_heads=None``,
        ``head_dim=None`` (``hidden_size // num_attention_heads``, as HF), ``mamba_d_ssm=None``
        and ``mamba_d_head="auto"``."""
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "mamba_expand")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.mamba_d_ssm is None:
            object.__setattr__(self, "mamba_d_ssm", self.mamba_expand * self.hidden_size)
        self.check_ints("mamba_d_ssm")
        self.check_floats("rope_theta", above=0.0)
        self.check_floats("lm_head_multiplier", "embedding_multiplier", "key_multiplier", "attention_in_multiplier",
                          "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")
        object.__setattr__(self, "mlp_multipliers", real_tuple(self.mlp_multipliers, 2, "mlp_multipliers"))
        object.__setattr__(self, "ssm_multipliers", real_tuple(self.ssm_multipliers, 5, "ssm_multipliers"))
        self.check_bools("attention_bias", "mlp_bias", "tie_word_embeddings", "mamba_norm_before_gate",
                         "mamba_rms_norm", "projectors_bias")
        self.check_choice("hidden_act", ("silu",), self.label)
        self.check_attention_fields()
        self.check_mamba_fields()

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"parallel"`` (Mamba-2 and attention side by side) for every layer."""
        return ("parallel",) * self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # HF's default RoPE rotates the whole head

    @property
    def rotary_note(self) -> str:
        return ""

    @property
    def attention_scale(self) -> float:
        """``key_multiplier / sqrt(head_dim)``: HF scales the keys, before RoPE (a linear map)."""
        return self.key_multiplier * self.head_dim ** -0.5

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW  # full causal attention

    @property
    def mamba_width(self) -> int:
        return self.mamba_d_ssm

    @property
    def attention_channels(self) -> int:
        """Operator channels of the attention path (``num_attention_heads * head_dim``)."""
        return self.num_attention_heads * self.head_dim

    def mixer_options(self) -> dict:
        """The Mamba path's multipliers, output norm and ``out_proj`` bias (``MixerConfig``)."""
        return dict(ssm_in_multiplier=self.ssm_in_multiplier, ssm_multipliers=self.ssm_multipliers,
                    rms_norm=self.mamba_rms_norm, norm_before_gate=self.mamba_norm_before_gate,
                    projectors_bias=self.projectors_bias)

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        kw = read_rope_parameters(d, cls.read_time_step_limit(kw), cls.label)
        kw.pop("partial_rotary_factor", None)  # HF Falcon-H1 rotates the whole head whatever it says
        return kw

    def write_hf(self, d: dict) -> dict:
        d["time_step_limit"] = [float_to_json(t) for t in self.time_step_limit]
        d["mlp_multipliers"] = list(self.mlp_multipliers)
        d["ssm_multipliers"] = list(self.ssm_multipliers)
        return write_rope_parameters(d)


__all__ = ["Config", "MixerConfig"]
