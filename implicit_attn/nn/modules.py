"""NNX building blocks shared by the families: parameter holders and the token-mixer
module every family's mixer derives from."""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from .checks import check_block_input


def held(v: nnx.Variable):
    """The array ``v`` holds, read directly: ``v[...]`` goes through NNX's value hooks, about 10 µs
    a variable (1.5 ms of each forward call of a 141-tensor model on a 2-core EPYC); a value that
    is not a JAX array (a mutable reference) is read by ``v[...]``."""
    x = v.get_raw_value()
    return x if isinstance(x, jax.Array) else v[...]


class Weights(nnx.Module):
    """A named group of checkpoint tensors (HF local names such as ``"in_proj.weight"``)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.p = nnx.Dict({k: nnx.Param(jnp.asarray(v)) for k, v in tensors.items()})

    def arrays(self) -> dict[str, jax.Array]:
        """Plain ``{name: array}`` for the pure functions."""
        return {k: held(v) for k, v in self.p.items()}


def check_variant(variant: str, variants: tuple[str, ...], label: str) -> str:
    """Raise ``ValueError`` unless ``variant`` is one of ``variants`` (``label`` names the
    family in the message)."""
    if variant not in variants:
        raise ValueError(f"{label} variant must be one of {variants}, got {variant!r}")
    return variant


class Mixer(Weights):
    """A token-mixing block: ``__call__(h)`` its forward pass, ``as_operator(x, variant)``
    its operator. Subclasses set the class attributes.

    Attributes:
      label: family name for messages (e.g. ``"Mamba"``).
      variants: the accepted ``variant`` strings (``"full"`` first).
      forward_fn: jitted ``(params, h, cfg=) -> (B, L, d_model)``.
      operator_fn: jitted ``(params, x, cfg=, variant=) -> operator``.
      input_name: what the input is called in error messages.
    """

    label: ClassVar[str] = "mixer"
    variants: ClassVar[tuple[str, ...]] = ("full",)
    forward_fn: ClassVar[Any]
    operator_fn: ClassVar[Any]
    input_name: ClassVar[str] = "mixer input"

    def __init__(self, cfg, tensors: Mapping[str, Any]):
        super().__init__(tensors)
        self.cfg = cfg

    def check_input(self, x):
        """``x (B, L, d_model)`` validated (see ``check_block_input``)."""
        return check_block_input(x, self.cfg.hidden_size, self.input_name)

    def check_variant(self, variant: str) -> str:
        return check_variant(variant, self.variants, self.label)

    def __call__(self, h):
        """``(B, L, d_model) -> (B, L, d_model)``: the block's forward pass."""
        return type(self).forward_fn(self.arrays(), self.check_input(h), cfg=self.cfg)

    def as_operator(self, x, variant: str = "full"):
        """The block's operator for input ``x (B, L, d_model)`` (see the family's
        ``mixer_operator`` for the variants and the channels)."""
        x = self.check_input(x)
        self.check_variant(variant)
        return type(self).operator_fn(self.arrays(), x, cfg=self.cfg, variant=variant)


__all__ = ["Weights", "Mixer", "check_variant"]
