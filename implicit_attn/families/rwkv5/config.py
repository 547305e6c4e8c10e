"""RWKV-5 ("Eagle") configuration: the fields of the RWKV team's Hugging Face ``Rwkv5Config``
(``model_type: "rwkv5"``, remote code of the RWKV/rwkv-5-world-* and v5-Eagle checkpoints) the
forward pass needs, with its defaults.

Widths: ``H = hidden_size / head_size`` heads of ``head_size`` (64 in every release); the time
mix is as wide as the residual stream (the HF code sizes ``time_decay``, ``time_faaaa`` and
``ln_x`` by ``hidden_size``, so ``attention_hidden_size`` must equal it); the channel mix is
``intermediate_size`` wide, else ``int(3.5 hidden_size) // 32 * 32`` (RWKV-LM's default; the HF
config of the PR branch drops ``intermediate_size`` and always uses this).

Output group norm: ``GroupNorm_H(o / head_size_divisor)`` with ``nn.GroupNorm``'s eps ``1e-5``,
i.e. a group norm of ``o`` with eps ``1e-5 * head_size_divisor ** 2`` (``group_norm_eps``). The
default divisor 8 gives the official package's ``64e-5`` (RWKV-LM trains with it). The earlier
HF port (transformers PR #26963, whose code the first rwkv-5-world repos carried) has no
divisor: ``head_size_divisor: 1`` reproduces it.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from ...nn import HFConfig
from ...nn.config import MAX_LAYERS, MAX_SIZE
from ..rwkv.config import rescale_divisor

GROUP_NORM_EPS = 1e-5  # nn.GroupNorm's default eps, applied to o / head_size_divisor
HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))  # the dtypes the eval-mode rescaling runs at


def ffn_width(hidden_size: int) -> int:
    """RWKV-LM's default channel-mix width ``int(3.5 hidden_size) // 32 * 32``."""
    return int(hidden_size * 3.5) // 32 * 32


@dataclasses.dataclass(frozen=True)
class Config(HFConfig):
    """The fields of the HF ``Rwkv5Config`` the forward pass needs (its defaults; the
    widths left unset are filled in, see the module docstring)."""

    model_type: ClassVar[str] = "rwkv5"
    architecture: ClassVar[str] = "Rwkv5ForCausalLM"
    label: ClassVar[str] = "RWKV-5"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 24
    attention_hidden_size: int | None = None
    head_size: int = 64
    head_size_divisor: float = 8
    intermediate_size: int | None = None
    layer_norm_epsilon: float = 1e-5
    rescale_every: int = 6
    tie_word_embeddings: bool = False

    def __post_init__(self):
        """Validate every field (``ValueError`` naming the field and its value) and fill the
        derived widths (``attention_hidden_size``, ``intermediate_size``)."""
        self.check_ints("vocab_size", "hidden_size", "head_size")
        self.check_ints("num_hidden_layers", high=MAX_LAYERS)
        self.check_ints("rescale_every", low=-MAX_SIZE)  # <= 0: no rescaling
        self.check_floats("head_size_divisor", above=0.0)
        self.check_floats("layer_norm_epsilon", low=0.0)
        self.check_bools("tie_word_embeddings")
        self.check_multiple("hidden_size", "head_size")
        if self.attention_hidden_size is None:
            object.__setattr__(self, "attention_hidden_size", self.hidden_size)
        self.check_ints("attention_hidden_size")
        if self.attention_hidden_size != self.hidden_size:
            raise ValueError(f"attention_hidden_size ({self.attention_hidden_size}) must equal hidden_size "
                             f"({self.hidden_size}): the RWKV-5 time mix sizes its heads, time_decay and ln_x by "
                             "hidden_size")
        if self.intermediate_size is None:
            if ffn_width(self.hidden_size) < 1:
                raise ValueError(f"intermediate_size is unset and hidden_size {self.hidden_size} gives a channel-mix "
                                 "width of 0 (int(3.5 hidden_size) // 32 * 32): set intermediate_size")
            object.__setattr__(self, "intermediate_size", ffn_width(self.hidden_size))
        self.check_ints("intermediate_size")

    @property
    def num_heads(self) -> int:
        """``H = hidden_size / head_size``."""
        return self.hidden_size // self.head_size

    @property
    def group_norm_eps(self) -> float:
        """The output group norm's eps on ``o`` itself: ``1e-5 * head_size_divisor ** 2``."""
        return GROUP_NORM_EPS * self.head_size_divisor ** 2

    def rescale_period(self, dtype) -> int:
        """The ``rescale_every`` in effect at compute dtype ``dtype``: the RWKV team's code rescales
        only float16 / bfloat16 models (0, none, in float32)."""
        return self.rescale_every if dtype is not None and jnp.dtype(dtype) in HALF else 0

    def rescale(self, layer, dtype=None):
        """Eval-mode divisor of block ``layer``'s ``output`` / ``value`` weights at compute dtype
        ``dtype`` (``rescale_divisor`` of ``rescale_period``)."""
        return rescale_divisor(layer, self.rescale_period(dtype))


__all__ = ["Config", "GROUP_NORM_EPS", "ffn_width"]
