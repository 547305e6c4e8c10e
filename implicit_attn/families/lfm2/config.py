"""LFM2, LFM2-MoE and LFM3 configurations (HF ``Lfm2Config``, ``Lfm2MoeConfig``, ``Lfm3Config``).

Layers are gated short convolutions (``"conv"``) or GQA softmax attention (``"full_attention"``,
ours ``"attention"``; LFM3 also ``"sliding_attention"``, ours ``"sliding"``). LFM2 takes them from
``layer_types`` or ``full_attn_idxs`` (HF's default: every layer attention), LFM2-MoE from
``layer_types`` only (HF has no default), LFM3 from ``layer_types`` or its pattern (attention at
``i % 4 == 2``, sliding attention at ``i % 4 == 0, i > 0``, conv otherwise).

Feed-forward width: LFM2's SwiGLU adjusts ``intermediate_size`` (``block_auto_adjust_ff_dim``:
two thirds, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``); LFM2-MoE's first ``num_dense_layers`` and LFM3's layers use it as it is.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from ...nn import HFConfig
from ...nn.attention import FULL_WINDOW, AttentionFields, rope_frequencies
from ...nn.config import MAX_LAYERS

LAYER_NAMES = {"conv": "conv", "full_attention": "attention", "sliding_attention": "sliding"}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}


def default_rope(d: dict, label: str) -> dict:
    """``{"rope_theta": ...}`` from HF's ``rope_parameters`` object ``d`` (``rope_type``
    ``"default"``, which rotates the whole head: a ``partial_rotary_factor`` other than 1 is
    refused, as HF's LFM rotary embeddings do not read it)."""
    if not isinstance(d, dict):
        raise ValueError(f"rope_parameters must be an object, got {d!r}")
    if d.get("rope_type", "default") != "default":
        raise ValueError(f"{label} rope_type {d['rope_type']!r} is not supported here (only 'default')")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{label} default RoPE rotates the whole head; partial_rotary_factor "
                         f"{d['partial_rotary_factor']!r} is not read by HF and is refused")
    return {"rope_theta": d["rope_theta"]} if d.get("rope_theta") is not None else {}


def token_ids(d: dict) -> dict:
    """The special token ids of HF dict ``d`` as stored, an explicit null included (a list of
    end-of-text ids as a tuple)."""
    kw = {k: d[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id") if k in d}
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = tuple(kw["eos_token_id"])
    return kw


@dataclasses.dataclass(frozen=True)
class ShortConvFields(AttentionFields, HFConfig):
    """The fields every LFM generation shares (HF ``Lfm2Config``'s names and defaults)."""

    model_type: ClassVar[str] = ""
    label: ClassVar[str] = ""
    # layer kinds this generation has, and the attention layers' local tensor names
    kinds: ClassVar[tuple] = ("conv", "attention")
    attention_names: ClassVar[dict] = {"q_norm": "q_layernorm.weight", "k_norm": "k_layernorm.weight",
                                       "out": "out_proj", "gate": None}

    vocab_size: int
    hidden_size: int
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    conv_bias: bool = False
    conv_L_cache: int = 3
    layer_types: tuple | None = None
    # not read by the forward pass; kept so that a saved config.json reloads in transformers
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | tuple | None = 2

    def default_layer_types(self) -> tuple | None:
        """Our layer kinds when ``layer_types`` is not given (None: it is required)."""
        return None

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it) and resolve the layer kinds."""
        self.check_ints("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "conv_L_cache")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_floats("norm_eps", low=0.0)
        self.check_floats("rope_theta", above=0.0)
        self.check_bools("tie_word_embeddings", "conv_bias")
        default = self.default_layer_types()
        if self.layer_types is None and default is None:
            raise ValueError(f"{self.label} config.json must list layer_types (HF has no default)")
        names = {k: v for k, v in LAYER_NAMES.items() if v in self.kinds}
        self.check_layer_kinds("layer_types", names, default or ())
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"num_hidden_layers ({self.num_hidden_layers}) must equal the number of layer_types "
                             f"({len(self.layer_types)})")
        self.check_attention_fields()

    @property
    def rms_norm_eps(self) -> float:
        """The eps of every RMSNorm (HF ``norm_eps``)."""
        return self.norm_eps

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW

    def window(self, kind: str) -> int:
        """Keys at distance ``>= window`` are masked in a ``kind`` attention layer."""
        return FULL_WINDOW

    def rope_frequencies(self, kind: str) -> np.ndarray:
        """The RoPE angular frequencies of a ``kind`` attention layer, ``(head_dim / 2,)`` float32
        as HF computes them (``theta ** (-2i / head_dim)``)."""
        return rope_frequencies(self.rope_theta, self.head_dim)

    def ff_size(self, i: int) -> int:
        """The hidden width of layer ``i``'s dense SwiGLU."""
        return self.intermediate_size

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        """``"mlp"`` or ``"moe"`` per layer."""
        return ("mlp",) * self.num_hidden_layers

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """``rope_parameters`` (default RoPE) into ``rope_theta``; HF's legacy ``tie_embedding``."""
        kw.update(default_rope(d.get("rope_parameters") or {}, cls.label))
        kw.update(token_ids(d))
        if d.get("tie_embedding") is not None:
            kw["tie_word_embeddings"] = d["tie_embedding"]
        return kw

    def write_hf(self, d: dict) -> dict:
        d["layer_types"] = [HF_LAYER_NAMES[t] for t in self.layer_types]
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        if isinstance(d["eos_token_id"], tuple):
            d["eos_token_id"] = list(d["eos_token_id"])
        return d


@dataclasses.dataclass(frozen=True)
class Config(ShortConvFields):
    """HF ``Lfm2Config`` (LFM2): gated short convolutions and full attention, SwiGLU MLPs."""

    model_type: ClassVar[str] = "lfm2"
    architecture: ClassVar[str] = "Lfm2ForCausalLM"
    label: ClassVar[str] = "LFM2"

    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: tuple | None = None

    def default_layer_types(self) -> tuple:
        n = self.num_hidden_layers if isinstance(self.num_hidden_layers, int) else 0
        idx = self.full_attn_idxs
        if idx is None:
            return ("attention",) * n
        return tuple("attention" if i in idx else "conv" for i in range(n))

    def __post_init__(self):
        self.check_ints("block_multiple_of")
        self.check_bools("block_auto_adjust_ff_dim")
        self.check_floats("block_ffn_dim_multiplier", above=0.0)
        idx = self.full_attn_idxs
        if idx is not None:
            if not isinstance(idx, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in idx):
                raise ValueError(f"full_attn_idxs must be a list of layer indices, got {idx!r}")
            object.__setattr__(self, "full_attn_idxs", tuple(idx))
        super().__post_init__()
        if self.full_attn_idxs is not None:
            kinds = tuple("attention" if i in self.full_attn_idxs else "conv" for i in range(self.num_hidden_layers))
            if kinds != self.layer_types:
                raise ValueError(f"full_attn_idxs {list(self.full_attn_idxs)} disagrees with layer_types "
                                 f"{[HF_LAYER_NAMES[t] for t in self.layer_types]}")

    def ff_size(self, i: int) -> int:
        """HF ``Lfm2MLP``'s width: when ``block_auto_adjust_ff_dim``, two thirds of
        ``intermediate_size`` times ``block_ffn_dim_multiplier``, rounded up to a multiple of
        ``block_multiple_of``; ``intermediate_size`` otherwise."""
        size = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            size = int(self.block_ffn_dim_multiplier * int(2 * size / 3))
            size = self.block_multiple_of * ((size + self.block_multiple_of - 1) // self.block_multiple_of)
        return size

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """The shared keys and HF's legacy ``block_ff_dim`` (for ``intermediate_size``); an
        explicit ``block_ffn_dim_multiplier: null`` is refused (HF's config requires a number)."""
        kw = super().read_hf(d, kw)
        if d.get("block_ff_dim") is not None:
            kw["intermediate_size"] = d["block_ff_dim"]
        if "block_ffn_dim_multiplier" in d and d["block_ffn_dim_multiplier"] is None:
            raise ValueError("block_ffn_dim_multiplier must be a number (HF's Lfm2Config refuses null)")
        return kw

    def write_hf(self, d: dict) -> dict:
        d = super().write_hf(d)
        if d["full_attn_idxs"] is not None:
            d["full_attn_idxs"] = list(d["full_attn_idxs"])
        return d


@dataclasses.dataclass(frozen=True)
class MoeConfig(ShortConvFields):
    """HF ``Lfm2MoeConfig`` (LFM2-MoE): LFM2's layers, the first ``num_dense_layers`` with a
    SwiGLU MLP, the others a mixture of SwiGLU experts routed by sigmoid scores (top-k chosen
    on ``scores + expert_bias`` when ``use_expert_bias``, weights renormalised with ``+ 1e-6`` when
    ``norm_topk_prob``, times ``routed_scaling_factor``)."""

    model_type: ClassVar[str] = "lfm2_moe"
    architecture: ClassVar[str] = "Lfm2MoeForCausalLM"
    label: ClassVar[str] = "LFM2-MoE"

    hidden_size: int = 2048
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    num_dense_layers: int = 2
    num_experts_per_tok: int = 4
    num_experts: int = 32
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    def __post_init__(self):
        self.check_ints("moe_intermediate_size", "num_experts")
        self.check_ints("num_dense_layers", low=0)
        self.check_floats("routed_scaling_factor")
        self.check_bools("use_expert_bias", "norm_topk_prob")
        super().__post_init__()
        self.check_ints("num_experts_per_tok", high=self.num_experts)

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        return tuple("mlp" if i < self.num_dense_layers else "moe" for i in range(self.num_hidden_layers))


@dataclasses.dataclass(frozen=True)
class Lfm3Config(ShortConvFields):
    """HF ``Lfm3Config`` (LFM3): width-7 short convolutions, full and sliding-window attention
    with q/k norms, a sigmoid gate per head (``use_attention_gate``) and per-kind RoPE, sandwich
    norms around the mixer and the MLP (``use_sandwich_norm``).

    RoPE per attention kind: ``rope_theta``, ``rope_type`` (``"default"``: the whole head;
    ``"proportional"``: the first ``int(partial_rotary_factor * head_dim) // 2`` frequencies of
    ``theta ** (-2i / head_dim)``, the rest zero, all divided by ``rope_factor``) for full
    attention, ``sliding_rope_theta`` (default RoPE) for sliding attention."""

    model_type: ClassVar[str] = "lfm3"
    architecture: ClassVar[str] = "Lfm3ForCausalLM"
    label: ClassVar[str] = "LFM3"
    kinds: ClassVar[tuple] = ("conv", "attention", "sliding")
    attention_names: ClassVar[dict] = {"q_norm": "q_norm.weight", "k_norm": "k_norm.weight", "out": "o_proj",
                                       "gate": "gate_proj.weight"}

    vocab_size: int = 128_000
    hidden_size: int = 2048
    intermediate_size: int = 7680
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 128
    pad_token_id: int | None = 124_893
    bos_token_id: int | None = 124_894
    eos_token_id: int | tuple | None = 124_900
    conv_L_cache: int = 7
    sliding_window: int = 256
    use_sandwich_norm: bool = True
    use_attention_gate: bool = True
    attention_bias: bool = False
    rope_type: str = "proportional"
    partial_rotary_factor: float = 0.5
    rope_factor: float = 1.0
    sliding_rope_theta: float = 10_000.0

    def default_layer_types(self) -> tuple:
        n = self.num_hidden_layers if isinstance(self.num_hidden_layers, int) else 0
        return tuple("attention" if i % 4 == 2 else "sliding" if i % 4 == 0 and i > 0 else "conv" for i in range(n))

    def __post_init__(self):
        self.check_ints("head_dim", "sliding_window")
        self.check_bools("use_sandwich_norm", "use_attention_gate", "attention_bias")
        self.check_choice("rope_type", ("default", "proportional"), self.label)
        self.check_floats("partial_rotary_factor", low=0.0, high=1.0)
        self.check_floats("rope_factor", above=0.0)
        self.check_floats("sliding_rope_theta", above=0.0)
        super().__post_init__()

    def window(self, kind: str) -> int:
        return self.sliding_window if kind == "sliding" else FULL_WINDOW

    def rope_frequencies(self, kind: str) -> np.ndarray:
        """HF ``Lfm3RotaryEmbedding``'s frequencies of a ``kind`` layer, ``(head_dim / 2,)`` float32."""
        d = self.head_dim
        if kind == "sliding":
            return rope_frequencies(self.sliding_rope_theta, d)
        if self.rope_type == "default":
            return super().rope_frequencies(kind)
        angles = int(self.partial_rotary_factor * d // 2)
        inv = np.concatenate([rope_frequencies(self.rope_theta, d, angles), np.zeros(d // 2 - angles, np.float32)])
        return (inv / np.float32(self.rope_factor)).astype(np.float32)

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """HF's ``rms_norm_eps`` alias, and ``rope_parameters`` per layer kind (``full_attention``:
        ``"default"`` or ``"proportional"``; ``sliding_attention``: ``"default"``)."""
        if "sliding_window" in d and d["sliding_window"] is None:
            raise ValueError(f"{cls.label} sliding_window null (sliding layers without a window) is not supported")
        kw.update(token_ids(d))
        if d.get("rms_norm_eps") is not None and "norm_eps" not in kw:
            kw["norm_eps"] = d["rms_norm_eps"]
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict) or any(k not in ("full_attention", "sliding_attention") for k in rope):
            raise ValueError(f"{cls.label} rope_parameters must map 'full_attention' / 'sliding_attention' to "
                             f"their RoPE settings, got {rope!r}")
        full = rope.get("full_attention") or {}
        if not isinstance(full, dict):
            raise ValueError(f"rope_parameters['full_attention'] must be an object, got {full!r}")
        unknown = set(full) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}
        if unknown:
            raise ValueError(f"{cls.label} full-attention RoPE keys {sorted(unknown)} are not supported")
        for ours, theirs in (("rope_type", "rope_type"), ("rope_theta", "rope_theta"),
                             ("partial_rotary_factor", "partial_rotary_factor"), ("rope_factor", "factor")):
            if full.get(theirs) is not None:
                kw[ours] = full[theirs]
        if full.get("rope_type", "proportional") == "default":
            kw.update(default_rope(full, cls.label))
            kw["partial_rotary_factor"] = 1.0
        sliding = default_rope(rope.get("sliding_attention") or {}, cls.label)
        if "rope_theta" in sliding:
            kw["sliding_rope_theta"] = sliding["rope_theta"]
        return kw

    def write_hf(self, d: dict) -> dict:
        d = super().write_hf(d)
        full = {"rope_type": d.pop("rope_type"), "rope_theta": d["rope_parameters"]["rope_theta"]}
        partial, factor = d.pop("partial_rotary_factor"), d.pop("rope_factor")
        if full["rope_type"] == "proportional":
            full["partial_rotary_factor"] = partial
            if factor != 1.0:
                full["factor"] = factor
        d["rope_parameters"] = {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": d.pop("sliding_rope_theta")}}
        return d


__all__ = ["LAYER_NAMES", "HF_LAYER_NAMES", "default_rope", "token_ids", "ShortConvFields", "Config", "MoeConfig", "Lfm3Config"]
