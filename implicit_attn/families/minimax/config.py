"""MiniMax configuration (HF ``MiniMaxConfig`` fields, ``model_type: "minimax"``)."""
from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import FULL_WINDOW, AttentionFields
from ...nn.config import MAX_LAYERS, read_rope_parameters, write_rope_parameters

# HF's layer-type names -> ours, and back.
LAYER_NAMES = {"linear_attention": "lightning", "full_attention": "attention"}
HF_LAYER_NAMES = {"lightning": "linear_attention", "attention": "full_attention"}
# The residual factors of HF's decoder layer (``h = alpha * norm(h) + beta * f(norm(h))``) and the
# names MiniMax's own (remote) code gives them; HF reads only its own names.
FACTORS = {"full_attn_alpha_factor": "layernorm_full_attention_alpha",
           "full_attn_beta_factor": "layernorm_full_attention_beta",
           "linear_attn_alpha_factor": "layernorm_linear_attention_alpha",
           "linear_attn_beta_factor": "layernorm_linear_attention_beta",
           "mlp_alpha_factor": "layernorm_mlp_alpha", "mlp_beta_factor": "layernorm_mlp_beta"}
# MiniMax's ``attn_type_list``: 0 lightning, 1 softmax attention.
ATTN_TYPES = {0: "lightning", 1: "attention"}


@dataclasses.dataclass(frozen=True)
class Config(AttentionFields, HFConfig):
    """The fields of HF ``MiniMaxConfig`` the forward pass needs.

    ``layer_types`` is stored as ``"lightning"`` / ``"attention"`` per layer (HF's default,
    ``None``: softmax attention on even layers). The lightning and softmax attention layers share
    ``num_attention_heads`` and ``head_dim`` (``None``: ``hidden_size // num_attention_heads``).
    Every layer's feed-forward part is the mixture of ``num_local_experts`` SwiGLU experts of
    width ``intermediate_size``. ``block_size`` is HF's chunk length (it does not change the
    numbers, only the shapes of HF's stored decay tables). The softmax attention rotates the whole
    head (HF's ``MiniMaxRotaryEmbedding`` reads neither ``rotary_dim`` nor
    ``partial_rotary_factor``), with a window where ``sliding_window`` is set.
    """

    model_type: ClassVar[str] = "minimax"
    architecture: ClassVar[str] = "MiniMaxForCausalLM"
    label: ClassVar[str] = "MiniMax"
    attention_bias: ClassVar[bool] = False  # HF's projections have no biases
    lightning_norm_eps: ClassVar[float] = 1e-6  # HF builds the lightning output norm with its default eps

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    num_experts_per_tok: int = 2
    num_local_experts: int = 8
    rope_theta: float = 1e6
    layer_types: tuple | None = None
    block_size: int = 256
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it); resolve ``num_key_value_heads=None``,
        ``head_dim=None`` and ``layer_types=None`` as HF does."""
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "num_experts_per_tok", "num_local_experts", "block_size")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        if not self.head_dim:  # HF: ``head_dim or hidden_size // num_attention_heads``
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.sliding_window is not None:
            self.check_ints("sliding_window")
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_floats("rope_theta", above=0.0)
        self.check_floats(*FACTORS)
        self.check_bools("tie_word_embeddings")
        self.check_choice("hidden_act", ("silu",), self.label)
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_local_experts "
                             f"({self.num_local_experts})")
        n = self.num_hidden_layers
        self.check_layer_kinds("layer_types", LAYER_NAMES,
                               tuple("attention" if (i + 1) % 2 else "lightning" for i in range(n)))
        if len(self.layer_types) != n:
            raise ValueError(f"num_hidden_layers ({n}) must equal the number of layer_types ({len(self.layer_types)})")
        if "attention" in self.layer_types:
            self.check_attention_fields()
        else:  # no softmax attention: its key/value heads are never read (HF does not check them)
            self.check_ints("head_dim")

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # HF rotates the whole head

    @property
    def rotary_note(self) -> str:
        return ""

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW if self.sliding_window is None else self.sliding_window

    @property
    def lightning_channels(self) -> int:
        """Operator channels of a lightning layer: heads x head width."""
        return self.num_attention_heads * self.head_dim

    def residual_factors(self, kind: str) -> tuple[float, float, float, float]:
        """``(alpha, beta)`` of the mixer's residual, then of the MoE's, for a ``kind`` layer."""
        pre = "linear_attn" if kind == "lightning" else "full_attn"
        return (getattr(self, f"{pre}_alpha_factor"), getattr(self, f"{pre}_beta_factor"), self.mlp_alpha_factor,
                self.mlp_beta_factor)

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """HF's ``num_experts`` alias and ``rope_parameters``; the fields of MiniMax's own code that
        HF ignores are refused where they say the math is other than HF's (``postnorm: false``,
        a shared expert, ``attn_type_list`` or ``layernorm_*`` factors other than HF's fields),
        and a partial ``rotary_dim`` is warned about (HF, and so this model, rotate the whole head)."""
        if "num_local_experts" not in kw and d.get("num_experts") is not None:
            kw["num_local_experts"] = d["num_experts"]
        kw = read_rope_parameters(d, kw, cls.label)
        kw.pop("partial_rotary_factor", None)  # HF's MiniMax RoPE ignores it
        if d.get("postnorm") is False:
            raise ValueError("postnorm false (the residual taken before the norm) is not supported: HF's MiniMax "
                             "always takes it after the norm")
        if d.get("shared_intermediate_size"):
            raise ValueError(f"shared_intermediate_size {d['shared_intermediate_size']!r}: a shared expert is not "
                             "supported (HF's MiniMax has none)")
        for ours, theirs in FACTORS.items():
            if d.get(theirs) is not None and d[theirs] != kw.get(ours, 1.0):
                raise ValueError(f"{theirs} ({d[theirs]!r}) differs from {ours} ({kw.get(ours, 1.0)!r}), the field "
                                 f"HF's MiniMax reads")
        types = d.get("attn_type_list")
        if types is not None:
            n = kw.get("num_hidden_layers", cls.num_hidden_layers)
            layer_types = kw.get("layer_types")
            if layer_types is None and isinstance(n, int) and 0 < n <= MAX_LAYERS:
                layer_types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)]
            if (not isinstance(types, list) or any(isinstance(t, bool) or t not in ATTN_TYPES for t in types)
                    or not isinstance(layer_types, (list, tuple))
                    or [HF_LAYER_NAMES[ATTN_TYPES[t]] for t in types] != list(layer_types)):
                raise ValueError(f"attn_type_list {types!r} does not match layer_types {layer_types!r} (HF's MiniMax "
                                 f"reads only layer_types)")
        rot = d.get("rotary_dim")
        head_dim, D, H = kw.get("head_dim"), kw.get("hidden_size"), kw.get("num_attention_heads", cls.num_attention_heads)
        if not head_dim and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (D, H)):
            head_dim = D // H
        if rot is not None and rot != head_dim:
            warnings.warn(f"MiniMax config: rotary_dim {rot!r} is ignored: HF's MiniMaxForCausalLM (and so this "
                          f"model) rotates the whole head of {head_dim} features", UserWarning, stacklevel=3)
        return kw

    def write_hf(self, d: dict) -> dict:
        d["layer_types"] = [HF_LAYER_NAMES[t] for t in self.layer_types]
        return write_rope_parameters(d)


__all__ = ["Config", "LAYER_NAMES", "HF_LAYER_NAMES", "FACTORS", "ATTN_TYPES"]
