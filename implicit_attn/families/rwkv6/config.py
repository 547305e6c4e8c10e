"""RWKV-6 configuration: the fields of flash-linear-attention's ``RWKV6Config`` (``model_type:
"rwkv6"``) the forward pass needs, with its defaults.

Widths: ``key_dim = round(hidden_size * expand_k)``, ``value_dim = round(hidden_size * expand_v)``
split over ``num_heads`` heads; the channel mix's width is ``intermediate_size`` or ``32 *
ceil(int(hidden_size * hidden_ratio) / 32)``. The released RWKV-6 ("Finch") models use
``expand_k = expand_v = 1`` and heads of 64; fla's defaults (``expand_k = 0.5``, 4 heads) are not
theirs.

``g_norm_eps`` is ours: the output group norm's eps (default: ``norm_eps``, what fla computes).
The official RWKV-6 code uses ``64e-5``; fla's converter sets that on the module but never saves
it, so a converted checkpoint reloaded in fla runs with ``norm_eps``. Set it in ``config.json``
to reproduce the official package's numbers.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from ...nn import HFConfig
from ...nn.config import MAX_LAYERS


def ffn_width(hidden_size: int, hidden_ratio: float, intermediate_size) -> int:
    """fla's channel-mix width: ``intermediate_size``, else ``hidden_ratio * hidden_size`` rounded
    up to a multiple of 32."""
    if intermediate_size is not None:
        return intermediate_size
    return 32 * math.ceil(int(hidden_size * hidden_ratio) / 32)


@dataclasses.dataclass(frozen=True)
class RwkvFields(HFConfig):
    """Fields RWKV-6 and RWKV-7 share (fla's names and checks)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 24
    hidden_ratio: float = 3.5
    intermediate_size: int | None = None
    hidden_act: str = "sqrelu"
    norm_first: bool = True
    norm_bias: bool = True
    norm_eps: float = 1e-5
    attn: dict | None = None
    tie_word_embeddings: bool = False

    def check_common(self):
        """Validate the shared fields; refuse what we do not build (hybrid softmax layers,
        another channel-mix activation)."""
        self.check_ints("vocab_size", "hidden_size")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_floats("hidden_ratio", above=0.0)
        self.check_floats("norm_eps", low=0.0)
        self.check_bools("norm_first", "norm_bias", "tie_word_embeddings")
        self.check_choice("hidden_act", ("sqrelu",), self.label)
        if self.attn is not None:
            raise ValueError(f"{self.label} config sets 'attn' (softmax-attention layers in the stack, fla's hybrid "
                             f"form): not supported; only pure {self.label} stacks are")
        if self.intermediate_size is not None:
            self.check_ints("intermediate_size")

    @property
    def ffn_size(self) -> int:
        """The channel mix's width."""
        return ffn_width(self.hidden_size, self.hidden_ratio, self.intermediate_size)


@dataclasses.dataclass(frozen=True)
class Config(RwkvFields):
    """fla ``RWKV6Config`` (its defaults), plus ``g_norm_eps`` (see the module docstring)."""

    model_type: ClassVar[str] = "rwkv6"
    architecture: ClassVar[str] = "RWKV6ForCausalLM"
    label: ClassVar[str] = "RWKV-6"

    expand_k: float = 0.5
    expand_v: float = 1.0
    num_heads: int = 4
    proj_low_rank_dim: int = 32
    gate_low_rank_dim: int = 64
    g_norm_eps: float | None = None

    def __post_init__(self):
        """Validate every field (``ValueError`` naming the field and its value)."""
        self.check_common()
        self.check_floats("expand_k", "expand_v", above=0.0)
        self.check_ints("num_heads", "proj_low_rank_dim", "gate_low_rank_dim")
        if self.g_norm_eps is not None:
            self.check_floats("g_norm_eps", low=0.0)
        for name, width in (("key_dim", self.key_dim), ("value_dim", self.value_dim)):
            if width < 1 or width % self.num_heads:
                raise ValueError(f"{name} ({width} = hidden_size x expand) must be a positive multiple of num_heads "
                                 f"({self.num_heads})")

    @property
    def key_dim(self) -> int:
        return int(round(self.hidden_size * self.expand_k))

    @property
    def value_dim(self) -> int:
        return int(round(self.hidden_size * self.expand_v))

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.num_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.num_heads

    @property
    def group_norm_eps(self) -> float:
        """The output group norm's eps: ``g_norm_eps``, else ``norm_eps`` (fla's)."""
        return self.norm_eps if self.g_norm_eps is None else self.g_norm_eps


__all__ = ["Config", "RwkvFields", "ffn_width"]
