"""Bamba configuration (HF ``BambaConfig`` fields) and the Mamba-2 mixer config its
Mamba layers run with."""
from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import FULL_WINDOW, AttentionFields
from ...nn.config import MAX_LAYERS, float_from_json, float_to_json, read_rope_parameters, write_rope_parameters
from ..mamba2 import Config as Mamba2Config
from ..mamba2.config import family_mixer_config

LAYER_KINDS = ("mamba", "attention")
# Mamba-2 config field -> the Bamba field it comes from (for error messages).
MAMBA_FIELDS = {"num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "state_size": "mamba_d_state",
                "n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "expand": "mamba_expand",
                "chunk_size": "mamba_chunk_size", "layer_norm_epsilon": "rms_norm_eps", "use_bias": "mamba_proj_bias",
                "use_conv_bias": "mamba_conv_bias"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba2Fields:
    """Base of a hybrid config whose Mamba-2 layers are set by HF's ``mamba_*`` fields (with
    HF's defaults) and ``time_step_limit``; the subclass has ``rms_norm_eps`` (also the gated
    norm's) and sets ``label`` (the family in messages). Bamba and GraniteMoeHybrid name
    these fields the same way."""

    label: ClassVar[str] = ""
    mixer_config_class: ClassVar[type] = Mamba2Config  # built by ``mixer_config``
    mamba_width_source: ClassVar[str] = "mamba_expand * hidden_size"  # what sets ``mamba_width``
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple = (0.0, float("inf"))

    def check_mamba_fields(self):
        """Check the ``mamba_*`` fields (``ValueError`` naming them) and resolve
        ``mamba_d_head="auto"`` to ``mamba_width / mamba_n_heads``."""
        self.check_ints("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
                        "mamba_chunk_size")
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_bools("mamba_conv_bias", "mamba_proj_bias")
        if isinstance(self.time_step_limit, list):
            object.__setattr__(self, "time_step_limit", tuple(self.time_step_limit))
        inner, source = self.mamba_width, self.mamba_width_source
        if self.mamba_d_head == "auto":
            if inner % self.mamba_n_heads:
                raise ValueError(f"{self.label} mamba_n_heads ({self.mamba_n_heads}) must divide {source} ({inner})")
            object.__setattr__(self, "mamba_d_head", inner // self.mamba_n_heads)
        self.check_ints("mamba_d_head")
        if self.mamba_d_head * self.mamba_n_heads != inner:
            raise ValueError(f"{self.label} mamba_d_head * mamba_n_heads ({self.mamba_d_head} * {self.mamba_n_heads}) "
                             f"must equal {source} ({inner})")
        self.mixer_config  # validates the Mamba-2 fields (n_groups, time_step_limit) with their messages

    @property
    def mamba_width(self) -> int:
        """The Mamba layers' inner width (``mamba_expand * hidden_size``; a subclass may set it)."""
        return self.mamba_expand * self.hidden_size

    def mixer_options(self) -> dict:
        """Further keyword arguments of ``mixer_config_class`` (a subclass's own fields)."""
        return {}

    @functools.cached_property  # built once per config (its fields are frozen)
    def mixer_config(self) -> Mamba2Config:
        """The Mamba-2 config of the Mamba layers (HF ``BambaMixer`` is ``Mamba2Mixer``)."""
        return family_mixer_config(
            self.mixer_config_class, self.label, MAMBA_FIELDS, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, num_heads=self.mamba_n_heads, head_dim=self.mamba_d_head,
            state_size=self.mamba_d_state, n_groups=self.mamba_n_groups, conv_kernel=self.mamba_d_conv,
            expand=self.mamba_expand, chunk_size=self.mamba_chunk_size, layer_norm_epsilon=self.rms_norm_eps,
            use_bias=self.mamba_proj_bias, use_conv_bias=self.mamba_conv_bias, time_step_limit=self.time_step_limit,
            **self.mixer_options())

    @property
    def mamba_channels(self) -> int:
        """Operator channels of a Mamba layer (``mamba_n_heads * mamba_d_head``)."""
        return self.mixer_config.d_ssm

    @staticmethod
    def read_time_step_limit(kw: dict) -> dict:
        """HF JSON ``time_step_limit`` (a list, maybe with ``{"__float__": "Infinity"}``) -> a tuple."""
        lim = kw.get("time_step_limit")
        if isinstance(lim, list):
            kw["time_step_limit"] = tuple(float_from_json(t, "time_step_limit") for t in lim)
        return kw


@dataclasses.dataclass(frozen=True)
class Config(Mamba2Fields, AttentionFields, HFConfig):
    """The fields of HF ``BambaConfig`` the forward pass needs. Layer ``i`` is attention
    if ``i`` is in ``attn_layer_indices``, Mamba-2 otherwise (HF ``layers_block_type``)."""

    model_type: ClassVar[str] = "bamba"
    architecture: ClassVar[str] = "BambaForCausalLM"
    label: ClassVar[str] = "Bamba"

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    attn_layer_indices: tuple = ()
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it) and resolve ``mamba_d_head="auto"``."""
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_floats("rope_theta", above=0.0)
        self.check_floats("partial_rotary_factor", low=0.0, high=1.0)
        self.check_bools("attention_bias", "mlp_bias", "tie_word_embeddings")
        self.check_choice("hidden_act", ("silu",), "Bamba")
        idx = self.attn_layer_indices if self.attn_layer_indices is not None else ()
        if (not isinstance(idx, (tuple, list))
                or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in idx)):
            raise ValueError(f"attn_layer_indices must be a list of layer indices, got {idx!r}")
        bad = [i for i in idx if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"attn_layer_indices {bad} out of range for num_hidden_layers {self.num_hidden_layers}")
        object.__setattr__(self, "attn_layer_indices", tuple(sorted(set(int(i) for i in idx))))
        self.check_mamba_fields()
        self.check_attention_fields()

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"attention"`` or ``"mamba"`` per layer."""
        return tuple("attention" if i in self.attn_layer_indices else "mamba" for i in range(self.num_hidden_layers))

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW  # full causal attention

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        return read_rope_parameters(d, cls.read_time_step_limit(kw), "Bamba")

    def write_hf(self, d: dict) -> dict:
        d["attn_layer_indices"] = list(self.attn_layer_indices)
        d["time_step_limit"] = [float_to_json(t) for t in self.time_step_limit]
        return write_rope_parameters(d)


__all__ = ["Config", "Mamba2Fields", "LAYER_KINDS", "MAMBA_FIELDS"]
