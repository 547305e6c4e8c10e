"""Named hook points of a forward pass: capture, add to or replace activations by name.

Names follow TransformerLens: ``hook_embed`` (the token embeddings, before any scaling or
norm), then per layer ``i``:

* ``blocks.{i}.hook_resid_pre``  ``(B, L, d_model)`` residual stream entering the layer;
* ``blocks.{i}.mixer.hook_in``   ``(B, L, d_model)`` the token mixer's input (after the norm);
* ``blocks.{i}.mixer.hook_out``  the mixer's operator output ``H v + offset`` before its
  output projection, in the operator's layout: ``(B, C, L)`` (``(B, heads, L, head_dim)``
  for attention layers);
* ``blocks.{i}.hook_resid_mid``  ``(B, L, d_model)`` after the mixer's residual add (families
  with an MLP / channel mix after the mixer);
* ``blocks.{i}.hook_resid_post`` ``(B, L, d_model)`` residual stream leaving the layer.

Block functions take ``hook(point, x) -> x`` (``point`` without the ``blocks.{i}.`` prefix)
and call it at each point; ``ForwardHooks`` is the one the LM forward passes build.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ..kernels import cpu as cpu_kernels

RESIDUAL_POINTS = ("hook_resid_pre", "mixer.hook_in", "mixer.hook_out", "hook_resid_post")
MID_POINTS = ("hook_resid_pre", "mixer.hook_in", "mixer.hook_out", "hook_resid_mid", "hook_resid_post")
# Read off the layer's operator (run_with_cache builds it from the captured mixer input).
OPERATOR_POINTS = ("mixer.hook_values", "mixer.hook_offset", "mixer.hook_gate", "mixer.hook_log_decay",
                   "mixer.hook_pattern")


def no_hook(point: str, x):
    """The identity hook (block functions' default)."""
    return x


def out_hook(hook: Callable | None) -> Callable | None:
    """``hook`` restricted to ``mixer.hook_out`` (what a mixer forward function takes)."""
    return None if hook is None else (lambda x: hook("mixer.hook_out", x))


def layer_tap(tap) -> Callable | None:
    """A per-layer hook that adds ``tap`` at ``mixer.hook_out`` (the blocks' ``tap=`` argument)."""
    if tap is None:
        return None
    return lambda point, x: x + tap.astype(x.dtype) if point == "mixer.hook_out" else x


def apply_out_hook(y, hook: Callable | None):
    """Apply a mixer-output hook to ``y (B, L, C)`` in the operator layout ``(B, C, L)``."""
    if hook is None:
        return y
    return jnp.swapaxes(hook(jnp.swapaxes(y, 1, 2)), 1, 2)


def block_name(i: int, point: str) -> str:
    return f"blocks.{i}.{point}"


class ForwardHooks:
    """What one traced forward pass does at its hook points.

    Args:
      capture: names whose activations to return.
      adds: ``{name: array}`` added at those points (exactly the activation's shape).
      sets: ``{name: array}`` replacing those activations (applied before ``adds``).
    ``captured`` collects ``{name: array}`` as the forward runs.
    """

    def __init__(self, capture=(), adds=None, sets=None):
        self.capture = frozenset(capture)
        self.adds = dict(adds or {})
        self.sets = dict(sets or {})
        self.captured: dict = {}

    def __call__(self, name: str, x):
        if name in self.sets:
            x = jnp.asarray(self.sets[name]).astype(x.dtype)
        if name in self.adds:
            x = x + jnp.asarray(self.adds[name]).astype(x.dtype)
        if name in self.capture:
            self.captured[name] = x
        return x

    def layer(self, i: int) -> Callable:
        """The hook of layer ``i``: ``(point, x) -> x``."""
        return lambda point, x: self(block_name(i, point), x)

    def run_layers(self, layer_fn: Callable, carry, layers: list, keys: tuple):
        """Run ``layer_fn(carry, i, layer params, hook) -> carry`` over ``layers`` in order, with
        layer ``i``'s hook (``layer(i)``) and only the entries ``keys`` of its params.

        A loop unrolled under ``jit``, not a ``lax.scan``: a scan needs the layers' weights
        stacked, a copy of every weight on each call (on CPU a third of RWKV-4's forward), and
        slices them again inside its body; the price is a compile time that grows with depth.

        Args:
          layer_fn: one layer; ``i`` is its index (a Python int), ``hook`` ``(point, x) -> x``.
          carry: what flows from layer to layer (the residual stream, or a tuple of arrays).
          layers: per-layer parameter dicts; keys: the entries of each the layer reads.
        Returns:
          the carry after the last layer.
        """
        for i, lp in enumerate(layers):
            carry = layer_fn(carry, i, {k: lp[k] for k in keys}, self.layer(i))
            carry = between_layers(carry)
        return carry


def between_layers(carry):
    """``carry`` (what one layer passes the next: the residual stream ``(B, L, D)``, or a pytree of
    such arrays) itself, with its cotangent in reverse mode formed once at this boundary
    (``kernels.cpu.cotangent_computed_once``) instead of inside every consumer from the last layer
    down. Every model's layer loop calls it after each layer."""
    return jax.tree_util.tree_map(cpu_kernels.cotangent_computed_once, carry)


def hook_names(num_layers: int, points) -> list[str]:
    """Every forward hook name of a model with ``num_layers`` layers and per-layer ``points``."""
    return ["hook_embed"] + [block_name(i, p) for i in range(num_layers) for p in points]


def parse_name(name: str) -> tuple[int | None, str]:
    """``"blocks.3.mixer.hook_in" -> (3, "mixer.hook_in")``; ``"hook_embed" -> (None, "hook_embed")``."""
    if name.startswith("blocks."):
        head, _, point = name[len("blocks."):].partition(".")
        if head.isdigit() and point:
            return int(head), point
    return None, name


__all__ = ["between_layers", "RESIDUAL_POINTS", "MID_POINTS", "OPERATOR_POINTS", "no_hook", "out_hook", "layer_tap", "apply_out_hook",
           "block_name", "ForwardHooks", "hook_names", "parse_name"]
