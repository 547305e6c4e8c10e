"""The language-model base every family's ``LM`` derives from: what each LM used to repeat
(``__call__``, ``tapped_logits``, ``mixer_inputs``, ``operators``, ``info``, input checks)."""
from __future__ import annotations

import functools
from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from .checks import check_input_ids, check_layers, check_tap, check_taps, count_params, warn_low_precision
from .hooks import OPERATOR_POINTS, RESIDUAL_POINTS, block_name, hook_names, parse_name
from .interventions import AttentionEdit, edit_delta
from .modules import check_variant


def query_logit_sum(logits, queries, targets=None):
    """The summed target logits ``sum_b logits[b, queries[b], t_b]`` and the targets ``t``.

    Args:
      logits: ``(B, L, vocab)``; queries: ``(B,)`` int positions; targets: ``(B,)`` int
        token ids, or None for each example's argmax at its query (piecewise constant: no
        gradient flows through it).
    Returns:
      ``(scalar, t (B,) int32)``.
    """
    rows = jnp.arange(logits.shape[0])
    picked = logits[rows, queries]
    t = jnp.argmax(jax.lax.stop_gradient(picked), axis=-1) if targets is None else targets
    return jnp.sum(picked[rows, t]), jnp.asarray(t).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("forward_fn", "cfg", "capture"))
def tapped_gradients(forward_fn, cfg, params, ids, extra: tuple, adds: dict, queries, targets=None,
                     capture: tuple = ()):
    """Gradients of ``query_logit_sum`` w.r.t. the activations added at hook points,
    forward and backward in one compiled program.

    Args:
      forward_fn, cfg: a ``LanguageModel``'s ``forward_fn`` and config (static).
      params, ids ``(B, L)``, extra: its ``forward_fn`` inputs.
      adds: ``{hook name: array}`` added to those activations (zeros for plain gradients).
      queries, targets: as ``query_logit_sum``.
      capture: hook names whose activations the same forward pass returns (static).
    Returns:
      ``({hook name: gradient shaped like its add}, targets (B,) int32, {captured name:
      activation})``.
    """
    def picked(adds):
        logits, captured = forward_fn(params, ids, *extra, cfg=cfg, capture=capture, adds=adds)
        total, t = query_logit_sum(logits, queries, targets)
        return total, (t, captured)

    grads, (t, captured) = jax.grad(picked, has_aux=True)(adds)
    return grads, t, captured


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
      forward_fn: jitted ``(params, ids, *extra, cfg=, capture=, adds=, sets=) -> (logits,
        captured)``: ``capture`` a tuple of hook names, ``captured`` ``{name: activation}``,
        ``adds`` / ``sets`` ``{name: array}`` added to / replacing activations (``nn.hooks``).
      takes_segment_pos: whether the model takes packed-document positions.
      hook_points: the per-layer forward hook points (``nn.hooks.RESIDUAL_POINTS`` or
        ``MID_POINTS`` for layers with an MLP after the mixer).
    """

    family: ClassVar[str] = ""
    label: ClassVar[str] = ""
    variants: ClassVar[tuple[str, ...]] = ("full",)
    forward_fn: ClassVar[Any]
    takes_segment_pos: ClassVar[bool] = False
    hook_points: ClassVar[tuple[str, ...]] = RESIDUAL_POINTS

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
        ids, extra, adds = self.tap_inputs(input_ids, taps, segment_pos)
        return self.forward(ids, extra, adds=adds)[0]

    def tap_inputs(self, input_ids, taps: dict, segment_pos=None) -> tuple:
        """``(ids, extra inputs, adds)``: the checked inputs and the checked ``taps`` as
        ``forward``'s ``adds`` (``{"blocks.{i}.mixer.hook_out": array}``)."""
        ids, extra = self.inputs(input_ids, segment_pos)
        B, L = ids.shape
        taps = check_taps(taps, lambda i: self.tap_shape(i, B, L)[0], len(self.layers),
                          lambda i: self.tap_shape(i, B, L)[1])
        return ids, extra, {block_name(i, "mixer.hook_out"): t for i, t in taps.items()}

    def logit_gradients(self, input_ids, taps: dict, queries, targets=None, segment_pos=None, mixer_inputs=None):
        """Gradients of ``sum_b logits[b, queries[b], targets[b]]`` w.r.t. ``taps`` (as in
        ``tapped_logits``: ``{layer: array}`` added to those layers' operator outputs, zeros
        for plain gradients), in one compiled program (``tapped_gradients``).

        Args:
          input_ids: ``(B, L)`` token ids; queries: ``(B,)`` positions (not range-checked:
            may be traced); targets: ``(B,)`` token ids, or None for each example's argmax
            at its query.
          mixer_inputs: layers whose mixer inputs the same forward pass returns as well
            (what ``mixer_inputs`` gives), so operators need no second forward pass.
        Returns:
          ``({layer: gradient shaped like its tap}, targets (B,) int32)``; with
          ``mixer_inputs``, ``(gradients, targets, {layer: (B, L, d_model)})``.
        """
        ids, extra, adds = self.tap_inputs(input_ids, taps, segment_pos)
        sel = () if mixer_inputs is None else sorted(set(check_layers(mixer_inputs, len(self.layers))))
        capture = tuple(block_name(i, "mixer.hook_in") for i in sel)
        grads, t, cap = tapped_gradients(type(self).forward_fn, self.config, self.params(), ids, extra, adds, queries,
                                         targets, capture)
        grads = {parse_name(n)[0]: g for n, g in grads.items()}
        if mixer_inputs is None:
            return grads, t
        return grads, t, {i: cap[block_name(i, "mixer.hook_in")] for i in sel}

    def forward(self, ids, extra: tuple = (), capture=(), adds=None, sets=None):
        """The jitted forward on checked inputs: ``(logits (B, L, vocab), {name: activation})``."""
        return type(self).forward_fn(self.params(), ids, *extra, cfg=self.config,
                                     capture=tuple(sorted(set(capture))), adds=adds or None, sets=sets or None)

    def mixer_inputs(self, input_ids, layers=None, segment_pos=None) -> dict[int, jax.Array]:
        """``{layer: (B, L, d_model)}`` inputs of the selected layers' token mixers."""
        ids, extra = self.inputs(input_ids, segment_pos)
        sel = sorted(set(check_layers(layers, len(self.layers))))
        _, cap = self.forward(ids, extra, capture=[block_name(i, "mixer.hook_in") for i in sel])
        return {i: cap[block_name(i, "mixer.hook_in")] for i in sel}

    def operators(self, input_ids, layers=None, variant: str = "full", segment_pos=None) -> list:
        """One operator per selected layer (all by default), in the order asked:
        ``layers[i].mixer.as_operator`` of each layer's mixer input."""
        self.check_variant(variant)
        sel = check_layers(layers, len(self.layers))
        warn_low_precision(self.dtype)
        xs = self.mixer_inputs(input_ids, sel, segment_pos)
        return [self.operator_of(i, xs[i], variant, segment_pos) for i in sel]

    def operator_of(self, layer: int, x, variant: str = "full", segment_pos=None):
        """Layer ``layer``'s operator for its mixer input ``x (B, L, d_model)``."""
        kw = {} if segment_pos is None else {"segment_pos": segment_pos}
        return self.layers[layer].mixer.as_operator(x, variant, **kw)

    # ------------------------------------------------------------ hooks
    def hook_names(self, operator_points: bool = True) -> list[str]:
        """Every hook name of this model (see ``nn.hooks``): the forward points (``hook_embed``,
        ``blocks.{i}.hook_resid_pre``, ``.mixer.hook_in``, ``.mixer.hook_out``, ...) and, with
        ``operator_points``, those ``run_with_cache`` reads off each layer's operator
        (``.mixer.hook_values``, ``.hook_offset``, ``.hook_gate``, ``.hook_log_decay``,
        ``.hook_pattern``; gate/decay only where the layer's core has them)."""
        names = hook_names(len(self.layers), self.hook_points)
        if operator_points:
            names += [block_name(i, p) for i in range(len(self.layers)) for p in OPERATOR_POINTS]
        return names

    def hook_shape(self, name: str, B: int, L: int) -> tuple:
        """Shape of forward hook ``name``'s activation for a ``(B, L)`` input."""
        layer, point = parse_name(name)
        if point == "mixer.hook_out":
            return tuple(self.tap_shape(layer, B, L)[0])
        return (B, L, self.config.hidden_size)

    def check_hook_names(self, names, forward_only: bool = True) -> list[str]:
        """``names`` (a str or a list of str) checked against ``hook_names``; ValueError
        naming the first unknown one."""
        names = [names] if isinstance(names, str) else list(names)
        known = set(self.hook_names(operator_points=not forward_only))
        for n in names:
            if not isinstance(n, str) or n not in known:
                what = "forward hook" if forward_only else "hook"
                raise ValueError(f"unknown {what} name {n!r} for this {len(self.layers)}-layer {self.label} model; "
                                 f"see model.hook_names() (e.g. {self.hook_names()[1]!r})")
        return names

    def check_hook_arrays(self, arrays, B: int, L: int, what: str) -> dict:
        """``{name: array}`` with known forward names and exactly their activation shapes."""
        if arrays is None:
            return {}
        if not isinstance(arrays, dict):
            raise ValueError(f"{what} must be a dict {{hook name: array}}, got {type(arrays).__name__}")
        self.check_hook_names(list(arrays))
        return {n: check_tap(a, self.hook_shape(n, B, L), "", name=f"{what}[{n!r}]", owner=f"{n}'s",
                             of="activation")
                for n, a in arrays.items()}

    def run_with_hooks(self, input_ids, adds: dict | None = None, sets: dict | None = None, segment_pos=None):
        """Logits ``(B, L, vocab)`` with activations edited at named hook points.

        Args:
          input_ids: ``(B, L)`` token ids.
          adds: ``{hook name: array}`` added to those activations (exact shapes, see
            ``hook_shape``), e.g. a steering vector at ``blocks.3.hook_resid_pre``.
          sets: ``{hook name: array}`` replacing those activations (activation patching:
            take them from ``run_with_cache`` of another input); applied before ``adds``.
        """
        ids, extra = self.inputs(input_ids, segment_pos)
        B, L = ids.shape
        adds = self.check_hook_arrays(adds, B, L, "adds")
        sets = self.check_hook_arrays(sets, B, L, "sets")
        return self.forward(ids, extra, adds=adds, sets=sets)[0]

    def run_with_cache(self, input_ids, names: Sequence[str] | Callable[[str], bool] | None = None,
                       adds: dict | None = None, sets: dict | None = None, segment_pos=None):
        """Logits and the activations at named hook points, in one forward pass.

        Args:
          input_ids: ``(B, L)`` token ids.
          names: hook names (``hook_names()``), a predicate on names, or None: every
            name except ``mixer.hook_pattern`` (the dense ``(B, C, L, L)`` H; ask for it by name).
          adds, sets: edits as in ``run_with_hooks`` (the cache shows the edited run).
        Returns:
          ``(logits (B, L, vocab), {name: array})``. Forward points come from the forward
          pass; operator points (``mixer.hook_values (B, C, L)``, ``hook_offset``,
          ``hook_gate``, ``hook_log_decay``, ``hook_pattern``) from
          ``layers[i].mixer.as_operator`` of the captured mixer input (variant ``"full"``,
          exact), which is why they are cached but not edited or differentiated here.
        """
        ids, extra = self.inputs(input_ids, segment_pos)
        B, L = ids.shape
        every = self.hook_names()
        explicit = names is not None and not callable(names)
        if names is None:
            names = [n for n in every if not n.endswith("mixer.hook_pattern")]
        elif callable(names):
            names = [n for n in every if names(n)]
        else:
            names = self.check_hook_names(names, forward_only=False)
        adds = self.check_hook_arrays(adds, B, L, "adds")
        sets = self.check_hook_arrays(sets, B, L, "sets")
        fwd_points = set(self.hook_points) | {"hook_embed"}
        op_names = [n for n in names if parse_name(n)[1] not in fwd_points]
        op_layers = sorted({parse_name(n)[0] for n in op_names})
        capture = [n for n in names if parse_name(n)[1] in fwd_points]
        capture += [block_name(i, "mixer.hook_in") for i in op_layers]
        logits, cap = self.forward(ids, extra, capture=capture, adds=adds, sets=sets)
        cache = {n: cap[n] for n in names if n in cap}
        if op_layers:
            warn_low_precision(self.dtype)
        for i in op_layers:
            op = self.operator_of(i, cap[block_name(i, "mixer.hook_in")], "full", segment_pos)
            fields = {"mixer.hook_values": op.values, "mixer.hook_offset": op.offset,
                      **{f"mixer.hook_{k}": v for k, v in op.core.named_factors().items()}}
            for n in op_names:
                layer, point = parse_name(n)
                if layer != i:
                    continue
                if point == "mixer.hook_pattern":
                    cache[n] = op.materialize()
                elif point in fields:
                    cache[n] = fields[point]
                elif explicit:
                    raise ValueError(f"layer {i}'s operator ({type(op.core).__name__}) has no {point.split('_', 1)[1]}: "
                                     f"it has {sorted(fields)}")
        return logits, cache

    def gradients(self, input_ids, fn: Callable, names, adds: dict | None = None, sets: dict | None = None,
                  segment_pos=None) -> dict:
        """Gradients of a scalar ``fn(logits)`` with respect to the activations at forward hook
        points (``hook_embed`` for the input embeddings, the residual stream, mixer inputs
        and outputs).

        Args:
          input_ids: ``(B, L)`` token ids; fn: ``(B, L, vocab) float32 -> scalar``.
          names: forward hook names; adds, sets: edits as in ``run_with_hooks``.
        Returns:
          ``{name: array}`` of each activation's shape (``hook_shape``), float32.
        """
        ids, extra = self.inputs(input_ids, segment_pos)
        B, L = ids.shape
        names = self.check_hook_names(names)
        adds = self.check_hook_arrays(adds, B, L, "adds")
        sets = self.check_hook_arrays(sets, B, L, "sets")
        zeros = {n: jnp.zeros(self.hook_shape(n, B, L), jnp.float32) for n in names}

        def target(z):
            merged = {**adds, **{n: z[n] + adds[n] if n in adds else z[n] for n in z}}
            out = jnp.asarray(fn(self.forward(ids, extra, adds=merged, sets=sets)[0]))
            if out.shape != ():
                raise ValueError(f"fn must return a scalar, got shape {out.shape}")
            return out

        return jax.grad(target)(zeros)

    # ------------------------------------------------------------ interventions
    def attention_edits(self, input_ids, edits: Sequence[AttentionEdit], segment_pos=None) -> dict:
        """``adds`` for ``run_with_hooks`` / ``run_with_cache`` that scale the chosen entries
        of the layers' operators: ``{blocks.{l}.mixer.hook_out: delta}`` with ``delta`` the
        exact change ``(s - 1) sum_j H[c, i, j] v[c, j]`` (``nn.interventions``). Layers are
        edited in order; each layer's operator is built from its input in the run with the
        earlier layers' edits applied."""
        ids, extra = self.inputs(input_ids, segment_pos)
        if isinstance(edits, AttentionEdit):
            edits = [edits]
        n = len(self.layers)
        by_layer: dict[int, list] = {}
        for e in edits:
            if not isinstance(e, AttentionEdit):
                raise ValueError(f"edits must be AttentionEdit objects, got {type(e).__name__}")
            (layer,) = check_layers([e.layer], n)
            by_layer.setdefault(layer, []).append(e)
        warn_low_precision(self.dtype)
        adds = {}
        for layer in sorted(by_layer):
            name = block_name(layer, "mixer.hook_in")
            x = self.forward(ids, extra, capture=[name], adds=adds)[1][name]
            op = self.operator_of(layer, x, "full", segment_pos)
            adds[block_name(layer, "mixer.hook_out")] = edit_delta(op, by_layer[layer])
        return adds

    def scale_attention(self, input_ids, edits: Sequence[AttentionEdit], segment_pos=None):
        """Logits ``(B, L, vocab)`` with entries of the layers' implicit attention scaled
        (``AttentionEdit``: layer, keys / queries / entries, channels, scale)."""
        adds = self.attention_edits(input_ids, edits, segment_pos)
        ids, extra = self.inputs(input_ids, segment_pos)
        return self.forward(ids, extra, adds=adds)[0]

    def knockout(self, input_ids, layer: int, keys=None, queries=None, entries=None, channels=None,
                 segment_pos=None):
        """Logits ``(B, L, vocab)`` with entries of layer ``layer``'s ``H`` set to zero: key
        columns ``keys`` x query rows ``queries`` (None = all) or explicit ``entries``
        ``[(i, j)]``, in ``channels`` (None = all channels / heads)."""
        return self.scale_attention(input_ids, [AttentionEdit(layer, keys, queries, entries, channels, 0.0)],
                                    segment_pos)

    def info(self) -> dict:
        """Family, depth, widths, vocabulary, parameter count and dtype."""
        return {"family": self.family, "layers": len(self.layers), **self.describe(),
                "vocab_size": self.config.vocab_size, "parameters": self.num_params,
                "dtype": str(self.dtype)}


__all__ = ["LanguageModel", "AttentionEdit", "query_logit_sum", "tapped_gradients"]
