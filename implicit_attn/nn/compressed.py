"""Checkpoints quantized in the compressed-tensors format (``quantization_config.quant_method``
``"compressed-tensors"``, written by llm-compressor: the FP8, INT4/INT8 and NVFP4 releases of many
models), dequantized to plain weights on load.

Each quantized linear ``X`` keeps its weight's integer or low-precision values and scales:

- ``float-quantized``: ``X.weight`` in FP8, ``X.weight_scale``;
- ``int-quantized`` / ``naive-quantized``: ``X.weight`` in int8 (FP8 for ``naive-quantized`` float
  weights), ``X.weight_scale``, ``X.weight_zero_point`` when asymmetric;
- ``pack-quantized``: ``X.weight_packed`` (int32 words holding ``32 / num_bits``-bit values along
  the input axis, stored offset by ``2**(num_bits-1)``), ``X.weight_shape``, ``X.weight_scale``
  and ``X.weight_zero_point`` (packed the same way along the output axis) when asymmetric;
- ``nvfp4-pack-quantized``: ``X.weight_packed`` (uint8, two FP4 E2M1 values a byte, the low
  nibble first), ``X.weight_scale`` (FP8, one per 16 inputs), ``X.weight_global_scale``.

The value is ``(q - zero_point) * scale`` (``scale / global_scale`` for NVFP4), with one scale per
tensor, output row, group of ``group_size`` inputs (``X.weight_g_idx`` may assign the groups) or
``block_structure`` block, as the config group's ``strategy`` says. Activation and KV-cache
quantization (what a serving engine also does to activations) is not applied: the model computes
with the dequantized weights, as transformers' dequantizing load does.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from .checkpoint import CheckpointError, dequantized_dtype, is_floating_dtype, is_fp8_dtype, release

METHOD = "compressed-tensors"
FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized", "nvfp4-pack-quantized")
STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block")
# the tensors a quantized linear ``X`` may hold besides its values: ``X.<suffix>``
WEIGHT_PARTS = ("weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape", "weight_g_idx")
# activation and KV-cache quantization parameters: read by a serving engine, not by this model
ACTIVATION_PARTS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale",
                    "output_zero_point", "k_scale", "v_scale", "q_scale", "k_zero_point", "v_zero_point")
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                np.float32)


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization: the storage ``format``, ``num_bits``, ``type``
    (``"int"`` or ``"float"``), ``strategy``, ``group_size`` / ``block`` where the strategy has
    them, whether ``symmetric``, and the group's ``targets`` (module names, ``re:`` patterns, or
    module classes such as ``Linear``, which match every quantized linear)."""
    format: str
    num_bits: int
    type: str
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None
    symmetric: bool
    targets: tuple[str, ...]


def compressed_schemes(config: dict, where) -> tuple[WeightScheme, ...] | None:
    """The weight schemes of a compressed-tensors ``config.json`` (its ``quantization_config``),
    None where the config has no compressed-tensors quantization.

    Raises:
      ``CheckpointError`` naming what is not read: a checkpoint not saved (``quantization_status``
      other than ``"compressed"`` or ``"frozen"``, the status older releases record), sparsity or transform (rotation)
      configs, formats outside ``FORMATS``, strategies outside ``STRATEGIES``, and malformed
      groups.
    """
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != METHOD:
        return None
    status = q.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):  # llm-compressor's older releases say 'frozen'
        raise CheckpointError(f"{where}: the compressed-tensors quantization_status is {status!r}; only saved "
                              f"checkpoints ('compressed' or 'frozen') are read")
    for key in ("sparsity_config", "transform_config"):
        if q.get(key):
            raise CheckpointError(f"{where}: the compressed-tensors config has a {key}; sparse and rotated "
                                  f"(transformed) checkpoints are not read")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: the compressed-tensors config has no config_groups")
    out = []
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        if w is None:
            continue  # activations only: the weights stay plain
        fmt = group.get("format") or q.get("format")
        what = f"{where}: compressed-tensors config group {name!r}"
        if fmt not in FORMATS:
            raise CheckpointError(f"{what} has format {fmt!r}; read: {', '.join(FORMATS)}")
        strategy, bits, kind = w.get("strategy"), w.get("num_bits"), w.get("type")
        if strategy not in STRATEGIES:
            raise CheckpointError(f"{what} has weight strategy {strategy!r}; read: {', '.join(STRATEGIES)}")
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8 or kind not in ("int", "float"):
            raise CheckpointError(f"{what} has weights of {bits!r} bits of type {kind!r}; read: int of 1-8 bits, "
                                  f"float of 8 (FP8) or 4 (NVFP4) bits")
        stored = {"float-quantized": kind == "float" and bits == 8, "nvfp4-pack-quantized": kind == "float" and bits == 4,
                  "naive-quantized": kind == "int" or bits == 8}.get(fmt, kind == "int")
        if not stored:
            raise CheckpointError(f"{what}: format {fmt!r} does not store {bits}-bit {kind} weights")
        group_size = w.get("group_size")
        if strategy in ("group", "tensor_group") and (not isinstance(group_size, int) or group_size < 1):
            raise CheckpointError(f"{what} has strategy {strategy!r} without a positive group_size")
        block = w.get("block_structure")
        if strategy == "block":
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise CheckpointError(f"{what} has strategy 'block' without two positive block_structure sizes")
            block = tuple(block)
        targets = group.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        out.append(WeightScheme(fmt, bits, kind, strategy, group_size if strategy in ("group", "tensor_group") else None,
                                block if strategy == "block" else None, bool(w.get("symmetric", True)),
                                tuple(targets)))
    return tuple(out)


def scheme_of(module: str, schemes: tuple[WeightScheme, ...], where) -> WeightScheme:
    """The scheme of quantized linear ``module``: the group naming it, else one whose ``re:``
    pattern matches it, else one targeting a module class (every quantized tensor here belongs to a
    linear layer); ``CheckpointError`` where none or several groups of the first kind that matches."""
    exact = [s for s in schemes if module in s.targets]
    pattern = [s for s in schemes if any(t.startswith("re:") and re.match(t[3:], module) for t in s.targets)]
    by_class = [s for s in schemes if any(not t.startswith("re:") and "." not in t and t[:1].isupper()
                                          for t in s.targets)]
    for found in (exact, pattern, by_class):
        if len(set(found)) == 1:
            return found[0]
        if found:
            raise CheckpointError(f"{where}: several compressed-tensors config groups target {module!r}")
    raise CheckpointError(f"{where}: quantized tensors of {module!r}, which no compressed-tensors config group targets")


def unpacked_ints(packed: np.ndarray, num_bits: int, count: int, where) -> np.ndarray:
    """Signed ``num_bits``-bit ints ``(R, count)`` from int32 words ``(R, ceil(count * num_bits / 32))``:
    value ``i`` of a row occupies bits ``i * num_bits ...`` of the row's little-endian bit string,
    stored plus ``2**(num_bits - 1)``."""
    words = np.ascontiguousarray(packed, dtype="<i4")
    need = -(-count * num_bits // 32)
    if words.ndim != 2 or words.shape[1] != need:
        raise CheckpointError(f"{where}: packed tensor of shape {tuple(words.shape)} should hold {count} "
                              f"{num_bits}-bit values a row in {need} int32 words")
    if 32 % num_bits == 0:  # 1, 2, 4 or 8 bits: whole values a word, taken by shifts
        per_word = 32 // num_bits
        shifts = np.arange(per_word, dtype=np.uint32) * num_bits
        values = (words.view(np.uint32)[:, :, None] >> shifts) & np.uint32((1 << num_bits) - 1)
        values = values.reshape(words.shape[0], -1)[:, :count].astype(np.int32)
    else:  # values cross words: through the rows' bit strings
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :count * num_bits]
        weights = (1 << np.arange(num_bits, dtype=np.int32))
        values = bits.reshape(words.shape[0], count, num_bits).astype(np.int32) @ weights
    return values - np.int32(1 << (num_bits - 1))


def unpacked_fp4(packed: np.ndarray, where) -> np.ndarray:
    """FP4 E2M1 values ``(R, 2 * C)`` float32 from bytes ``(R, C)`` (the low nibble first)."""
    if packed.ndim != 2 or packed.dtype != np.uint8:
        raise CheckpointError(f"{where}: NVFP4 values must be a uint8 matrix, got {packed.dtype} {tuple(packed.shape)}")
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return E2M1[nibbles]


def expanded_scale(scale: np.ndarray, scheme: WeightScheme, shape: tuple[int, int], g_idx, name, where) -> np.ndarray:
    """``scale`` (float32) broadcast to the weight's ``shape (R, C)`` as ``scheme.strategy`` lays it out."""
    R, C = shape
    s = np.asarray(scale, np.float32)
    if scheme.strategy == "tensor":
        want = [(), (1,)]
    elif scheme.strategy == "channel":
        want = [(R, 1), (R,)]
    elif scheme.strategy in ("group", "tensor_group"):
        want = [(R, -(-C // scheme.group_size))]
    else:
        want = [(-(-R // scheme.block[0]), -(-C // scheme.block[1]))]
    if s.shape not in want:
        raise CheckpointError(f"{where}: {name!r} of shape {tuple(s.shape)} does not fit a weight of shape {shape} "
                              f"with strategy {scheme.strategy!r} (expected {want[0]})")
    if scheme.strategy == "tensor":
        return np.broadcast_to(s.reshape(()), shape)
    if scheme.strategy == "channel":
        return np.broadcast_to(s.reshape(R, 1), shape)
    if scheme.strategy == "block":
        return np.repeat(np.repeat(s, scheme.block[0], axis=0), scheme.block[1], axis=1)[:R, :C]
    if g_idx is not None:
        groups = np.asarray(g_idx)
        if groups.shape != (C,) or not np.issubdtype(groups.dtype, np.integer) or (
                groups.min() < 0 or groups.max() >= s.shape[1]):
            raise CheckpointError(f"{where}: the weight_g_idx next to {name!r} must be {C} group indices "
                                  f"in [0, {s.shape[1]})")
        return s[:, groups]
    return np.repeat(s, scheme.group_size, axis=1)[:, :C]


def dequantized_compressed(tensors: dict, schemes: tuple[WeightScheme, ...], dtype, where, file_name=None) -> dict:
    """``tensors`` with every compressed-tensors quantized linear's parts replaced by its weight
    ``X.weight (R, C)``, computed in float32 as the module docstring says and cast to ``dtype``
    (None: the checkpoint's other floating tensors' dtype, ``dequantized_dtype``); activation and
    KV-cache scales are dropped. Memory-mapped parts are released once read. ``file_name``
    (default: the identity) maps a module's name here to the one the config's targets use (a
    container's language model, ``Container.file_name``).

    Raises:
      ``CheckpointError`` naming a part without its values or scales, values of the wrong dtype
      or shape, or scales that do not fit the strategy.
    """
    parts = WEIGHT_PARTS + ACTIVATION_PARTS
    owner = {}
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf in parts or leaf == "weight_packed" or (leaf == "weight" and module + ".weight_scale" in tensors):
            owner[name] = module
    quantized = {m for n, m in owner.items() if n.endswith(".weight_scale")}
    out_dtype = dequantized_dtype(tensors, dtype, lambda n, t: n in owner)
    out = {n: t for n, t in tensors.items() if n not in owner}
    for name, module in owner.items():
        leaf = name.rpartition(".")[2]
        if module not in quantized and leaf not in ACTIVATION_PARTS:
            raise CheckpointError(f"{where}: {name!r} belongs to no quantized weight ({module}.weight_scale is missing)")
    for module in sorted(quantized):
        scheme = scheme_of(module if file_name is None else file_name(module), schemes, where)
        out[module + ".weight"] = dequantized_weight(tensors, module, scheme, where).astype(out_dtype)
    for name in owner:
        release(tensors[name])
    return out


def dequantized_weight(tensors: dict, module: str, scheme: WeightScheme, where) -> np.ndarray:
    """One quantized linear's weight ``(R, C)`` float32 from its parts ``module.*`` in ``tensors``."""
    get = tensors.get
    scale_name = module + ".weight_scale"
    scale, zero = get(scale_name), get(module + ".weight_zero_point")
    if scale is None or not (is_floating_dtype(np.dtype(scale.dtype)) or is_fp8_dtype(scale.dtype)):
        raise CheckpointError(f"{where}: {scale_name!r} must be floating point, got "
                              f"{None if scale is None else scale.dtype}")
    if scheme.format in ("pack-quantized", "nvfp4-pack-quantized"):
        values_name = module + ".weight_packed"
    else:
        values_name = module + ".weight"
    values = get(values_name)
    if values is None:
        raise CheckpointError(f"{where}: {scale_name!r} scales no {values_name!r} ({scheme.format})")
    if scheme.format == "pack-quantized":
        shape_t = get(module + ".weight_shape")
        if shape_t is None or np.asarray(shape_t).shape != (2,):
            raise CheckpointError(f"{where}: packed weight {values_name!r} needs its shape {module}.weight_shape (2 ints)")
        R, C = (int(v) for v in np.asarray(shape_t))
        if values.dtype != np.int32 or values.ndim != 2 or values.shape[0] != R:
            raise CheckpointError(f"{where}: {values_name!r} must be int32 words of {R} rows, got "
                                  f"{values.dtype} {tuple(values.shape)}")
        q = unpacked_ints(values, scheme.num_bits, C, values_name).astype(np.float32)
    elif scheme.format == "nvfp4-pack-quantized":
        q = unpacked_fp4(values, values_name)
        R, C = q.shape
    else:
        want = "an FP8" if scheme.type == "float" else "an int8"  # naive-quantized stores either
        ok = is_fp8_dtype(values.dtype) if scheme.type == "float" else values.dtype == np.int8
        if not ok or values.ndim != 2:
            raise CheckpointError(f"{where}: {values_name!r} must be {want} matrix for format {scheme.format!r}, "
                                  f"got {values.dtype} {tuple(values.shape)}")
        R, C = values.shape
        q = np.asarray(values, np.float32)
    s = expanded_scale(scale, scheme, (R, C), get(module + ".weight_g_idx"), scale_name, where)
    if scheme.format == "nvfp4-pack-quantized":
        g = get(module + ".weight_global_scale")
        if g is None or np.asarray(g).size != 1 or not is_floating_dtype(np.dtype(g.dtype)):
            raise CheckpointError(f"{where}: NVFP4 weight {values_name!r} needs one floating "
                                  f"{module}.weight_global_scale")
        s = s / np.asarray(g, np.float32).reshape(())  # the group scales are stored times the global one
    if zero is not None:  # written for asymmetric schemes only
        z = np.asarray(zero)
        if scheme.format == "pack-quantized":  # packed along the output axis
            z = unpacked_ints(z.T, scheme.num_bits, R, module + ".weight_zero_point").T
        q = q - expanded_scale(np.asarray(z, np.float32), scheme, (R, C), get(module + ".weight_g_idx"),
                               module + ".weight_zero_point", where)
    return q * s


__all__ = ["METHOD", "FORMATS", "STRATEGIES", "WeightScheme", "compressed_schemes", "scheme_of", "unpacked_ints",
           "unpacked_fp4", "expanded_scale", "dequantized_compressed", "dequantized_weight"]
