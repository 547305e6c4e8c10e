"""The base of every family's ``Config``: reading and writing Hugging Face ``config.json``
dicts, written once."""
from __future__ import annotations

import dataclasses
from typing import ClassVar


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

    @classmethod
    def from_hf(cls, d: dict):
        """The config of an HF ``config.json`` dict; unknown keys are ignored, ``None`` values
        take the defaults. Raises ``ValueError`` naming a missing required field."""
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


__all__ = ["HFConfig"]
