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
    # whether HF's plain RMSNorms apply their weight in float32 before casting back (True) or
    # in the input dtype after it (False); one rounding apart in half precision
    norm_weight_in_float32: ClassVar[bool] = False

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

    def check_layer_kinds(self, name: str, kinds: dict, default: tuple):
        """Field ``name`` is a non-empty list of at most ``MAX_LAYERS`` of the keys of ``kinds``
        (HF's layer-type names, legacy ones included; None: ``default``, already ours); stores
        the tuple of ``kinds``' values (our names)."""
        v = getattr(self, name)
        if v is None:
            object.__setattr__(self, name, tuple(default))
            return
        if not isinstance(v, (tuple, list)) or not v or any(not isinstance(t, str) or t not in kinds for t in v):
            raise ValueError(f"{name} must be a non-empty list of {sorted(kinds)}, got {v!r}")
        if len(v) > MAX_LAYERS:
            raise ValueError(f"{name} has {len(v)} layers, more than {MAX_LAYERS}")
        object.__setattr__(self, name, tuple(kinds[t] for t in v))

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


def float_from_json(v, name: str):
    """HF writes non-finite floats as ``{"__float__": "Infinity"}`` (strict JSON); other
    values are returned as they are (the config's ``__post_init__`` checks them)."""
    if isinstance(v, dict):
        if set(v) != {"__float__"} or v["__float__"] not in ("Infinity", "-Infinity", "NaN"):
            raise ValueError(f"{name}: cannot read {v!r} as a number")
        return float(v["__float__"])
    return v


def float_to_json(v: float):
    """``v``, or HF's strict-JSON object for a non-finite float."""
    return v if math.isfinite(v) else {"__float__": "Infinity" if v > 0 else "-Infinity"}


def read_rope_parameters(d: dict, kw: dict, label: str) -> dict:
    """Fold HF's ``rope_parameters`` object of config dict ``d`` into the flat ``rope_theta`` /
    ``partial_rotary_factor`` fields of ``kw``; only ``rope_type: "default"`` is accepted."""
    rope = d.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters must be an object, got {rope!r}")
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{label} rope_type {rope['rope_type']!r} is not supported (only 'default')")
    for k in ("rope_theta", "partial_rotary_factor"):
        if rope.get(k) is not None:
            kw[k] = rope[k]
    return kw


def write_rope_parameters(d: dict) -> dict:
    """Move the flat ``rope_theta`` / ``partial_rotary_factor`` of HF dict ``d`` into
    ``rope_parameters`` (the inverse of ``read_rope_parameters``)."""
    rope = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    if "partial_rotary_factor" in d:
        rope["partial_rotary_factor"] = d.pop("partial_rotary_factor")
    d["rope_parameters"] = rope
    return d


__all__ = ["HFConfig", "MAX_SIZE", "MAX_LAYERS", "float_from_json", "float_to_json", "read_rope_parameters",
           "write_rope_parameters"]
