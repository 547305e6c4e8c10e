"""GraniteMoeHybrid configuration (HF ``GraniteMoeHybridConfig`` fields, Granite-4.0-H)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import FULL_WINDOW, AttentionFields
from ...nn.config import MAX_LAYERS, float_to_json, read_rope_parameters, write_rope_parameters
from ..bamba.config import Mamba2Fields

# HF layer-type names (and the legacy ones HF remaps) -> ours.
LAYER_NAMES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}
HF_LAYER_NAMES = {"mamba": "linear_attention", "attention": "full_attention"}
POSITION_EMBEDDINGS = ("rope", "nope")


@dataclasses.dataclass(frozen=True)
class Config(Mamba2Fields, AttentionFields, HFConfig):
    """The fields of HF ``GraniteMoeHybridConfig`` the forward pass needs.

    ``layer_types`` (HF ``layer_types`` / ``layers_block_type``) is stored as ``"mamba"`` /
    ``"attention"`` per layer; ``None`` means every layer is Mamba-2. ``intermediate_size`` is
    each routed expert's width, ``shared_intermediate_size`` the shared MLP's;
    ``num_local_experts=0`` is a dense model (shared MLP only). RoPE (over the whole head)
    only when ``position_embedding_type == "rope"``.
    """

    model_type: ClassVar[str] = "granitemoehybrid"
    architecture: ClassVar[str] = "GraniteMoeHybridForCausalLM"
    label: ClassVar[str] = "GraniteMoeHybrid"

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 11008
    shared_intermediate_size: int = 1024
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    layer_types: tuple | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    position_embedding_type: str | None = None
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it); resolve ``num_key_value_heads=None``,
        ``layer_types=None`` and ``mamba_d_head="auto"``."""
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "shared_intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "num_experts_per_tok")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_ints("num_local_experts", low=0)
        if self.num_local_experts and self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_local_experts "
                             f"({self.num_local_experts})")
        self.check_floats("embedding_multiplier", "residual_multiplier", "attention_multiplier")
        self.check_floats("logits_scaling", "rope_theta", above=0.0)
        self.check_bools("attention_bias", "tie_word_embeddings")
        self.check_choice("hidden_act", ("silu",), self.label)
        if self.position_embedding_type is not None:
            self.check_choice("position_embedding_type", POSITION_EMBEDDINGS, self.label)
        types = self.layer_types
        if types is None:
            types = ("mamba",) * self.num_hidden_layers
        if not isinstance(types, (tuple, list)) or any(not isinstance(t, str) or t not in LAYER_NAMES for t in types):
            raise ValueError(f"layer_types must be a list of {sorted(LAYER_NAMES)}, got {types!r}")
        if len(types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        object.__setattr__(self, "layer_types", tuple(LAYER_NAMES[t] for t in types))
        self.check_mamba_fields()
        self.check_attention_fields()

    @property
    def rotary_dim(self) -> int:
        return self.head_dim if self.position_embedding_type == "rope" else 0

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW  # full causal attention

    @property
    def rotary_note(self) -> str:
        return ', position_embedding_type "rope"'

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        if "layer_types" not in kw and d.get("layers_block_type") is not None:
            kw["layer_types"] = d["layers_block_type"]  # HF's alias
        kw = read_rope_parameters(d, cls.read_time_step_limit(kw), cls.label)
        kw.pop("partial_rotary_factor", None)  # HF Granite rotates the whole head whatever it says
        return kw

    def write_hf(self, d: dict) -> dict:
        d["layer_types"] = [HF_LAYER_NAMES[t] for t in self.layer_types]
        d["time_step_limit"] = [float_to_json(t) for t in self.time_step_limit]
        return write_rope_parameters(d)


__all__ = ["Config", "LAYER_NAMES", "HF_LAYER_NAMES", "POSITION_EMBEDDINGS"]
