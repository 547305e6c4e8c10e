"""A small causal transformer with LaS attention (Zimerman & Wolf, "Viewing Transformers
Through the Lens of Long Convolutions Layers"): the block, its exact explicit operator, a
language model and a classifier head, random initialisation and safetensors save / load.

Layer (pre-norm): ``h = h + o_proj(LaS(LN_1(h)))``, ``h = h + fc_out(gelu(fc_in(LN_2(h))))``;
embeddings in, final LayerNorm, tied head out (``num_labels == 0``) or a classifier head
``score`` on the mean of the positions up to ``i`` (``classifier_pooling="mean"``) or on
position ``i`` itself (``"last"``), so the classifier's logits are ``(B, L, num_labels)``
and stay causal; the class of a whole sequence is ``logits[:, -1]`` (``LaSLM.classify``).
No positional embeddings: the decay (ELD or ALiBi) and the causal mask carry position.

The attention of head ``c`` (``ops.las``): ``H_c = AP(SF(exp(-alpha_c D_L) * (q k^T / sqrt(d))))``
with the flags of ``Config``: ``eld`` (the ELD multiplication, ``alpha_c`` from ``B``),
``alibi`` (ALiBi's additive ``-m_h D_L``), ``pool`` (the AP window ``P``; 1 = none), ``chunk``
(LaS-chunk blocks). ``VARIANTS`` names the paper's models: ``las``, ``l_attention`` (ELD
only), ``s_attention`` (AP only), ``vanilla``, ``alibi``, ``las_chunk``.

The operator of a layer is an ``AttentionOperator`` over a ``LaSCore``: channels = heads,
``materialize()`` the pooled, masked matrices ``(B, heads, L, L)``, ``values`` the value
vectors ``(B, heads, L, head_dim)``; ``H v`` equals the block's per-head output (before
``o_proj``), which the forward computes another way: the softmax matrix applied to shifted,
averaged values (``ops.pooled_apply``), never the pooled matrix.

Later parts of the LaS issue (training on Select / CumSum / CumMax and a long-range task)
take ``Config``, ``init_params`` and ``lm_forward`` (pure, jittable, differentiable in the
parameters) as they are; ``stack_forward`` runs the layers on real-valued inputs.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..families.rwkv.block import layer_norm  # nn.LayerNorm (float32 statistics)
from ..nn import LanguageModel, Mixer, Weights, check_tensors, fan_in_normal, held, random_tensors
from ..nn.checkpoint import CheckpointError, read_hf_dir, write_hf_dir
from ..nn.config import HFConfig
from ..nn.hooks import MID_POINTS, ForwardHooks, between_layers, no_hook, out_hook
from ..operator import AttentionOperator, LaSCore
from ..ops import (POOL_ALIGNS, alibi_slopes, block_start, check_chunk, check_pool, embed, full_precision, las_alphas,
                   las_softmax, linear, mark_nan, pooled_apply, zero_nan)

f32 = jnp.float32
MODEL_TYPE = "las_transformer"
POOLINGS = ("mean", "last")
# The paper's models (Sec. 5.2, Tab. 4): the flags each sets. ``pool`` and ``chunk`` take the
# config's values where the variant uses them.
VARIANTS = {
    "las": dict(eld=True, alibi=False, smooth=True, chunked=False),
    "l_attention": dict(eld=True, alibi=False, smooth=False, chunked=False),
    "s_attention": dict(eld=False, alibi=False, smooth=True, chunked=False),
    "vanilla": dict(eld=False, alibi=False, smooth=False, chunked=False),
    "alibi": dict(eld=False, alibi=True, smooth=False, chunked=False),
    "las_chunk": dict(eld=True, alibi=False, smooth=True, chunked=True),
}


@dataclasses.dataclass(frozen=True)
class Config(HFConfig):
    """The LaS transformer's hyper-parameters (written to ``config.json`` by ``save``).

    Attributes:
      vocab_size, hidden_size, num_hidden_layers, num_attention_heads: sizes (the heads
        divide ``hidden_size``).
      intermediate_size: MLP width (0: ``4 * hidden_size``).
      eld: multiply the scaled scores by ``exp(-alpha_c D_L)``.
      B: the paper's hyper-parameter in (0, 1) setting ``alpha_c`` (``ops.las_alphas``;
        Tab. 9 uses 1e-3 and 1e-4).
      alphas: explicit per-head ``alpha_c`` (finite, >= 0) instead of those from ``B``.
      alibi: add ALiBi's ``-m_h D_L`` (``ops.alibi_slopes``).
      pool: the average-pooling window ``P`` (odd; 1: no smoothing; Tab. 9 uses 3 and 5).
      pool_align: ``"causal"`` (window ``[j, j + P - 1]``) or ``"centered"`` (``[j - r, j + r]``
        then masked); see ``ops.las``.
      chunk: LaS-chunk block length (None: full causal attention; the paper uses 128).
      num_labels: 0 for the language model, else the classes of the classifier head.
      classifier_pooling: ``"mean"`` or ``"last"`` (classifier only).
      layer_norm_epsilon: of every LayerNorm.
    """

    model_type: ClassVar[str] = MODEL_TYPE
    architecture: ClassVar[str] = "LaSTransformer"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 0
    eld: bool = True
    B: float = 1e-3
    alphas: tuple | None = None
    alibi: bool = False
    pool: int = 3
    pool_align: str = "causal"
    chunk: int | None = None
    num_labels: int = 0
    classifier_pooling: str = "mean"
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it and its value)."""
        self.check_ints("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        self.check_ints("intermediate_size", "num_labels", low=0)
        self.check_bools("eld", "alibi")
        self.check_floats("layer_norm_epsilon", low=0.0)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads}): each head reads hidden_size / heads features")
        las_alphas(self.num_attention_heads, self.B)  # B in (0, 1), named in the error
        object.__setattr__(self, "B", float(self.B))
        if self.alphas is not None:
            a = np.asarray(self.alphas, dtype=object)
            ok = a.ndim == 1 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in a)
            if not ok or a.shape[0] != self.num_attention_heads or not all(math.isfinite(x) and x >= 0 for x in a):
                raise ValueError(f"alphas must list one finite alpha_c >= 0 per head ({self.num_attention_heads} "
                                 f"heads), got {self.alphas!r}")
            if not self.eld:
                raise ValueError("alphas are given but eld is false: the ELD rates would not be used")
            object.__setattr__(self, "alphas", tuple(float(x) for x in a))
        check_pool(self.pool, self.pool_align)
        object.__setattr__(self, "chunk", check_chunk(self.chunk))
        self.check_choice("classifier_pooling", POOLINGS, "LaS")
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)

    @classmethod
    def variant(cls, name: str, pool: int = 3, chunk: int = 128, **kw) -> "Config":
        """The config of one of the paper's models (``VARIANTS``): e.g.
        ``Config.variant("l_attention", vocab_size=32, hidden_size=16)``. ``pool`` is used by
        the smoothed variants, ``chunk`` by ``las_chunk``; ``kw`` are the other fields."""
        if name not in VARIANTS:
            raise ValueError(f"LaS variant must be one of {list(VARIANTS)}, got {name!r}")
        f = VARIANTS[name]
        return cls(eld=f["eld"], alibi=f["alibi"], pool=pool if f["smooth"] else 1,
                   chunk=chunk if f["chunked"] else None, **kw)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kind(self) -> str:
        """The ``VARIANTS`` name these flags make (``"custom"`` for other combinations)."""
        f = dict(eld=self.eld, alibi=self.alibi, smooth=self.pool > 1, chunked=self.chunk is not None)
        return next((n for n, v in VARIANTS.items() if v == f), "custom")

    def head_alphas(self):
        """``(heads,)`` float32 ELD rates, or None without ELD."""
        if not self.eld:
            return None
        a = self.alphas if self.alphas is not None else las_alphas(self.num_attention_heads, self.B)
        return jnp.asarray(np.asarray(a, np.float64), f32)

    def head_slopes(self):
        """``(heads,)`` float32 ALiBi slopes, or None without ALiBi."""
        return jnp.asarray(alibi_slopes(self.num_attention_heads), f32) if self.alibi else None


# ----------------------------------------------------------------------------- pure functions

def mixer_parts(p: dict, h, cfg: Config) -> dict:
    """Scaled queries, keys and values ``(B, heads, L, head_dim)`` of the LaS block."""
    B, L, _ = h.shape
    heads = lambda t: jnp.swapaxes(t.reshape(B, L, cfg.num_attention_heads, cfg.head_dim), 1, 2)
    q = heads(linear(h, p["q_proj.weight"]))
    return dict(q=q * jnp.asarray(cfg.head_dim ** -0.5, q.dtype), k=heads(linear(h, p["k_proj.weight"])),
                v=heads(linear(h, p["v_proj.weight"])))


def attend(a: dict, cfg: Config):
    """Per-head LaS attention output ``(B, heads, L, head_dim)`` of the parts ``a``.

    The pooling is applied to the values, never forming the pooled matrix (``ops.pooled_apply``):
    ``"causal"``: ``SF(...) @ pool_values(v)`` (the values averaged over their last ``P``
    positions); ``"centered"``: one product per window offset. The operator forms
    ``AP(SF(...))`` itself (``ops.las_probs``), so ``H v == output`` is a real check.
    NaN stays causal (``ops.nan``): a NaN key or value reaches the rows at and after it in its
    block (LaS-chunk), a NaN query its own row."""
    q, k, v = a["q"], a["k"], a["v"]
    seen = jnp.cumsum((jnp.isnan(k).any(-1) | jnp.isnan(v).any(-1)).astype(jnp.int32), axis=2)
    start = block_start(q.shape[2], cfg.chunk)
    before = jnp.where(start > 0, jnp.take(seen, jnp.maximum(start - 1, 0), axis=2), 0)
    bad = (seen > before) | jnp.isnan(q).any(-1)   # a NaN key / value earlier in the query's block
    q, k, v = zero_nan(q).astype(f32), zero_nan(k).astype(f32), zero_nan(v).astype(f32)
    S = las_softmax(q, k, cfg.head_alphas(), cfg.head_slopes(), cfg.chunk)
    o = pooled_apply(S, v, cfg.pool, cfg.chunk, cfg.pool_align)
    return mark_nan(o.astype(a["v"].dtype), bad[..., None])


def mixer_inner(p: dict, h, cfg: Config):
    """The block's per-head output before ``o_proj``: ``(B, heads, L, head_dim)``."""
    return attend(mixer_parts(p, h, cfg), cfg)


def mixer_forward(p: dict, h, cfg: Config, hook=None):
    """The LaS attention block ``(B, L, d_model) -> (B, L, d_model)``; ``hook``: optional
    ``(B, heads, L, head_dim) -> same`` on the per-head output (``mixer.hook_out``)."""
    o = mixer_inner(p, h, cfg)
    if hook is not None:
        o = hook(o)
    B, H, L, d = o.shape
    return linear(jnp.swapaxes(o, 1, 2).reshape(B, L, H * d), p["o_proj.weight"])


def mixer_operator(p: dict, h, cfg: Config, variant: str = "full") -> AttentionOperator:
    """The block's exact operator: ``AttentionOperator`` over a ``LaSCore`` (channels = heads;
    ``materialize()`` the pooled, masked LaS matrices; ``H v`` = the per-head output)."""
    a = mixer_parts(p, h, cfg)
    values = a["v"].astype(f32)
    core = LaSCore(q=a["q"].astype(f32), k=a["k"].astype(f32), alpha=cfg.head_alphas(), slope=cfg.head_slopes(),
                   pool=cfg.pool, chunk=cfg.chunk, align=cfg.pool_align)
    return AttentionOperator(values=values, offset=jnp.zeros_like(values), output=attend(a, cfg).astype(f32),
                             core=core)


def mlp(layer: dict, x):
    """``fc_out(gelu(fc_in(x)))`` (exact GELU)."""
    u = linear(x, layer["fc_in.weight"], layer["fc_in.bias"])
    return linear(jax.nn.gelu(u, approximate=False), layer["fc_out.weight"], layer["fc_out.bias"])


def layer_forward(layer: dict, h, cfg: Config, hook=None):
    """One pre-norm layer ``(B, L, d_model) -> (B, L, d_model)`` with hook points ``MID_POINTS``."""
    hook = hook or no_hook
    eps = cfg.layer_norm_epsilon
    h = hook("hook_resid_pre", h)
    x = hook("mixer.hook_in", layer_norm(h, layer["norm_1.weight"], layer["norm_1.bias"], eps))
    h = hook("hook_resid_mid", h + mixer_forward(layer["mixer"], x, cfg, out_hook(hook)))
    h = h + mlp(layer, layer_norm(h, layer["norm_2.weight"], layer["norm_2.bias"], eps))
    return hook("hook_resid_post", h)


def head(params: dict, h, cfg: Config):
    """Logits ``(B, L, vocab)`` (tied embeddings) or ``(B, L, num_labels)`` (classifier on the
    causal mean of the positions up to ``i``, or on position ``i``), float32."""
    h = layer_norm(h, params["norm_f.weight"], params["norm_f.bias"], cfg.layer_norm_epsilon)
    if cfg.num_labels == 0:
        return (h @ params["embeddings"].T).astype(f32)
    if cfg.classifier_pooling == "mean":
        n = jnp.arange(1, h.shape[1] + 1, dtype=f32)[None, :, None]
        h = (jnp.cumsum(h.astype(f32), axis=1) / n).astype(h.dtype)
    return linear(h, params["score.weight"], params["score.bias"]).astype(f32)


def lm_forward(params: dict, ids, cfg: Config, capture: tuple = (), adds=None, sets=None):
    """``ids (B, L) -> (logits float32, {name: activation})`` with the hook edits of
    ``nn.hooks.ForwardHooks`` (``capture`` names, ``adds`` / ``sets`` ``{name: array}``)."""
    hooks = ForwardHooks(capture, adds, sets)
    h = hooks("hook_embed", embed(params["embeddings"], ids))
    return head(params, stack_forward(params["layers"], h, cfg, hooks), cfg), hooks.captured


def stack_forward(layers: list, h, cfg: Config, hooks=None):
    """The layers alone: ``h (B, L, d_model)`` -> ``(B, L, d_model)`` before the final norm, for
    inputs that are not token ids (real-valued sequences: put your own projection in front and
    your own head after). ``hooks``: an optional ``nn.hooks.ForwardHooks``."""
    for i, layer in enumerate(layers):
        h = between_layers(layer_forward(layer, h, cfg, None if hooks is None else hooks.layer(i)))
    return h


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
mixer_forward_jit = jax.jit(full_precision(mixer_forward), static_argnames=("cfg",))
mixer_operator_jit = jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "variant"))


# ----------------------------------------------------------------------------- parameters

ATTN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def expected_shapes(cfg: Config) -> dict[str, tuple]:
    """The one shape table: checkpoint tensor name -> shape."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    t = {"embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        t.update({pre + "attn." + n: (D, D) for n in ATTN})
        for n in ("norm_1", "norm_2"):
            t.update({pre + n + ".weight": (D,), pre + n + ".bias": (D,)})
        t.update({pre + "mlp.fc_in.weight": (I, D), pre + "mlp.fc_in.bias": (I,),
                  pre + "mlp.fc_out.weight": (D, I), pre + "mlp.fc_out.bias": (D,)})
    t.update({"norm_f.weight": (D,), "norm_f.bias": (D,)})
    if cfg.num_labels:
        t.update({"score.weight": (cfg.num_labels, D), "score.bias": (cfg.num_labels,)})
    return t


def to_params(cfg: Config, tensors: dict) -> dict:
    """Checkpoint tensors (``expected_shapes`` names) -> the parameter tree of ``lm_forward``."""
    t = {k: jnp.asarray(v) for k, v in tensors.items()}
    layers = []
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        layer = {"mixer": {n: t[pre + "attn." + n] for n in ATTN}}
        for n in ("norm_1.weight", "norm_1.bias", "norm_2.weight", "norm_2.bias"):
            layer[n] = t[pre + n]
        for n in ("fc_in.weight", "fc_in.bias", "fc_out.weight", "fc_out.bias"):
            layer[n] = t[pre + "mlp." + n]
        layers.append(layer)
    out = {"embeddings": t["embed_tokens.weight"], "layers": layers, "norm_f.weight": t["norm_f.weight"],
           "norm_f.bias": t["norm_f.bias"]}
    if cfg.num_labels:
        out.update({"score.weight": t["score.weight"], "score.bias": t["score.bias"]})
    return out


def from_params(cfg: Config, params: dict) -> dict:
    """The inverse of ``to_params``: ``{checkpoint name: numpy array}``."""
    t = {"embed_tokens.weight": params["embeddings"], "norm_f.weight": params["norm_f.weight"],
         "norm_f.bias": params["norm_f.bias"]}
    for i, layer in enumerate(params["layers"]):
        pre = f"layers.{i}."
        t.update({pre + "attn." + n: layer["mixer"][n] for n in ATTN})
        t.update({pre + n: layer[n] for n in ("norm_1.weight", "norm_1.bias", "norm_2.weight", "norm_2.bias")})
        t.update({pre + "mlp." + n: layer[n] for n in ("fc_in.weight", "fc_in.bias", "fc_out.weight", "fc_out.bias")})
    if cfg.num_labels:
        t.update({"score.weight": params["score.weight"], "score.bias": params["score.bias"]})
    return {k: np.asarray(v) for k, v in t.items()}


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Random initialisation: LayerNorm weights 1, biases 0, embeddings ``N(0, 1)``, other
    matrices ``N(0, 1 / fan_in)``."""
    if name.endswith(".bias"):
        return np.zeros(shape)
    if "norm" in name:
        return np.ones(shape)
    if name == "embed_tokens.weight":
        return g.standard_normal(shape)
    return fan_in_normal(shape, g)


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters (``init_rule``) for ``cfg``; ``key`` an int seed or a PRNG key."""
    return to_params(cfg, random_tensors(expected_shapes(cfg), init_rule, key, dtype))


# ----------------------------------------------------------------------------- modules

class LaSMixer(Mixer):
    """The LaS attention block: ``__call__(h)`` its forward, ``as_operator(x)`` its exact
    ``AttentionOperator`` (channels = heads; see ``mixer_operator``)."""

    label = "LaS"
    forward_fn = staticmethod(mixer_forward_jit)
    operator_fn = staticmethod(mixer_operator_jit)


class LaSLayer(nnx.Module):
    """Pre-norm layer: LaS attention and a GELU MLP, each in a residual branch."""

    def __init__(self, cfg: Config, layer: dict):
        self.cfg = cfg
        self.mixer = LaSMixer(cfg, layer["mixer"])
        self.rest = Weights({k: v for k, v in layer.items() if k != "mixer"})

    def params(self) -> dict:
        return {"mixer": self.mixer.arrays(), **self.rest.arrays()}


class LaSLM(LanguageModel):
    """The LaS transformer (``LaSLM(config, params)``, params from ``init_params`` or ``load``):
    ``model(ids)`` logits, ``operators(ids)``, ``run_with_cache``, ``run_with_hooks``,
    ``knockout``, ... (``nn.LanguageModel``); ``explain`` and its metrics take it as they take
    a family's ``LM``. A classifier (``num_labels > 0``) returns ``(B, L, num_labels)``: the
    class of the prefix up to each position (``classify``: of the whole sequence)."""

    family = MODEL_TYPE
    label = "LaS transformer"
    forward_fn = staticmethod(lm_forward_jit)
    hook_points = MID_POINTS

    def __init__(self, cfg: Config, params: dict):
        self.config = cfg
        self.embeddings = nnx.Param(jnp.asarray(params["embeddings"]))
        self.layers = nnx.List([LaSLayer(cfg, l) for l in params["layers"]])
        self.top = Weights({k: v for k, v in params.items() if k not in ("embeddings", "layers")})

    def params(self) -> dict:
        return {"embeddings": held(self.embeddings), "layers": [l.params() for l in self.layers],
                **self.top.arrays()}

    def tap_shape(self, layer: int, B: int, L: int):
        c = self.config
        return (B, c.num_attention_heads, L, c.head_dim), "(batch, heads, length, head_dim)"

    def describe(self) -> dict:
        c = self.config
        return {"d_model": c.hidden_size, "heads": c.num_attention_heads, "attention": c.kind, "pool": c.pool,
                "pool_align": c.pool_align, "B": c.B if c.eld and c.alphas is None else None, "chunk": c.chunk,
                "num_labels": c.num_labels}

    def classify(self, input_ids):
        """``(B, num_labels)`` class logits of each whole sequence (classifier only)."""
        if self.config.num_labels == 0:
            raise ValueError("classify needs a classifier (num_labels > 0); this is a language model")
        return self(input_ids)[:, -1]


def init(cfg: Config, key=0) -> LaSLM:
    """A randomly initialised ``LaSLM``."""
    return LaSLM(cfg, init_params(cfg, key))


def save(path, model: LaSLM):
    """Write ``config.json`` and ``model.safetensors`` (the project's atomic writer)."""
    write_hf_dir(path, model.config.to_hf(), from_params(model.config, model.params()))


def load(path) -> LaSLM:
    """Read a directory written by ``save``; ``CheckpointError`` naming a wrong
    ``model_type``, a bad config value, or missing / unexpected / mis-shaped tensors."""
    config, tensors = read_hf_dir(path)
    if config.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{path}: model_type {config.get('model_type')!r} is not {MODEL_TYPE!r}")
    try:
        cfg = Config.from_hf(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(path)} config: {e}") from e
    check_tensors(tensors, expected_shapes(cfg), where=f"{path} checkpoint")
    return LaSLM(cfg, to_params(cfg, tensors))


__all__ = ["MODEL_TYPE", "VARIANTS", "POOLINGS", "POOL_ALIGNS", "Config", "mixer_parts", "attend",
           "mixer_inner", "mixer_forward", "mixer_operator", "mlp", "layer_forward", "stack_forward", "head", "lm_forward",
           "lm_forward_jit", "mixer_forward_jit", "mixer_operator_jit", "expected_shapes", "to_params",
           "from_params", "init_rule", "init_params", "LaSMixer", "LaSLayer", "LaSLM", "init", "save", "load"]
