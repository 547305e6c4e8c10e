"""Full float32 matrix products everywhere the library computes, and half-precision roundings
where torch makes them.

On GPUs JAX's default float32 matmul may run in TF32 (10-bit mantissa): measured on an
H100, operators then reproduce their block's output only to ~1e-4 and logits differ from
torch by ~7e-4. The library's entry points trace under ``full_precision``, so every
product inside them is a true float32 one; the caller's own JAX settings are untouched.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def full_precision(fn):
    """``fn`` traced with ``jax.default_matmul_precision("highest")`` (float32 products stay
    float32 on every backend; a no-op on CPU)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapped


def rounded(x):
    """``x (...)`` rounded to its own half-precision dtype even inside a fused XLA program
    (``lax.reduce_precision``); float32 and wider as they are. XLA:CPU may keep float32 between
    fused bfloat16 operations (its excess precision), so a float32 reduction that reads the
    result, like the RMSNorm after the embedding scale, would see unrounded values where torch
    reads a bfloat16 tensor."""
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return x
    info = jnp.finfo(x.dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


__all__ = ["full_precision", "rounded"]
