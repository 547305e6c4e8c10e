"""Vision Mamba (ViM, Zhu et al. 2024; the official ``hustvl/Vim`` layout): bidirectional
Mamba blocks on a sequence of image patches with a CLS token, its exact non-causal implicit
operator, random initialisation and safetensors save / load.

Model: ``patch_embed.proj`` (a conv with kernel = stride = ``patch_size``, patches in row-major
order), the CLS token inserted at ``cls_index`` (``"middle"``: ``N // 2``, the released models;
``"start"``: 0; ``"end"``: ``N``), ``pos_embed`` added, pre-norm residual blocks
``h <- h + mixer(RMSNorm(h))`` (residual in float32), a final RMSNorm and ``head`` on the CLS
token.

Mixer (``bimamba_type="v2"``): ``x, z = in_proj(h)`` shared; the forward direction is Mamba-1's
mixer (``families.mamba``) with ``conv1d, x_proj, dt_proj, A_log, D``; the backward direction the
same mixer with ``conv1d_b, x_proj_b, dt_proj_b, A_b_log, D_b`` on the reversed sequence (its gate
``z`` reversed too), reversed back; ``out_proj(scale * (y_f + J y_b))``, ``scale`` 1/2 when
``divide_out`` (``if_devide_out``, the released models), else 1.

Operator (``mixer_operator``): ``H = scale * (H_f + J H_b J)`` (``operator.BidirectionalCore``),
``H_f, H_b`` each Mamba's operator of its direction; both act on the same ``x`` (``in_proj`` is
shared and position-wise), so ``H x + offset`` is the block's output before ``out_proj``.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..families.mamba import Config as MambaConfig
from ..families.mamba import block as mamba
from ..families.mamba.checkpoint import inverse_softplus_dt
from ..nn import Mixer, Weights, check_tensors, check_variant, fan_in_normal, held, random_tensors
from ..nn.checkpoint import CheckpointError, read_hf_dir, write_hf_dir
from ..nn.config import HFConfig
from ..nn.hooks import apply_out_hook, layer_tap
from ..operator import BidirectionalCore, ImplicitOperator, pytree_dataclass
from ..ops import full_precision, linear

f32 = jnp.float32
MODEL_TYPE = "vim"
CLS_POSITIONS = ("middle", "start", "end")
VARIANTS = mamba.VARIANTS
# variants whose two directions act on the same values (x): H x + offset is the block's output
# for "full"; "no_conv" and "s6_only" act on each direction's own conv output / activation
SHARED_VALUES = ("full", "no_gate", "no_act")
# the per-direction tensors of a mixer: forward name -> backward name (official ViM)
BACKWARD = {"conv1d.weight": "conv1d_b.weight", "conv1d.bias": "conv1d_b.bias", "x_proj.weight": "x_proj_b.weight",
            "dt_proj.weight": "dt_proj_b.weight", "dt_proj.bias": "dt_proj_b.bias", "A_log": "A_b_log", "D": "D_b"}
SHARED = ("in_proj.weight", "out_proj.weight")


@dataclasses.dataclass(frozen=True)
class Config(HFConfig):
    """ViM hyper-parameters (``config.json`` of ``save``; names follow HF where one exists).

    Attributes:
      image_size, patch_size, num_channels: square images of ``num_channels`` planes; the
        patches form a ``(image_size / patch_size)`` square grid, ``N`` patches.
      hidden_size, num_hidden_layers: model width ``D`` and depth.
      state_size, conv_kernel, expand, time_step_rank: each direction's Mamba-1 sizes
        (``time_step_rank`` 0: ``ceil(D / 16)``).
      num_labels: classes of ``head``.
      cls_position: ``"middle"`` (index ``N // 2``), ``"start"`` (0) or ``"end"`` (``N``).
      divide_out: ``out_proj((y_f + J y_b) / 2)`` (official ``if_devide_out``) instead of the sum.
      layer_norm_epsilon: of every RMSNorm; residual_in_fp32: keep the residual in float32.
    """

    model_type: ClassVar[str] = MODEL_TYPE
    architecture: ClassVar[str] = "VisionMamba"
    required: ClassVar[tuple[str, ...]] = ("image_size", "patch_size", "hidden_size", "num_labels")

    image_size: int
    patch_size: int
    hidden_size: int
    num_labels: int
    num_channels: int = 3
    num_hidden_layers: int = 2
    state_size: int = 16
    conv_kernel: int = 4
    expand: int = 2
    time_step_rank: int = 0
    cls_position: str = "middle"
    divide_out: bool = True
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True

    def __post_init__(self):
        """Validate every field (``ValueError`` naming it and its value)."""
        self.check_ints("image_size", "patch_size", "hidden_size", "num_labels", "num_channels", "num_hidden_layers",
                        "state_size", "conv_kernel", "expand")
        self.check_ints("time_step_rank", low=0)
        self.check_floats("layer_norm_epsilon", low=0.0)
        self.check_bools("divide_out", "residual_in_fp32")
        self.check_choice("cls_position", CLS_POSITIONS, "ViM")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
        if self.time_step_rank == 0:
            object.__setattr__(self, "time_step_rank", math.ceil(self.hidden_size / 16))

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid ** 2

    @property
    def seq_len(self) -> int:
        """``N + 1``: the patches and the CLS token."""
        return self.num_patches + 1

    @property
    def cls_index(self) -> int:
        """Position of the CLS token in the sequence."""
        return {"middle": self.num_patches // 2, "start": 0, "end": self.num_patches}[self.cls_position]

    @property
    def scale(self) -> float:
        return 0.5 if self.divide_out else 1.0

    @property
    def mamba(self) -> MambaConfig:
        """The Mamba-1 config of each direction's mixer."""
        return MambaConfig(vocab_size=1, hidden_size=self.hidden_size, state_size=self.state_size,
                           conv_kernel=self.conv_kernel, expand=self.expand, time_step_rank=self.time_step_rank,
                           layer_norm_epsilon=self.layer_norm_epsilon, residual_in_fp32=self.residual_in_fp32)


# ----------------------------------------------------------------------------- pure functions

def direction_params(p: dict, backward: bool) -> dict:
    """One direction's Mamba-1 mixer params (Mamba names) from a ViM mixer's ``p``."""
    q = {n: p[n] for n in SHARED}
    q.update({f: p[b if backward else f] for f, b in BACKWARD.items()})
    return q


def flip(a, axis: int = 1):
    """``J a``: positions reversed along ``axis``."""
    return jnp.flip(a, axis=axis)


def mixer_inner(p: dict, h, cfg: Config):
    """The block's token-mixing output before ``out_proj``: ``(B, L, C)`` float32,
    ``scale * (y_f + J y_b)``."""
    m = cfg.mamba
    y_f = mamba.mixer_inner(direction_params(p, False), h, m)
    y_b = mamba.mixer_inner(direction_params(p, True), flip(h), m)
    return cfg.scale * (y_f + flip(y_b))


def mixer_forward(p: dict, h, cfg: Config, hook=None):
    """The bidirectional block ``(B, L, D) -> (B, L, D)``; ``hook``: optional ``(B, C, L) -> same``
    on the inner output in the operator layout (``mixer.hook_out``)."""
    y = apply_out_hook(mixer_inner(p, h, cfg), hook).astype(h.dtype)
    return linear(y, p["out_proj.weight"], p.get("out_proj.bias"))


@pytree_dataclass
class BidirectionalOperator(ImplicitOperator):
    """``ImplicitOperator`` of a ViM block (core ``BidirectionalCore``) with its two directions.

    ``values``: ``x (B, C, L)`` (``"full"``, ``"no_gate"``, ``"no_act"``), else the forward
    direction's values (``"no_conv"``: its conv output, ``"s6_only"``: its activation; the
    backward direction's differ, so no single vector makes those variants exact).
    ``forward`` / ``backward``: each direction's Mamba ``ImplicitOperator``, the backward one in
    reversed order (its ``apply()`` equals its ``output`` for ``"full"`` and ``"no_conv"``).
    """

    forward: Any = None
    backward: Any = None


def mixer_operator(p: dict, h, cfg: Config, variant: str = "full", chunk: int = 16) -> BidirectionalOperator:
    """The block's operator for input ``h (B, L, D)`` (see the module docstring).

    ``variant``: Mamba's (``VARIANTS``) applied to each direction; ``"s6_only"`` sums the two
    directions' ``alpha`` without the 1/2 (Ali et al. 2024: "summing the two per-direction
    matrices"), the others carry the block's ``scale``. Only ``"full"`` reproduces ``output``;
    ``output`` is always the block's own (``mixer_inner`` in the operator layout).
    """
    if variant not in VARIANTS:
        raise ValueError(f"ViM variant must be one of {VARIANTS}, got {variant!r}")
    m = cfg.mamba
    of = mamba.mixer_operator(direction_params(p, False), h, m, variant, chunk)
    ob = mamba.mixer_operator(direction_params(p, True), flip(h), m, variant, chunk)
    scale = 1.0 if variant == "s6_only" else cfg.scale
    core = BidirectionalCore(forward=of.core, backward=ob.core, scale=scale)
    offset = scale * (of.offset + flip(ob.offset, 2))
    output = cfg.scale * (of.output + flip(ob.output, 2))
    return BidirectionalOperator(values=of.values, offset=offset, output=output, core=core, forward=of, backward=ob)


def patch_embed(params: dict, images, cfg: Config):
    """``images (B, num_channels, S, S)`` -> patch tokens ``(B, N, D)`` (the conv with kernel =
    stride = patch as one matmul; patches in row-major order, as ``flatten(2)``)."""
    if images.ndim != 4 or images.shape[1:] != (cfg.num_channels, cfg.image_size, cfg.image_size):
        raise ValueError(f"images must have shape (B, {cfg.num_channels}, {cfg.image_size}, {cfg.image_size}), "
                         f"got {images.shape}")
    B, P, G = images.shape[0], cfg.patch_size, cfg.grid
    x = images.reshape(B, cfg.num_channels, G, P, G, P).transpose(0, 2, 4, 1, 3, 5).reshape(B, G * G, -1)
    w = params["patch_embed.proj.weight"]
    return linear(x.astype(w.dtype), w.reshape(w.shape[0], -1), params["patch_embed.proj.bias"])


def embed_tokens(params: dict, images, cfg: Config):
    """``(B, N + 1, D)``: patch tokens with the CLS token at ``cfg.cls_index``, plus ``pos_embed``."""
    x = patch_embed(params, images, cfg)
    c = cfg.cls_index
    cls = jnp.broadcast_to(params["cls_token"], (x.shape[0], 1, x.shape[2])).astype(x.dtype)
    x = jnp.concatenate([x[:, :c], cls, x[:, c:]], axis=1)
    return x + params["pos_embed"].astype(x.dtype)


def forward(params: dict, images, cfg: Config, taps=None, return_inputs: bool = False):
    """Class logits ``(B, num_labels)`` float32 of ``images (B, num_channels, S, S)``.

    ``taps``: optional list (one per layer, None allowed) of ``(B, C, L)`` arrays added to each
    block's inner output (``d logits / d tap`` is the gradient w.r.t. that output).
    ``return_inputs``: also return the list of each block's mixer input ``(B, L, D)``.
    """
    h = embed_tokens(params, images, cfg)
    inputs = []
    for i, layer in enumerate(params["layers"]):
        tap = None if taps is None else taps[i]
        h, hn = mamba.residual_block(layer, h, cfg, mixer_forward, layer_tap(tap))
        inputs.append(hn)
    h = mamba.rms_norm(h, params["norm_f"], cfg.layer_norm_epsilon)
    logits = linear(h[:, cfg.cls_index], params["head.weight"], params["head.bias"]).astype(f32)
    return (logits, inputs) if return_inputs else logits


def operators(params: dict, images, cfg: Config, variant: str = "full", chunk: int = 16) -> list:
    """Every block's ``BidirectionalOperator`` for ``images`` (one forward pass for the inputs)."""
    _, inputs = forward(params, images, cfg, return_inputs=True)
    return [mixer_operator(layer["mixer"], hn, cfg, variant, chunk) for layer, hn in zip(params["layers"], inputs)]


forward_jit = jax.jit(full_precision(forward), static_argnames=("cfg", "return_inputs"))
mixer_forward_jit = jax.jit(full_precision(mixer_forward), static_argnames=("cfg",))
mixer_operator_jit = jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "variant", "chunk"))
operators_jit = jax.jit(full_precision(operators), static_argnames=("cfg", "variant", "chunk"))


# ----------------------------------------------------------------------------- parameters

def mixer_shapes(cfg: Config) -> dict[str, tuple]:
    """A ViM mixer's tensors (official names) -> shapes."""
    D, C, N, R, K = cfg.hidden_size, cfg.expand * cfg.hidden_size, cfg.state_size, cfg.time_step_rank, cfg.conv_kernel
    one = {"conv1d.weight": (C, 1, K), "conv1d.bias": (C,), "x_proj.weight": (R + 2 * N, C),
           "dt_proj.weight": (C, R), "dt_proj.bias": (C,), "A_log": (C, N), "D": (C,)}
    t = {"in_proj.weight": (2 * C, D), "out_proj.weight": (D, C)}
    t.update(one)
    t.update({BACKWARD[k]: v for k, v in one.items()})
    return t


def expected_shapes(cfg: Config) -> dict[str, tuple]:
    """The one shape table: checkpoint tensor name (official ViM names) -> shape."""
    D, P = cfg.hidden_size, cfg.patch_size
    t = {"patch_embed.proj.weight": (D, cfg.num_channels, P, P), "patch_embed.proj.bias": (D,),
         "cls_token": (1, 1, D), "pos_embed": (1, cfg.seq_len, D)}
    for i in range(cfg.num_hidden_layers):
        t[f"layers.{i}.norm.weight"] = (D,)
        t.update({f"layers.{i}.mixer.{k}": v for k, v in mixer_shapes(cfg).items()})
    t.update({"norm_f.weight": (D,), "head.weight": (cfg.num_labels, D), "head.bias": (cfg.num_labels,)})
    return t


TOP = ("patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "pos_embed", "head.weight", "head.bias")


def to_params(cfg: Config, tensors: dict) -> dict:
    """Checkpoint tensors (``expected_shapes`` names) -> the parameter tree of ``forward``."""
    t = {k: jnp.asarray(v) for k, v in tensors.items()}
    layers = []
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}.mixer."
        layers.append({"norm": t[f"layers.{i}.norm.weight"],
                       "mixer": {k: t[pre + k] for k in mixer_shapes(cfg)}})
    return {**{k: t[k] for k in TOP}, "layers": layers, "norm_f": t["norm_f.weight"]}


def from_params(cfg: Config, params: dict) -> dict:
    """The inverse of ``to_params``: ``{checkpoint name: numpy array}``."""
    t = {k: params[k] for k in TOP}
    t["norm_f.weight"] = params["norm_f"]
    for i, layer in enumerate(params["layers"]):
        t[f"layers.{i}.norm.weight"] = layer["norm"]
        t.update({f"layers.{i}.mixer.{k}": v for k, v in layer["mixer"].items()})
    return {k: np.asarray(v) for k, v in t.items()}


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Random initialisation (Mamba's: ``A = -(1..N)``, ``D = 1``, ``dt`` log-uniform in
    [1e-3, 0.1]; norms 1; CLS and position embeddings ``N(0, 0.02^2)``; matrices
    ``N(0, 1 / fan_in)``, biases 0)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("A_log", "A_b_log"):
        return np.log(np.broadcast_to(np.arange(1, shape[1] + 1, dtype=np.float64), shape))
    if leaf in ("D", "D_b") or name.endswith("norm.weight") or name == "norm_f.weight":
        return np.ones(shape)
    if name.endswith(("dt_proj.bias", "dt_proj_b.bias")):
        return inverse_softplus_dt(shape[0], g)
    if name in ("cls_token", "pos_embed"):
        return 0.02 * g.standard_normal(shape)
    if name.endswith(".bias"):
        return np.zeros(shape)
    if name == "patch_embed.proj.weight":
        return g.standard_normal(shape) / math.sqrt(math.prod(shape[1:]))  # fan in: planes x patch
    return fan_in_normal(shape, g)


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters (``init_rule``) for ``cfg``; ``key`` an int seed or a PRNG key."""
    return to_params(cfg, random_tensors(expected_shapes(cfg), init_rule, key, dtype))


# ----------------------------------------------------------------------------- module

class VimMixer(Mixer):
    """The bidirectional block: ``__call__(h)`` its forward, ``as_operator(x, variant)`` its
    ``BidirectionalOperator`` (see ``mixer_operator``)."""

    label = "ViM"
    variants = VARIANTS
    forward_fn = staticmethod(mixer_forward_jit)
    operator_fn = staticmethod(mixer_operator_jit)


class VimLayer(nnx.Module):
    """One pre-norm block: ``norm`` (RMSNorm weight) and the ``mixer``."""

    def __init__(self, cfg: Config, layer: dict):
        self.norm = nnx.Param(jnp.asarray(layer["norm"]))
        self.mixer = VimMixer(cfg, layer["mixer"])

    def params(self) -> dict:
        return {"norm": held(self.norm), "mixer": self.mixer.arrays()}


class ViM(nnx.Module):
    """A Vision Mamba classifier (``ViM(config, params)``, params from ``init_params``, ``load``
    or a converted official checkpoint): ``model(images)`` logits ``(B, num_labels)``,
    ``operators(images, variant)`` every block's ``BidirectionalOperator``,
    ``layers[i].mixer.as_operator(x, variant)`` one block's for its input ``x (B, L, D)``."""

    def __init__(self, cfg: Config, params: dict):
        self.config = cfg
        self.layers = nnx.List([VimLayer(cfg, l) for l in params["layers"]])
        self.top = Weights({**{k: params[k] for k in TOP}, "norm_f": params["norm_f"]})

    def params(self) -> dict:
        """The parameter tree of the pure functions."""
        return {**self.top.arrays(), "layers": [l.params() for l in self.layers]}

    def __call__(self, images):
        """``images (B, num_channels, S, S)`` -> logits ``(B, num_labels)`` float32."""
        return forward_jit(self.params(), jnp.asarray(images), cfg=self.config)

    def operators(self, images, variant: str = "full") -> list:
        """One ``BidirectionalOperator`` per block (``variant``: one of ``VARIANTS``)."""
        check_variant(variant, VARIANTS, "ViM")
        return operators_jit(self.params(), jnp.asarray(images), cfg=self.config, variant=variant)


def init(cfg: Config, key=0) -> ViM:
    """A randomly initialised ``ViM``."""
    return ViM(cfg, init_params(cfg, key))


def save(path, model: ViM):
    """Write ``config.json`` and ``model.safetensors`` (official ViM tensor names)."""
    write_hf_dir(path, model.config.to_hf(), from_params(model.config, model.params()))


def config_from_dict(config: dict, where) -> Config:
    """``Config`` of a ``config.json`` dict; ``CheckpointError`` naming a wrong ``model_type`` or
    a bad value."""
    if config.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{where}: model_type {config.get('model_type')!r} is not {MODEL_TYPE!r}")
    try:
        return Config.from_hf(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} config: {e}") from e


def load(path) -> ViM:
    """Read a directory written by ``save`` (or by ``implicit-attn convert`` of an official
    checkpoint); ``CheckpointError`` naming a wrong ``model_type``, a bad config value, or
    missing / unexpected / mis-shaped tensors."""
    config, tensors = read_hf_dir(path)
    cfg = config_from_dict(config, Path(path))
    check_tensors(tensors, expected_shapes(cfg), where=f"{path} checkpoint")
    return ViM(cfg, to_params(cfg, tensors))


__all__ = ["MODEL_TYPE", "CLS_POSITIONS", "VARIANTS", "SHARED_VALUES", "BACKWARD", "Config", "direction_params",
           "flip", "mixer_inner", "mixer_forward", "BidirectionalOperator", "mixer_operator", "patch_embed",
           "embed_tokens", "forward", "operators", "forward_jit", "mixer_forward_jit", "mixer_operator_jit",
           "operators_jit", "mixer_shapes", "expected_shapes", "to_params", "from_params", "init_rule", "init_params",
           "VimMixer", "VimLayer", "ViM", "init", "save", "config_from_dict", "load"]
