"""Zamba2 configuration (HF ``Zamba2Config`` fields), our layer list, and the Mamba-2 config
its Mamba layers run with.

HF's Zamba2 layers are Mamba-2 layers (``"linear_attention"``, legacy ``"mamba"``) and hybrid
layers (``"hybrid"``). A hybrid layer first runs a shared transformer block (attention on the
normed concatenation of the residual stream and the token embeddings, then an MLP, then the
layer's own ``linear``) and adds its output to the input of its Mamba-2 mixer. The shared
blocks are ``num_mem_blocks`` sets of weights used in turn by the hybrid layers (the
``k``-th hybrid layer uses block ``k % num_mem_blocks``), each hybrid layer with its own
low-rank adapters on the MLP (always) and on q/k/v (``use_shared_attention_adapter``). HF ties
the shared blocks (like the output head) only with ``tie_word_embeddings``: without it every
hybrid layer has a block of its own.

Our layers are the token mixers in the order they run: a Mamba layer is one layer of ours;
a hybrid layer is two, its shared attention (``"attention"``) and then its Mamba layer
(``"mamba"``). ``Config.layer_types`` lists ours, ``Config.hf_layers`` the HF layer of each.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

from ...nn import HFConfig
from ...nn.attention import FULL_WINDOW, AttentionFields
from ...nn.config import MAX_LAYERS, read_rope_parameters, write_rope_parameters
from ..mamba2.config import MixerConfig, family_mixer_config

# HF layer-type names (and the legacy one HF remaps) -> ours.
LAYER_NAMES = {"linear_attention": "mamba", "mamba": "mamba", "hybrid": "hybrid"}
HF_LAYER_NAMES = {"mamba": "linear_attention", "hybrid": "hybrid"}
# HF's default ``layers_block_type`` (Zamba2-2.7B's 54 layers), used when the config has none.
DEFAULT_LAYERS = (("mamba",) + (("mamba",) * 5 + ("hybrid",)) * 7 + ("mamba",) * 4 + ("hybrid",)
                  + ("mamba",) * 3 + ("hybrid",) + ("mamba",) * 2)
# Mamba-2 config fields -> the Zamba2 fields they come from (for error messages).
MAMBA_FIELDS = {"num_heads": "n_mamba_heads", "head_dim": "mamba_headdim", "state_size": "mamba_d_state",
                "n_groups": "mamba_ngroups", "conv_kernel": "mamba_d_conv", "time_step_limit": "time_step_min"}


class SharedBlockLayers(AttentionFields):
    """Our layer list of the Zamba families, from ``layers_block_type`` (``"mamba"`` /
    ``"hybrid"`` per HF layer), ``num_mem_blocks`` and ``tie_word_embeddings``; and the shared
    attention's fixed settings (input ``[h, embeddings]`` of ``2 * hidden_size`` features,
    logits scaled by ``(head_dim / 2) ** -0.5``, full causal, no biases)."""

    attention_bias: ClassVar[bool] = False  # HF's q/k/v/o never have biases

    @property
    def attention_input_size(self) -> int:
        """The shared attention reads the residual stream and the embeddings: ``2 * hidden_size``."""
        return 2 * self.hidden_size

    @property
    def attention_scale(self) -> float:
        return (self.head_dim / 2) ** -0.5

    @property
    def attention_window_size(self) -> int:
        return FULL_WINDOW

    @property
    def hybrid_layer_ids(self) -> tuple[int, ...]:
        """The HF indices of the hybrid layers (HF's ``hybrid_layer_ids``)."""
        return tuple(i for i, t in enumerate(self.layers_block_type) if t == "hybrid")

    @property
    def num_shared_blocks(self) -> int:
        """The distinct shared blocks: ``num_mem_blocks`` (fewer if there are fewer hybrids);
        without ``tie_word_embeddings`` HF ties nothing and every hybrid layer has its own."""
        n = len(self.hybrid_layer_ids)
        return min(self.num_mem_blocks, n) if self.tie_word_embeddings else n

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"attention"`` or ``"mamba"`` per layer of ours (a hybrid layer gives both, in order)."""
        return tuple(k for t in self.layers_block_type for k in (("attention", "mamba") if t == "hybrid" else ("mamba",)))

    @property
    def hf_layers(self) -> tuple[int, ...]:
        """The HF layer index of each of our layers."""
        return tuple(i for i, t in enumerate(self.layers_block_type) for _ in range(2 if t == "hybrid" else 1))

    @property
    def hybrid_ordinals(self) -> tuple[int | None, ...]:
        """Per layer of ours, which hybrid layer (0, 1, ...) it belongs to, or None."""
        out, k = [], 0
        for t in self.layers_block_type:
            if t == "hybrid":
                out += [k, k]
                k += 1
            else:
                out.append(None)
        return tuple(out)

    @property
    def shared_block_index(self) -> tuple[int | None, ...]:
        """Per layer of ours, the shared block its hybrid layer uses (ordinal ``%
        num_mem_blocks``; its ordinal when untied, see ``num_shared_blocks``), or None."""
        block = (lambda k: k % self.num_mem_blocks) if self.tie_word_embeddings else (lambda k: k)
        return tuple(None if k is None else block(k) for k in self.hybrid_ordinals)


@dataclasses.dataclass(frozen=True)
class Config(SharedBlockLayers, HFConfig):
    """The fields of HF ``Zamba2Config`` the forward pass needs.

    ``layers_block_type`` holds HF's layer kinds (``"mamba"`` / ``"hybrid"`` per HF layer;
    read from ``layers_block_type`` or its alias ``layer_types``); ``num_hidden_layers`` must be
    its length, as HF checks. The Mamba-2 mixers have inner width ``mamba_expand *
    hidden_size`` in ``n_mamba_heads`` heads, a conv bias whatever ``use_conv_bias`` says,
    ``dt`` clamped below at ``time_step_min`` and a gated norm with eps 1e-5 (HF's constants).
    The shared attention reads ``2 * hidden_size`` features, has heads of ``2 * hidden_size //
    num_attention_heads`` features, scales its logits by ``(head_dim / 2) ** -0.5``, and uses
    full RoPE only with ``use_mem_rope``; its MLP is ``down(gelu(g) * u)`` with ``[g, u] =
    gate_up(x)``.
    """

    model_type: ClassVar[str] = "zamba2"
    architecture: ClassVar[str] = "Zamba2ForCausalLM"
    label: ClassVar[str] = "Zamba2"
    mamba_norm_eps: ClassVar[float] = 1e-5  # HF hard-codes the gated norm's eps

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 54
    layers_block_type: tuple | None = None
    mamba_d_state: int = 64
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_ngroups: int = 1
    n_mamba_heads: int = 8
    chunk_size: int = 256
    time_step_min: float = 0.001
    add_bias_linear: bool = False
    intermediate_size: int | None = None
    hidden_act: str = "gelu"
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    num_mem_blocks: int = 1
    use_shared_attention_adapter: bool = False
    adapter_rank: int = 128
    use_mem_rope: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it); resolve ``intermediate_size=None``
        (``4 * hidden_size``), ``num_key_value_heads=None`` (the heads) and
        ``layers_block_type=None`` (HF's default 54 layers)."""
        self.check_ints("vocab_size", "hidden_size", "num_attention_heads")
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self.check_layer_kinds("layers_block_type", LAYER_NAMES, DEFAULT_LAYERS)
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        if self.num_hidden_layers != len(self.layers_block_type):
            raise ValueError(f"num_hidden_layers ({self.num_hidden_layers}) must equal the number of "
                             f"layers_block_type entries ({len(self.layers_block_type)})")
        self.check_ints("mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_ngroups", "n_mamba_heads",
                        "chunk_size", "intermediate_size", "num_key_value_heads", "num_mem_blocks", "adapter_rank")
        self.check_floats("time_step_min", low=0.0)
        self.check_floats("rope_theta", above=0.0)
        self.check_floats("rms_norm_eps", low=0.0)
        self.check_bools("add_bias_linear", "use_shared_attention_adapter", "use_mem_rope", "tie_word_embeddings")
        self.check_choice("hidden_act", ("gelu",), self.label)
        if self.mamba_expand * self.hidden_size % self.n_mamba_heads:
            raise ValueError(f"{self.label} n_mamba_heads ({self.n_mamba_heads}) must divide mamba_expand * "
                             f"hidden_size ({self.mamba_expand * self.hidden_size})")
        self.check_attention_fields()
        self.mixer_config  # validates the Mamba-2 fields with their messages

    def check_attention_fields(self):
        """The shared attention's sizes: heads of at least one feature, key/value heads that
        divide the heads, an even head width under RoPE, and the square q/k/v projections HF's
        adapters need."""
        if self.head_dim < 1:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) exceeds 2 * hidden_size "
                             f"({self.attention_input_size}): the shared attention's heads would be empty")
        self.check_multiple("num_attention_heads", "num_key_value_heads")
        if self.rotary_dim % 2:
            raise ValueError(f"use_mem_rope needs an even head_dim (2 * hidden_size // num_attention_heads = "
                             f"{self.head_dim})")
        if self.use_shared_attention_adapter and (
                self.num_key_value_heads != self.num_attention_heads
                or self.num_attention_heads * self.head_dim != self.attention_input_size):
            raise ValueError(f"use_shared_attention_adapter needs num_key_value_heads == num_attention_heads "
                             f"({self.num_key_value_heads} vs {self.num_attention_heads}) and num_attention_heads "
                             f"dividing 2 * hidden_size ({self.attention_input_size}): HF's q/k/v adapters are "
                             f"square")

    # ---- the shared attention (AttentionFields)
    @property
    def head_dim(self) -> int:
        return self.attention_input_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return self.head_dim if self.use_mem_rope else 0

    @property
    def mamba_channels(self) -> int:
        """Operator channels of a Mamba layer (``mamba_expand * hidden_size``)."""
        return self.mixer_config.d_ssm

    @functools.cached_property  # built once per config (its fields are frozen)
    def mixer_config(self) -> MixerConfig:
        """The Mamba-2 config of the Mamba layers (HF ``Zamba2MambaMixer``)."""
        inner = self.mamba_expand * self.hidden_size
        return family_mixer_config(
            MixerConfig, self.label, MAMBA_FIELDS, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_heads=self.n_mamba_heads, head_dim=inner // self.n_mamba_heads, state_size=self.mamba_d_state,
            n_groups=self.mamba_ngroups, conv_kernel=self.mamba_d_conv, chunk_size=self.chunk_size,
            layer_norm_epsilon=self.mamba_norm_eps, use_bias=self.add_bias_linear, use_conv_bias=True,
            hidden_act="silu", time_step_limit=(self.time_step_min, float("inf")))

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        if "layers_block_type" not in kw and d.get("layer_types") is not None:
            kw["layers_block_type"] = d["layer_types"]  # HF's alias
        if not d.get("use_mem_rope"):
            return kw  # HF builds no rotary embedding: its parameters do not matter
        rope = d.get("rope_parameters")
        if isinstance(rope, dict):  # HF's Zamba2 rotates every feature of a head whatever this says
            d = {**d, "rope_parameters": {k: v for k, v in rope.items() if k != "partial_rotary_factor"}}
        return read_rope_parameters(d, kw, cls.label)

    def write_hf(self, d: dict) -> dict:
        d["layers_block_type"] = [HF_LAYER_NAMES[t] for t in self.layers_block_type]
        return write_rope_parameters(d)


__all__ = ["SharedBlockLayers", "Config", "LAYER_NAMES", "HF_LAYER_NAMES", "DEFAULT_LAYERS"]
