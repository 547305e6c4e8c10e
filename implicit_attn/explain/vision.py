"""CLS-token explanations of a Vision Mamba classifier (``models.vim``): the relevance of each
image patch for the CLS token, from the non-causal per-layer operators.

Per layer ``A_l = operator_map(H_l, how)`` (``(B, L, L)``, ``L = N + 1`` with the CLS token),
``H_l`` the block's ``BidirectionalOperator`` of ``variant`` (``"full"``: Zimerman et al.;
``"s6_only"``: Ali et al.'s ``alpha_f + J alpha_b J``). The methods are ``methods``' own, which
take any square maps:

raw attention   mean of ``A_l`` over layers, row ``cls``
rollout         ``(I + A_{N-1}) ... (I + A_0)``, row ``cls``
attribution     the same rollout of ``I + (gbar_l[i] A_l[i, j])^+``, ``gbar_l`` the channel mean
                of ``d logit_target / d y_l`` (``y_l`` the block's output before ``out_proj``)

The CLS column is dropped, the ``N`` patch relevances are reshaped to the patch grid
(``relevance_grid``) and upsampled bilinearly to the image (``relevance_image``), as Ali et al.
Sec. 3.2 describe.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..models import vim
from ..ops import full_precision
from .maps import check_how, operator_map, position_mean
from .methods import attribution_maps, raw_attention, rollout

VISION_METHODS = ("raw", "rollout", "attribution")


@functools.partial(jax.jit, static_argnames=("cfg", "variant", "how"))  # one compile when eager
def layer_maps(params: dict, images, cfg: vim.Config, variant: str = "full", how: str = "abs_mean"):
    """``(layers, B, L, L)`` float32: each block's channel summary ``how`` of its operator."""
    check_how(how)
    return jnp.stack([operator_map(op, how) for op in vim.operators(params, images, cfg, variant)])


@functools.partial(jax.jit, static_argnames=("cfg",))  # one compile when eager
def gradient_means(params: dict, images, cfg: vim.Config, target):
    """``(layers, B, L)`` float32: the channel mean of ``d logits[b, target_b] / d y_l[b, :, i]``,
    ``y_l (B, C, L)`` each block's output before ``out_proj``. ``target (B,)`` int classes."""
    B, L, C = images.shape[0], cfg.seq_len, cfg.expand * cfg.hidden_size
    taps = [jnp.zeros((B, C, L), jnp.float32) for _ in range(cfg.num_hidden_layers)]
    rows = jnp.arange(B)

    def f(taps):
        return jnp.sum(vim.forward(params, images, cfg, taps)[rows, target])

    return jnp.stack([position_mean(g) for g in jax.grad(f)(taps)])


def cls_matrices(params: dict, images, cfg: vim.Config, methods=VISION_METHODS, variant: str = "full",
                 how: str = "abs_mean", target=None, start_layer: int = 0) -> dict:
    """``{method: (B, L, L)}``: the combined matrix of each of ``methods`` (``VISION_METHODS``),
    sharing one pass for the maps; row ``cfg.cls_index`` is the relevance for the CLS token.
    ``target (B,)`` classes for ``"attribution"`` (None: the predicted ones)."""
    methods = (methods,) if isinstance(methods, str) else tuple(methods)
    bad = [m for m in methods if m not in VISION_METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be among {VISION_METHODS}, got {methods!r}")
    maps = layer_maps(params, images, cfg, variant, how)
    out = {}
    if "raw" in methods:
        out["raw"] = raw_attention(maps, start_layer)
    if "rollout" in methods:
        out["rollout"] = rollout(maps, start_layer)
    if "attribution" in methods:
        if target is None:
            target = jnp.argmax(vim.forward(params, images, cfg), axis=-1)
        gm = gradient_means(params, images, cfg, jnp.asarray(target))
        out["attribution"] = rollout(attribution_maps(maps, gm), start_layer)
    return out


def cls_relevances(params: dict, images, cfg: vim.Config, methods=VISION_METHODS, variant: str = "full",
                   how: str = "abs_mean", target=None, start_layer: int = 0) -> dict:
    """``{method: (B, N)}`` float32 relevance of each patch (row-major grid order) for the CLS
    token: row ``cls`` of ``cls_matrices`` without the CLS column."""
    mats = cls_matrices(params, images, cfg, methods, variant, how, target, start_layer)
    return {m: patches_only(a[:, cfg.cls_index], cfg) for m, a in mats.items()}


def cls_relevance(params: dict, images, cfg: vim.Config, method: str = "rollout", variant: str = "full",
                  how: str = "abs_mean", target=None, start_layer: int = 0):
    """``(B, N)`` float32 relevance of each patch for the CLS token by one ``method``."""
    if method not in VISION_METHODS:
        raise ValueError(f"method must be one of {VISION_METHODS}, got {method!r}")
    return cls_relevances(params, images, cfg, (method,), variant, how, target, start_layer)[method]


cls_relevances_jit = jax.jit(full_precision(cls_relevances),
                             static_argnames=("cfg", "methods", "variant", "how", "start_layer"))


def patches_only(row, cfg: vim.Config):
    """``(B, N + 1) -> (B, N)``: the CLS position removed."""
    c = cfg.cls_index
    return jnp.concatenate([row[:, :c], row[:, c + 1:]], axis=1)


def relevance_grid(relevance, cfg: vim.Config):
    """``(B, N) -> (B, G, G)``: patch relevances on the patch grid (``G = image_size / patch_size``)."""
    r = jnp.asarray(relevance, jnp.float32)
    if r.ndim != 2 or r.shape[1] != cfg.num_patches:
        raise ValueError(f"relevance must have shape (B, {cfg.num_patches}), got {r.shape}")
    return r.reshape(r.shape[0], cfg.grid, cfg.grid)


def relevance_image(relevance, cfg: vim.Config, size: int | None = None):
    """``(B, N) -> (B, size, size)`` (default ``image_size``): the grid upsampled bilinearly
    (half-pixel centres, torch's ``interpolate(mode="bilinear", align_corners=False)``)."""
    g = relevance_grid(relevance, cfg)
    size = cfg.image_size if size is None else size
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    return jax.image.resize(g, (g.shape[0], int(size), int(size)), method="bilinear", antialias=False)


def distance_profile(relevance, cfg: vim.Config):
    """Mean relevance by distance to the CLS token in the sequence (Ali et al. Fig. 3):
    ``relevance (B, N)`` -> ``(distances (K,), mean (K,))`` over the batch and the patches at
    each distance ``|position - cls_index|`` (positions in the ``N + 1`` sequence)."""
    r = np.asarray(relevance, np.float64)
    if r.ndim != 2 or r.shape[1] != cfg.num_patches:
        raise ValueError(f"relevance must have shape (B, {cfg.num_patches}), got {r.shape}")
    pos = np.delete(np.arange(cfg.seq_len), cfg.cls_index)
    dist = np.abs(pos - cfg.cls_index)
    ds = np.unique(dist)
    return ds, np.array([r[:, dist == d].mean() for d in ds])


__all__ = ["VISION_METHODS", "layer_maps", "gradient_means", "cls_matrices", "cls_relevances", "cls_relevance",
           "cls_relevances_jit",
           "patches_only", "relevance_grid", "relevance_image", "distance_profile"]
