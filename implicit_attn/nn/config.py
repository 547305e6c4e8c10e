"""The base of every family's ``Config``: reading and writing Hugging Face ``config.json``
dicts, written once."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

import numpy as np

# Largest width, depth or size a config may declare: beyond int32 indexing, and far beyond
# any checkpoint (a mistyped value is reported by name rather than as a failed allocation).
MAX_SIZE = 2**31 - 1
# Largest ``num_hidden_layers``: the loader lists every layer's tensors, so a mistyped
# depth must be refused before that (the deepest released models have a few hundred).
MAX_LAYERS = 2**16


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """A frozen dataclass of the HF config fields a family's forward pass needs.

    Subclasses (frozen dataclasses) set ``model_type``, ``architecture`` and ``required``
    and may override ``read_hf`` / ``write_hf`` for fields stored differently in JSON.
    """

    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""
    required: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size")

    @classmethod
    def read_hf(cls, d: dict, kw: dict) -> dict:
        """Adjust the keyword arguments taken from the HF dict ``d`` (default: as they are)."""
        return kw

    def write_hf(self, d: dict) -> dict:
        """Adjust the HF dict written by ``to_hf`` (default: the fields as they are)."""
        return d

    # ---- validation helpers for ``__post_init__``: each names the field and its value in a
    # ``ValueError`` and stores the normalised value (``int``, ``float``, ``bool``).

    def check_ints(self, *names: str, low: int = 1, high: int = MAX_SIZE):
        """Each field is an integer (not a bool, float or string) in ``[low, high]``."""
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {v!r} ({type(v).__name__})")
            if not low <= v <= high:
                what = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")
                raise ValueError(f"{name} must be {what} (at most {high}), got {v}")
            object.__setattr__(self, name, int(v))

    def check_floats(self, *names: str, low: float | None = None, high: float | None = None,
                     above: float | None = None, finite: bool = True):
        """Each field is a real number (an int or a float, not a bool or string), finite
        when ``finite``, ``>= low``, ``<= high`` and ``> above`` where given."""
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ValueError(f"{name} must be a number, got {v!r} ({type(v).__name__})")
            v = float(v)
            if math.isnan(v) or (finite and math.isinf(v)):
                raise ValueError(f"{name} must be a finite number, got {v}")
            for ok, what in ((low is None or v >= low, f">= {low}"), (high is None or v <= high, f"<= {high}"),
                             (above is None or v > above, f"> {above}")):
                if not ok:
                    raise ValueError(f"{name} must be {what}, got {v}")
            object.__setattr__(self, name, v)

    def check_bools(self, *names: str):
        """Each field is ``true`` or ``false`` (not 0/1 or a string)."""
        for name in names:
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"{name} must be true or false, got {v!r} ({type(v).__name__})")
            object.__setattr__(self, name, bool(v))

    def check_choice(self, name: str, choices: tuple, label: str = ""):
        """The field is one of ``choices`` (strings; ``label`` names the family)."""
        v = getattr(self, name)
        if not isinstance(v, str) or v not in choices:
            only = f"only {choices[0]!r}" if len(choices) == 1 else f"one of {list(choices)}"
            raise ValueError(f"{label + ' ' if label else ''}{name} {v!r} is not supported ({only})")

    def check_multiple(self, name: str, of: str):
        """Field ``name`` is a multiple of field ``of`` (both checked integers >= 1)."""
        v, d = getattr(self, name), getattr(self, of)
        if v % d:
            raise ValueError(f"{name} ({v}) must be a multiple of {of} ({d})")

    @classmethod
    def from_hf(cls, d: dict):
        """The config of an HF ``config.json`` dict; unknown keys are ignored, ``None`` values
        take the defaults. Raises ``ValueError`` naming a missing required field, or (from the
        family's ``__post_init__``, see the ``check_*`` helpers) a field and its bad value."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = cls.read_hf(d, {k: d[k] for k in names if k in d and d[k] is not None})
        for req in cls.required:
            if req not in kw:
                raise ValueError(f"config.json is missing {req!r}")
        return cls(**kw)

    def to_hf(self) -> dict:
        """The HF ``config.json`` dict (with ``model_type`` and ``architectures``)."""
        d = self.write_hf(dataclasses.asdict(self))
        d.update(model_type=self.model_type, architectures=[self.architecture])
        return d


__all__ = ["HFConfig", "MAX_SIZE", "MAX_LAYERS"]
