"""Bamba checkpoints: the shape table (HF names), HF tensors <-> params, and
``init_params`` drawn from the same table.

HF layout: ``model.embed_tokens.weight``, ``model.final_layernorm.weight``, ``lm_head.weight``
(unless tied); per layer ``model.layers.{i}.{input_layernorm,pre_ff_layernorm}.weight``,
``feed_forward.{gate,up,down}_proj.*`` and the mixer, ``mamba.*`` (HF Mamba-2 mixer names)
or ``self_attn.{q,k,v,o}_proj.*``.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, hf_from_params, init_from_table, params_from_hf
from ..mamba.checkpoint import init_rule as mamba_init_rule
from ..mamba2.checkpoint import mixer_shapes as mamba_shapes
from .config import Config

MIXER_PREFIX = {"mamba": "mamba.", "attention": "self_attn.", "parallel": ""}


def attention_shapes(cfg: Config) -> dict:
    """Local tensor names -> shapes of one attention mixer (input width
    ``cfg.attention_input_size``, output ``hidden_size``)."""
    D, H, KV, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    D_in = cfg.attention_input_size
    m = {"q_proj.weight": (H * d, D_in), "k_proj.weight": (KV * d, D_in), "v_proj.weight": (KV * d, D_in),
         "o_proj.weight": (D, H * d)}
    if cfg.attention_bias:
        m.update({"q_proj.bias": (H * d,), "k_proj.bias": (KV * d,), "v_proj.bias": (KV * d,), "o_proj.bias": (D,)})
    return m


def mlp_shapes(cfg: Config) -> dict:
    D, F = cfg.hidden_size, cfg.intermediate_size
    m = {"gate_proj.weight": (F, D), "up_proj.weight": (F, D), "down_proj.weight": (D, F)}
    if cfg.mlp_bias:
        m.update({"gate_proj.bias": (F,), "up_proj.bias": (F,), "down_proj.bias": (D,)})
    return m


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a Bamba-like checkpoint names its tensors (GraniteMoeHybrid and Jamba have the
    same parameter tree under other names).

    Attributes:
      family: the model_type, for messages.
      final_norm: the final norm's tensor name.
      ffn_norm: the local name of each layer's norm before the feed-forward part.
      ffn_prefix: the local prefix of the feed-forward tensors (``""``: at layer level), or
        ``(Config, layer) -> prefix`` where it depends on the layer (Kimi-Linear's dense layers).
      ffn_shapes: ``(Config, layer) -> {local name: shape}`` of that layer's feed-forward
        tensors as stored.
      mamba_shapes: ``mixer config -> {local name: shape}`` of a Mamba mixer.
      ffn_params: ``(Config, layer, {local name: tensor}) -> feed_forward params`` (tensors
        as stored -> the tree; default: as they are).
      ffn_tensors: the inverse of ``ffn_params``.
      mixer_prefix: ``{kind: the local prefix of that kind's mixer tensors}``.
      mixer_tables: ``(Config, Layout) -> {kind: {name under the prefix: shape}}``.
      embed: the embedding's tensor name.
      mixer_norm: the local name of each layer's norm before the mixer.
      extra_norms: ``Config -> {key in the layer's params: local name}`` of further per-layer
        norm weights (LFM3's norms after the mixer and the feed-forward part).
    """

    family: str
    final_norm: str
    ffn_norm: str
    ffn_prefix: str | Callable
    ffn_shapes: Callable
    mamba_shapes: Callable = mamba_shapes
    ffn_params: Callable = lambda cfg, i, t: t
    ffn_tensors: Callable = lambda cfg, i, p: p
    mixer_prefix: dict = dataclasses.field(default_factory=lambda: dict(MIXER_PREFIX))
    mixer_tables: Callable = None  # None: ``mixer_tables`` below
    embed: str = "model.embed_tokens.weight"
    mixer_norm: str = "input_layernorm.weight"
    extra_norms: Callable = lambda cfg: {}

    def ffn_prefix_at(self, cfg, i: int) -> str:
        """The local prefix of layer ``i``'s feed-forward tensors."""
        return self.ffn_prefix(cfg, i) if callable(self.ffn_prefix) else self.ffn_prefix


LAYOUT = Layout("bamba", "model.final_layernorm.weight", "pre_ff_layernorm.weight", "feed_forward.",
                lambda cfg, i: mlp_shapes(cfg))


def mixer_tables(cfg, layout: Layout) -> dict:
    """``{kind: {name under MIXER_PREFIX[kind]: shape}}`` of the mixer kinds in ``cfg.layer_types``:
    ``"mamba"``, ``"attention"``, and ``"parallel"`` (both in one layer, Falcon-H1: the
    Mamba names under ``mamba.``, the attention ones under ``self_attn.``)."""
    kinds = set(cfg.layer_types)
    mamba = layout.mamba_shapes(cfg.mixer_config) if kinds & {"mamba", "parallel"} else {}
    attention = attention_shapes(cfg) if kinds & {"attention", "parallel"} else {}
    return {"mamba": mamba, "attention": attention,
            "parallel": {**{MIXER_PREFIX["mamba"] + k: s for k, s in mamba.items()},
                         **{MIXER_PREFIX["attention"] + k: s for k, s in attention.items()}}}


def layout_mixers(cfg, layout: Layout) -> dict:
    """``layout``'s mixer tables (``Layout.mixer_tables``, default ``mixer_tables``)."""
    return (layout.mixer_tables or mixer_tables)(cfg, layout)


def layout_shapes(cfg, layout: Layout) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes of a checkpoint in ``layout``."""
    D, V = cfg.hidden_size, cfg.vocab_size
    req = {layout.embed: (V, D), layout.final_norm: (D,)}
    mixers = layout_mixers(cfg, layout)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        req[p + layout.mixer_norm] = (D,)
        req[p + layout.ffn_norm] = (D,)
        req.update({p + name: (D,) for name in layout.extra_norms(cfg).values()})
        req.update({p + layout.mixer_prefix[kind] + k: s for k, s in mixers[kind].items()})
        req.update({p + layout.ffn_prefix_at(cfg, i) + k: s for k, s in layout.ffn_shapes(cfg, i).items()})
    opt = {}
    if cfg.tie_word_embeddings:
        opt["lm_head.weight"] = (V, D)
    else:
        req["lm_head.weight"] = (V, D)
    return req, opt


def sub(tensors: dict, prefix: str) -> dict:
    """The tensors under ``prefix``, with it removed."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def layout_params(cfg, tensors: dict, layout: Layout) -> dict:
    """HF tensors (already checked) in ``layout`` -> the ``LM`` parameter tree: per layer
    ``{"input_layernorm", "pre_ff_layernorm", "mixer", "feed_forward"}`` (local names) and the
    layout's extra norms."""
    layers = []
    mixers = layout_mixers(cfg, layout)
    for i, kind in enumerate(cfg.layer_types):
        p, f = f"model.layers.{i}.", layout.ffn_prefix_at(cfg, i)
        layers.append({"input_layernorm": tensors[p + layout.mixer_norm],
                       "pre_ff_layernorm": tensors[p + layout.ffn_norm],
                       **{key: tensors[p + name] for key, name in layout.extra_norms(cfg).items()},
                       "mixer": {k: tensors[p + layout.mixer_prefix[kind] + k] for k in mixers[kind]},
                       "feed_forward": layout.ffn_params(cfg, i, {k: tensors[p + f + k]
                                                                  for k in layout.ffn_shapes(cfg, i)})})
    return {"embed_tokens": tensors[layout.embed], "layers": layers,
            "final_layernorm": tensors[layout.final_norm],
            "lm_head": None if cfg.tie_word_embeddings else tensors["lm_head.weight"]}


def layout_tensors(cfg, params: dict, layout: Layout) -> dict:
    """The ``LM`` parameter tree -> HF tensors in ``layout`` (unchecked)."""
    t = {layout.embed: params["embed_tokens"], layout.final_norm: params["final_layernorm"]}
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
        p = f"model.layers.{i}."
        t[p + layout.mixer_norm] = layer["input_layernorm"]
        t[p + layout.ffn_norm] = layer["pre_ff_layernorm"]
        t.update({p + name: layer[key] for key, name in layout.extra_norms(cfg).items()})
        t.update({p + layout.mixer_prefix[kind] + k: v for k, v in layer["mixer"].items()})
        t.update({p + layout.ffn_prefix_at(cfg, i) + k: v
                  for k, v in layout.ffn_tensors(cfg, i, layer["feed_forward"]).items()})
    if not cfg.tie_word_embeddings:
        if params.get("lm_head") is None:
            raise CheckpointError(f"untied {layout.family} model has no lm_head")
        t["lm_head.weight"] = params["lm_head"]
    return t


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Mamba-2's rules for the mixer tensors; norm weights near 1 (not exactly 1, so a
    misplaced weight shows in tests)."""
    if name.endswith("layernorm.weight") or name.endswith("mamba.norm.weight"):
        return 1.0 + 0.1 * g.standard_normal(shape)
    return mamba_init_rule(name, shape, g)


def layout_checkpoint(config_cls, layout: Layout, rule=init_rule) -> SimpleNamespace:
    """The checkpoint functions of a family stored in ``layout`` (Bamba, GraniteMoeHybrid,
    Jamba, Falcon-H1), with its ``config_cls``. Returns a namespace of:

    * ``expected_shapes(cfg) -> (required, optional)``: HF tensor names -> shapes;
    * ``params_from_tensors(cfg, tensors) -> params``: checked HF tensors -> the ``LM`` tree;
    * ``to_params(config dict, tensors) -> (Config, params)`` after strict checks;
    * ``from_params(cfg, params) -> (config dict, numpy tensors)``;
    * ``init_params(cfg, key, dtype=float32) -> params``: random, drawn tensor by tensor from
      the shape table with ``rule(name, shape, numpy Generator)``.
    """
    family = layout.family

    def expected_shapes(cfg) -> tuple[dict, dict]:
        """``(required, optional)`` HF tensor names -> shapes."""
        return layout_shapes(cfg, layout)

    def params_from_tensors(cfg, tensors: dict) -> dict:
        """HF tensors (already checked) -> the ``LM`` parameter tree."""
        return layout_params(cfg, tensors, layout)

    def to_params(config: dict, tensors: dict) -> tuple:
        """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
        return params_from_hf(config_cls, expected_shapes, params_from_tensors, config, tensors, family)

    def from_params(cfg, params: dict) -> tuple[dict, dict]:
        """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
        return hf_from_params(cfg, layout_tensors(cfg, params, layout), expected_shapes, family)

    def init_params(cfg, key, dtype=jnp.float32) -> dict:
        """Random parameters in the layout of ``LM``, drawn from the shape table."""
        return init_from_table(cfg, expected_shapes, rule, params_from_tensors, key, dtype)

    return SimpleNamespace(expected_shapes=expected_shapes, params_from_tensors=params_from_tensors,
                           to_params=to_params, from_params=from_params, init_params=init_params)


CHECKPOINT = layout_checkpoint(Config, LAYOUT)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
to_params, from_params, init_params = CHECKPOINT.to_params, CHECKPOINT.from_params, CHECKPOINT.init_params


__all__ = ["MIXER_PREFIX", "Layout", "LAYOUT", "attention_shapes", "mlp_shapes", "layout_mixers", "layout_shapes",
           "layout_params",
           "layout_tensors", "mixer_tables", "layout_checkpoint", "CHECKPOINT", "expected_shapes",
           "params_from_tensors", "to_params", "from_params", "init_rule", "init_params", "sub"]
