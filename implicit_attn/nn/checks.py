"""Input checks at the API boundary, shared by every family (ids, layers, block inputs,
taps), the scan-method switch and a parameter count."""
from __future__ import annotations

import warnings
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np


def as_device_array(x):
    """``x`` (any array-like) as a jax array of its dtype (``jnp.asarray``'s canonical one). A numpy
    array goes over by ``jax.device_put``: ``jnp.asarray`` of one runs a small compiled program,
    compiled again for every new shape and dtype.

    The transfer may read its source after this returns (or keep it as the array's memory), so it
    gets a private copy: the caller may change ``x`` right away (``tests/test_nan.py`` does)."""
    if isinstance(x, np.ndarray):
        return jax.device_put(np.array(x, copy=True))
    return jnp.asarray(x)


def check_input_ids(input_ids, vocab_size: int):
    """Validate token ids at the API boundary.

    Args:
      input_ids: ``(B, L)`` integer array (numpy, jax or nested lists).
      vocab_size: ids must lie in ``[0, vocab_size)``.
    Returns:
      ``(B, L)`` int32 jax array.
    Raises:
      ValueError/TypeError naming the problem. The range is checked here on concrete
      inputs; under ``jit`` an out-of-range id gives NaN logits (``ops.embed``).
    """
    if isinstance(input_ids, jax.core.Tracer):
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (batch, length), got rank {input_ids.ndim}")
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise TypeError(f"input_ids must be integers, got dtype {input_ids.dtype}")
        return input_ids.astype(jnp.int32)
    try:
        arr = np.asarray(input_ids)
    except (TypeError, ValueError) as e:  # numpy refuses ragged nesting ("inhomogeneous shape")
        raise ValueError(f"input_ids must be a rectangular (batch, length) array of integers, got "
                         f"{_ragged_rows(input_ids) or e}") from None
    if isinstance(input_ids, (list, tuple)) or arr.dtype == object:
        # numpy stores ints beyond int64 as objects or floats and [True, 2] as ints: look at
        # the elements themselves
        leaves = list(_leaves(input_ids)) if isinstance(input_ids, (list, tuple)) else list(arr.flat)
        odd = [v for v in leaves if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))]
        if odd and (arr.dtype == object or any(isinstance(v, (bool, np.bool_)) for v in odd)):
            raise TypeError(f"input_ids must be a rectangular (batch, length) array of integers, got an "
                            f"element {odd[0]!r} of type {type(odd[0]).__name__}")
        if leaves and not odd and arr.dtype.kind not in "iu":
            big = max(leaves, key=abs)
            raise ValueError(f"token id {big} is outside the vocabulary [0, {vocab_size})")
    if arr.size == 0:  # before the dtype: numpy makes [[]] float64
        raise ValueError(f"input_ids must be non-empty, got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"input_ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 2:
        hint = " (add a batch axis: ids[None])" if arr.ndim == 1 else ""
        raise ValueError(f"input_ids must have shape (batch, length), got shape {arr.shape}{hint}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return as_device_array(arr.astype(np.int32))  # in range, so exact


def _ragged_rows(seq) -> str | None:
    """``"rows of unequal lengths [2, 1]"`` when the rows of a nested sequence differ in
    length (or mix scalars and sequences), for messages; None otherwise."""
    try:
        lens = [len(r) if isinstance(r, (list, tuple, np.ndarray)) else "scalar" for r in seq]
    except TypeError:
        return None
    if len(set(map(str, lens))) < 2:
        return None
    return f"rows of unequal lengths {lens[:8]}{' ...' if len(lens) > 8 else ''}"


def _leaves(seq):
    """The non-sequence elements of a nested list/tuple."""
    for v in seq:
        if isinstance(v, (list, tuple)):
            yield from _leaves(v)
        else:
            yield v


def check_layers(layers, num_layers: int) -> list[int]:
    """Normalise a layer selection (None: all; an int or a non-empty list; negatives count from
    the end) to a list of indices in ``[0, num_layers)``."""
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, (bool, np.bool_)):
        layers = [int(layers)]
    if isinstance(layers, (str, bytes, bool, np.bool_)) or not hasattr(layers, "__iter__"):
        raise ValueError(f"layers must be None, an int or a list of ints, got {layers!r}")
    out = []
    for i in layers:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise ValueError(f"layers must be ints (negatives count from the end), got {i!r}")
        if not -num_layers <= i < num_layers:
            raise ValueError(f"layer {i!r} out of range for a model with {num_layers} layers")
        out.append(int(i) % num_layers)
    if not out:
        raise ValueError(f"layers is empty ({layers!r}): select at least one layer (None selects all)")
    return out


def check_block_input(x, d_model: int, name: str = "mixer input"):
    """Validate a block's hidden-state input at the API boundary.

    Args:
      x: ``(B, L, d_model)`` floating array (numpy, jax, a tracer or nested lists).
      d_model: the model width.
      name: what the input is called in error messages (e.g. ``"mixer input"``).
    Returns:
      ``x`` as a jax array (dtype unchanged).
    Raises:
      ValueError naming the problem: wrong rank, wrong last dimension, empty batch or
      length, non-floating dtype (token ids belong to the model's ``__call__``).
    """
    x = as_device_array(x)
    want = f"(batch, length, {d_model})"
    if x.ndim != 3:
        raise ValueError(f"{name} must have shape {want}, got rank {x.ndim} shape {x.shape}")
    if x.shape[-1] != d_model:
        raise ValueError(f"{name} must have shape {want}, got shape {x.shape} "
                         f"(last dimension {x.shape[-1]} != d_model {d_model})")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{name} must have shape {want} with batch and length >= 1, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point (hidden states, not token ids), got dtype {x.dtype}")
    return x


def check_taps(taps, expected_shape: Callable[[int], tuple], num_layers: int,
               what: Callable[[int], str] = lambda i: "(batch, channels, length)") -> dict:
    """Validate ``tapped_logits``' ``taps = {layer: array}`` at the API boundary.

    Args:
      taps: None or a mapping from layer index (negatives count from the end) to an array.
      expected_shape: ``layer -> shape`` of that layer's operator output (``op.output``).
      num_layers: number of layers of the model.
      what: ``layer -> description`` of the expected axes, for messages.
    Returns:
      ``{layer: jax array}`` with non-negative layer keys.
    Raises:
      ValueError naming the problem: not a mapping, a layer out of range or given twice,
      a tap whose shape is not exactly the operator output's (no silent broadcasting),
      a non-floating tap.
    """
    if taps is None:
        return {}
    if not isinstance(taps, Mapping):
        raise ValueError(f"taps must be a dict {{layer: array}}, got {type(taps).__name__}")
    out = {}
    for key, t in taps.items():
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not -num_layers <= key < num_layers:
            raise ValueError(f"taps: layer {key!r} out of range for a model with {num_layers} layers")
        i = int(key) % num_layers
        if i in out:
            raise ValueError(f"taps: layer {i} given twice (as {i} and {i - num_layers})")
        out[i] = check_tap(t, expected_shape(i), what(i), name=f"taps[{key}]", owner=f"layer {i}'s")
    return out


def check_tap(tap, shape: tuple, what: str = "(batch, channels, length)", name: str = "tap",
              owner: str = "the block's", of: str = "operator output"):
    """Validate one tap: exactly ``shape`` (``owner``'s ``of``, by default the operator output's;
    no silent broadcasting) and floating point. Returns it as a jax array; ValueError naming
    the problem otherwise."""
    t = as_device_array(tap)
    want = tuple(shape)
    if tuple(t.shape) != want:
        described = " ".join(part for part in (owner, of, what) if part)
        raise ValueError(f"{name} must have the shape of {described} = {want}, got {tuple(t.shape)}")
    if not jnp.issubdtype(t.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
    return t


SCAN_METHODS = ("auto", "parallel", "sequential")


def scan_method(method: str) -> str:
    """Resolve a linear-recurrence ``method``: ``"auto"`` is ``"sequential"`` (one fused
    ``lax.scan``) on CPU and ``"parallel"`` (``jax.lax.associative_scan``) on GPU/TPU."""
    if method not in SCAN_METHODS:
        raise ValueError(f"scan method must be one of {SCAN_METHODS}, got {method!r}")
    if method == "auto":
        # Measured on CPU: the fused sequential scan is ~15x faster than the associative
        # scan for Mamba at d_inner 1536, L 512, and compiles much faster for the RG-LRU.
        return "sequential" if jax.default_backend() == "cpu" else "parallel"
    return method


def run_scan(method: str, sequential, parallel, *args):
    """``sequential(*args)`` or ``parallel(*args)`` as ``method`` says. ``"auto"`` picks by
    the platform the computation is lowered for (``lax.platform_dependent``): sequential
    for CPU, parallel for GPU/TPU, as ``scan_method`` does for the default backend, so a
    function exported on a CPU machine for an accelerator gets the accelerator's scan."""
    if method not in SCAN_METHODS:
        raise ValueError(f"scan method must be one of {SCAN_METHODS}, got {method!r}")
    if method == "auto":
        return jax.lax.platform_dependent(*args, cpu=sequential, default=parallel)
    return (parallel if method == "parallel" else sequential)(*args)


def warn_low_precision(dtype):
    """Warn (Python shows it once per call site) that a model below float32 may give
    operators that are not exact.

    Where a family computes its blocks in the parameters' dtype, ``H v + offset`` matches
    the block's output only to that rounding (4e-3 to 8e-3 seen with bfloat16), not to
    float32's 1e-7; loading with ``dtype="float32"`` restores exactness."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        warnings.warn(f"implicit_attn: this model's parameters are {dtype.name}; where its blocks compute in "
                      f"{dtype.name} the operators reproduce them only to that rounding (relative error up to "
                      f"~{float(jnp.finfo(dtype).eps):.0e}; see op.relative_error()). Load it with "
                      f"ia.load(path, dtype='float32') for exact operators", stacklevel=3)


def count_params(tree) -> int:
    """Number of scalars in a pytree of arrays."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
