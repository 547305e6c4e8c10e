"""RWKV-7 configuration: the fields of flash-linear-attention's ``RWKV7Config`` (``model_type:
"rwkv7"``) the forward pass needs, with its defaults and its normalisation: ``head_dim`` (when
set) gives ``num_heads = hidden_size / head_dim``, else ``head_dim = hidden_size / num_heads``;
``value_dim`` is one width per layer (None: ``hidden_size``; an int: that width for every layer).
Keys are ``hidden_size`` wide; the output group norm's eps is ``head_dim * norm_eps`` (64e-5 for
heads of 64, as the official code); ``fuse_norm`` picks fla's ``l2norm`` (``x / sqrt(sum x^2 +
1e-6)``, True) or torch's ``F.normalize`` (``x / max(|x|, 1e-12)``, False) for the removal key.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..rwkv6.config import RwkvFields


@dataclasses.dataclass(frozen=True)
class Config(RwkvFields):
    """fla ``RWKV7Config`` (its defaults)."""

    model_type: ClassVar[str] = "rwkv7"
    architecture: ClassVar[str] = "RWKV7ForCausalLM"
    label: ClassVar[str] = "RWKV-7"

    hidden_ratio: float = 4.0
    head_dim: int | None = 64
    num_heads: int | None = None
    decay_low_rank_dim: int = 64
    gate_low_rank_dim: int = 128
    a_low_rank_dim: int = 64
    v_low_rank_dim: int = 16
    fuse_norm: bool = True
    value_dim: tuple | int | None = None

    def __post_init__(self):
        """Validate every field (``ValueError`` naming the field and its value) and normalise
        ``head_dim``, ``num_heads`` and ``value_dim`` as fla does."""
        self.check_common()
        self.check_ints("decay_low_rank_dim", "gate_low_rank_dim", "a_low_rank_dim", "v_low_rank_dim")
        self.check_bools("fuse_norm")
        C = self.hidden_size
        if self.head_dim is None and self.num_heads is None:
            raise ValueError("RWKV-7 config needs head_dim or num_heads")
        if self.head_dim is not None:
            self.check_ints("head_dim")
            if C % self.head_dim:
                raise ValueError(f"hidden_size ({C}) must be a multiple of head_dim ({self.head_dim})")
            object.__setattr__(self, "num_heads", C // self.head_dim)
        else:
            self.check_ints("num_heads")
            if C % self.num_heads:
                raise ValueError(f"hidden_size ({C}) must be a multiple of num_heads ({self.num_heads})")
            object.__setattr__(self, "head_dim", C // self.num_heads)
        n = self.num_hidden_layers
        v = self.value_dim
        if v is None:
            v = (C,) * n
        elif isinstance(v, int) and not isinstance(v, bool):
            v = (v,) * n
        elif isinstance(v, (list, tuple)):
            if len(v) != n:
                raise ValueError(f"value_dim lists {len(v)} widths, num_hidden_layers is {n}")
            v = tuple(v)
        else:
            raise ValueError(f"value_dim must be null, an integer or a list of integers, got {v!r}")
        for w in v:
            if isinstance(w, bool) or not isinstance(w, int) or w < C or w % C:
                raise ValueError(f"value_dim entries must be multiples of hidden_size ({C}), got {w!r}")
        if len(set(v)) > 1:
            raise ValueError(f"value_dim differs between layers ({sorted(set(v))}): every layer mixes in layer "
                             "0's values, so their widths must agree")
        object.__setattr__(self, "value_dim", v)

    @property
    def value_width(self) -> int:
        """Every layer's value width."""
        return self.value_dim[0]

    @property
    def head_v_dim(self) -> int:
        return self.value_width // self.num_heads

    @property
    def group_norm_eps(self) -> float:
        """The output group norm's eps, ``head_dim * norm_eps``."""
        return self.head_dim * self.norm_eps

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """A ``head_dim`` given as null means "from ``num_heads``" (fla's reading), not the default."""
        if "head_dim" in d and d["head_dim"] is None:
            kw["head_dim"] = None
        return kw

    def write_hf(self, d: dict) -> dict:
        d["value_dim"] = list(self.value_dim)
        return d


__all__ = ["Config"]
