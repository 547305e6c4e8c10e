"""OLMo-Hybrid configuration (HF ``OlmoHybridConfig`` fields).

Layers are Gated DeltaNet (``"linear_attention"``, ours ``"delta"``) or full attention
(``"full_attention"``, ours ``"attention"``), from ``layer_types`` or, without it, HF's default:
attention at every layer ``i`` with ``i % 4 == 3``, and at the last layer if that gives none.
The DeltaNet sizes default as HF's do (key and value heads: ``num_attention_heads``; key width
``int(0.75 hidden_size / key heads)``; value width twice that). RoPE is full-width, or none
(NoPE) where ``rope_parameters.rope_theta`` is null, as in the released checkpoints.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import AttentionFields
from ...nn.config import MAX_LAYERS, read_rope_parameters
from ..qwen3_next.config import HF_LAYER_NAMES, LAYER_NAMES, DeltaNetFields


@dataclasses.dataclass(frozen=True)
class Config(DeltaNetFields, AttentionFields, HFConfig):
    """The fields of HF ``OlmoHybridConfig`` the forward pass needs (``None`` sizes resolved as
    HF resolves them; ``rope_theta=None``: no positional encoding)."""

    model_type: ClassVar[str] = "olmo_hybrid"
    architecture: ClassVar[str] = "OlmoHybridForCausalLM"
    label: ClassVar[str] = "OLMo-Hybrid"
    norm_weight_in_float32: ClassVar[bool] = True  # HF applies the norms' weight before the cast
    # the Gated DeltaNet's tensors as HF's module names them (``qwen3_next.block`` reads these)
    projections: ClassVar[str] = "separate"
    delta_norm_name: ClassVar[str] = "o_norm.weight"
    delta_out_name: ClassVar[str] = "o_proj.weight"

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 30
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float | None = 10000.0
    partial_rotary_factor: float = 1.0
    layer_types: tuple | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int = 4
    linear_allow_neg_eigval: bool = True
    # not used by the forward pass, kept so that HF can build the model from the config we write
    # (HF's defaults, 100277 and 100257, are past a small vocabulary: HF's embedding rejects that)
    pad_token_id: int | None = 100277
    bos_token_id: int | None = None
    eos_token_id: int | tuple | None = 100257

    def __post_init__(self):
        """Resolve the ``None`` sizes and ``layer_types`` as HF does; validate every field
        (``ValueError`` naming it)."""
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "linear_conv_kernel_dim")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        heads = self.num_attention_heads
        for name, default in (("num_key_value_heads", heads), ("linear_num_key_heads", heads),
                              ("linear_num_value_heads", heads)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        self.check_ints("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads")
        if self.linear_key_head_dim is None:
            object.__setattr__(self, "linear_key_head_dim", int(0.75 * self.hidden_size / self.linear_num_key_heads))
        self.check_ints("linear_key_head_dim")
        if self.linear_value_head_dim is None:
            object.__setattr__(self, "linear_value_head_dim", 2 * self.linear_key_head_dim)
        self.check_ints("linear_value_head_dim")
        self.check_floats("rms_norm_eps", low=0.0)
        if self.rope_theta is not None:
            self.check_floats("rope_theta", above=0.0)
        self.check_floats("partial_rotary_factor", low=0.0, high=1.0)
        self.check_bools("tie_word_embeddings", "attention_bias", "linear_allow_neg_eigval")
        self.check_choice("hidden_act", ("silu",), self.label)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if isinstance(v, (list, tuple)) and name == "eos_token_id":  # HF allows several
                if not v or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v):
                    raise ValueError(f"eos_token_id must be a token id or a list of them, got {v!r}")
                object.__setattr__(self, name, tuple(v))
            elif v is not None:
                self.check_ints(name, low=0)
        if self.pad_token_id is not None and self.pad_token_id >= self.vocab_size:
            raise ValueError(f"pad_token_id ({self.pad_token_id}) must be below vocab_size ({self.vocab_size})")
        n = self.num_hidden_layers
        default = ["delta" if i % 4 != 3 else "attention" for i in range(n)]
        if "attention" not in default:
            default[-1] = "attention"
        self.check_layer_kinds("layer_types", LAYER_NAMES, tuple(default))
        if len(self.layer_types) != n:
            raise ValueError(f"num_hidden_layers ({n}) must equal the number of layer_types ({len(self.layer_types)})")
        if set(self.layer_types) != {"delta", "attention"}:
            raise ValueError(f"OLMo-Hybrid needs at least one linear_attention and one full_attention layer "
                             f"(as HF checks), got layer_types {list(self.layer_types)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        self.check_attention_fields()

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rope_theta is None else int(self.head_dim * self.partial_rotary_factor)

    @property
    def delta_norm_eps(self) -> float:
        """HF's gated output norm of the DeltaNet uses eps 1e-5 whatever ``rms_norm_eps`` is."""
        return 1e-5

    @property
    def beta_scale(self) -> float:
        """``linear_allow_neg_eigval``: write strengths ``2 sigmoid(b)`` in [0, 2]."""
        return 2.0 if self.linear_allow_neg_eigval else 1.0

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """``rope_parameters`` folded in (``rope_theta`` null there or at the top level: NoPE)."""
        kw = read_rope_parameters(d, kw, cls.label)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if name in d and d[name] is None:
                kw[name] = None
        rope = d.get("rope_parameters")
        if (isinstance(rope, dict) and "rope_theta" in rope and rope["rope_theta"] is None) or \
                ("rope_theta" in d and d["rope_theta"] is None):
            kw["rope_theta"] = None
        return kw

    def write_hf(self, d: dict) -> dict:
        d["layer_types"] = [HF_LAYER_NAMES[t] for t in self.layer_types]
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        rope = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        if self.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        d.pop("partial_rotary_factor")
        d["rope_parameters"] = rope
        return d


__all__ = ["Config"]
