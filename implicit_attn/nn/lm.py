"""The language-model base every family's ``LM`` derives from: what each LM used to repeat
(``__call__``, ``tapped_logits``, ``mixer_inputs``, ``operators``, ``info``, input checks)."""
from __future__ import annotations

from typing import Any, ClassVar

import jax
from flax import nnx

from .checks import check_input_ids, check_layers, check_taps, count_params, warn_low_precision
from .modules import check_variant


class LanguageModel(nnx.Module):
    """A causal LM whose layers each hold a token mixer at ``layers[i].mixer``.

    Subclasses set the class attributes, their ``__init__`` sets ``config`` and ``layers``,
    and they define:

    * ``params() -> dict``: the parameter tree the pure functions take;
    * ``tap_shape(layer, B, L) -> (shape, axes)``: layer ``layer``'s operator-output shape
      for a ``(B, L)`` input and its axes (for messages);
    * ``describe() -> dict``: the family-specific fields of ``info`` (widths, heads, ...).

    Attributes:
      family: the registry name (``model_type``) of the family.
      label: the family's name in messages.
      variants: operator variants every layer accepts (attention layers ignore them).
      forward_fn: jitted ``(params, ids, *extra, cfg=, capture=, taps=) -> (logits,
        captured)`` where ``captured`` lists the mixer inputs of the ``capture`` layers.
      takes_segment_pos: whether the model takes packed-document positions.
    """

    family: ClassVar[str] = ""
    label: ClassVar[str] = ""
    variants: ClassVar[tuple[str, ...]] = ("full",)
    forward_fn: ClassVar[Any]
    takes_segment_pos: ClassVar[bool] = False

    def extra_inputs(self, ids, segment_pos) -> tuple:
        """Extra positional inputs of ``forward_fn`` after ``ids`` (document positions for
        families that take them). The default refuses ``segment_pos``."""
        if segment_pos is not None:
            raise ValueError(f"segment_pos (packed documents) is not taken by {self.label} models: "
                             "only families with document resets take it (RecurrentGemma)")
        return ()

    # ------------------------------------------------------------ shared
    @property
    def dtype(self):
        """The dtype of the embeddings (the checkpoint's)."""
        return jax.tree_util.tree_leaves(self.params())[0].dtype

    @property
    def num_params(self) -> int:
        return count_params(self.params())

    def check_variant(self, variant: str) -> str:
        return check_variant(variant, self.variants, self.label)

    def inputs(self, input_ids, segment_pos=None) -> tuple:
        """``(ids (B, L) int32, extra inputs)`` checked at the API boundary."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        return ids, self.extra_inputs(ids, segment_pos)

    def __call__(self, input_ids, segment_pos=None):
        """``(B, L)`` int token ids -> ``(B, L, vocab)`` float32 logits."""
        ids, extra = self.inputs(input_ids, segment_pos)
        return type(self).forward_fn(self.params(), ids, *extra, cfg=self.config)[0]

    def tapped_logits(self, input_ids, taps: dict, segment_pos=None):
        """Logits with ``taps = {layer: array}`` added to those layers' operator outputs
        (``tap_shape``); differentiable in ``taps`` (for gradient-weighted attribution).
        Each tap must have exactly its layer's operator-output shape (ValueError otherwise)."""
        ids, extra = self.inputs(input_ids, segment_pos)
        B, L = ids.shape
        taps = check_taps(taps, lambda i: self.tap_shape(i, B, L)[0], len(self.layers),
                          lambda i: self.tap_shape(i, B, L)[1])
        return type(self).forward_fn(self.params(), ids, *extra, cfg=self.config, taps=taps)[0]

    def mixer_inputs(self, input_ids, layers=None, segment_pos=None) -> dict[int, jax.Array]:
        """``{layer: (B, L, d_model)}`` inputs of the selected layers' token mixers."""
        ids, extra = self.inputs(input_ids, segment_pos)
        sel = sorted(set(check_layers(layers, len(self.layers))))
        _, cap = type(self).forward_fn(self.params(), ids, *extra, cfg=self.config, capture=tuple(sel))
        return dict(zip(sel, cap))

    def operators(self, input_ids, layers=None, variant: str = "full", segment_pos=None) -> list:
        """One operator per selected layer (all by default), in the order asked:
        ``layers[i].mixer.as_operator`` of each layer's mixer input."""
        self.check_variant(variant)
        sel = check_layers(layers, len(self.layers))
        warn_low_precision(self.dtype)
        xs = self.mixer_inputs(input_ids, sel, segment_pos)
        kw = {} if segment_pos is None else {"segment_pos": segment_pos}
        return [self.layers[i].mixer.as_operator(xs[i], variant, **kw) for i in sel]

    def info(self) -> dict:
        """Family, depth, widths, vocabulary, parameter count and dtype."""
        return {"family": self.family, "layers": len(self.layers), **self.describe(),
                "vocab_size": self.config.vocab_size, "parameters": self.num_params,
                "dtype": str(self.dtype)}


__all__ = ["LanguageModel"]
