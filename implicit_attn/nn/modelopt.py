"""Checkpoints exported by NVIDIA's Model Optimizer (ModelOpt: NVIDIA's FP8 and NVFP4 releases,
e.g. of Nemotron-H and Nemotron-3), dequantized to plain weights on load.

The quantization is described by ``hf_quant_config.json`` (``{"producer": {"name": "modelopt"},
"quantization": {"quant_algo": ..., "exclude_modules": [...], ...}}``) and, in newer exports, by
``config.json``'s ``quantization_config`` with ``"quant_method": "modelopt"`` too. Each quantized
linear ``X`` holds:

- ``FP8``: ``X.weight`` in FP8 E4M3 and one float32 ``X.weight_scale``;
- ``FP8_PER_CHANNEL_PER_TOKEN``: the same with one scale per output row, ``X.weight_scale (R,)``;
- ``NVFP4`` and ``W4A16_NVFP4``: ``X.weight (R, C / 2)`` uint8, two FP4 E2M1 values a byte (the low
  nibble first), ``X.weight_scale (R, C / 16)`` in FP8, and one float32 ``X.weight_scale_2``; the
  weight is ``value * weight_scale * weight_scale_2``;
- ``MIXED_PRECISION``: one of these per layer, as ``quantized_layers`` lists.

Activation and KV-cache scales (``X.input_scale``, ``k_scale``, ``v_scale``) are dropped: the model
computes with the dequantized weights and does not quantize activations.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, dequantized_dtype, is_fp8_dtype, read_json_object, release
from .compressed import WeightScheme, expanded_scale, unpacked_fp4

METHOD = "modelopt"
QUANT_CONFIG = "hf_quant_config.json"
ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4", "W4A16_NVFP4")
NVFP4_GROUP = 16
# each algorithm's scale layout, as the compressed-tensors strategy that has it
LAYOUTS = {
    "FP8": WeightScheme("float-quantized", 8, "float", "tensor", None, None, True, ()),
    "FP8_PER_CHANNEL_PER_TOKEN": WeightScheme("float-quantized", 8, "float", "channel", None, None, True, ()),
    "NVFP4": WeightScheme("nvfp4-pack-quantized", 4, "float", "tensor_group", NVFP4_GROUP, None, True, ()),
    "W4A16_NVFP4": WeightScheme("nvfp4-pack-quantized", 4, "float", "tensor_group", NVFP4_GROUP, None, True, ()),
}
# scales of what a serving engine quantizes besides the weights, dropped on load
ACTIVATION_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale", "q_scale")


@dataclasses.dataclass(frozen=True)
class ModelOptScheme:
    """A ModelOpt checkpoint's weight quantization: ``algo`` (one of ``ALGOS`` or
    ``"MIXED_PRECISION"``) and, for the latter, each quantized layer's algorithm."""
    algo: str
    layers: tuple[tuple[str, str], ...] = ()

    def algo_of(self, module: str, where) -> str:
        """The algorithm of quantized linear ``module``; ``CheckpointError`` where a mixed-precision
        checkpoint does not list it."""
        if self.algo != "MIXED_PRECISION":
            return self.algo
        found = dict(self.layers).get(module)
        if found is None:
            raise CheckpointError(f"{where}: {module!r} holds quantized tensors but is not among the "
                                  f"ModelOpt config's quantized_layers")
        return found


def quant_config_section(hf_quant_config: dict, where) -> dict:
    """``config.json``'s ``quantization_config`` for a checkpoint that describes its quantization in
    ``hf_quant_config.json`` only (older ModelOpt exports): its ``quantization`` section with
    ``"quant_method": "modelopt"``. ``CheckpointError`` where the file is not ModelOpt's."""
    producer = hf_quant_config.get("producer") or {}
    section = hf_quant_config.get("quantization")
    if producer.get("name", METHOD) != METHOD or not isinstance(section, dict):  # copies may omit the producer
        raise CheckpointError(f"{where}: {QUANT_CONFIG} is not a ModelOpt export (producer "
                              f"{producer.get('name')!r}, {'a' if isinstance(section, dict) else 'no'} quantization section)")
    return {**section, "quant_method": METHOD}


def with_hf_quant_config(config: dict, path) -> dict:
    """``config`` (of the checkpoint directory ``path``) with a ``quantization_config`` made from
    ``path/hf_quant_config.json`` (``quant_config_section``) where it has none and that file exists;
    ``config`` itself otherwise."""
    file = Path(path) / QUANT_CONFIG
    if "quantization_config" in config or not file.is_file():
        return config
    return {**config, "quantization_config": quant_config_section(read_json_object(file), file)}


def modelopt_scheme(config: dict, where) -> ModelOptScheme | None:
    """The ``ModelOptScheme`` of a ``config.json`` dict whose ``quantization_config`` says
    ``"quant_method": "modelopt"`` (see ``quant_config_section``), None otherwise.
    ``CheckpointError`` naming an algorithm outside ``ALGOS`` (AWQ, MXFP8, ...)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != METHOD:
        return None
    algo = q.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise CheckpointError(f"{where}: the ModelOpt config's MIXED_PRECISION has no quantized_layers")
        out = []
        for name, layer in sorted(layers.items()):
            each = layer.get("quant_algo") if isinstance(layer, dict) else None
            _check_algo(each, f"{where}: ModelOpt layer {name!r}")
            _check_group(layer.get("group_size"), each, f"{where}: ModelOpt layer {name!r}")
            out.append((name, each))
        return ModelOptScheme(algo, tuple(out))
    _check_algo(algo, f"{where}: the ModelOpt config")
    _check_group(q.get("group_size"), algo, f"{where}: the ModelOpt config")
    return ModelOptScheme(algo)


def _check_algo(algo, what) -> None:
    if algo not in ALGOS:
        raise CheckpointError(f"{what} has quant_algo {algo!r}; read: {', '.join(ALGOS)} and MIXED_PRECISION of them")


def _check_group(group_size, algo, what) -> None:
    if "NVFP4" in str(algo) and group_size not in (None, NVFP4_GROUP):
        raise CheckpointError(f"{what} has NVFP4 groups of {group_size!r}; read: {NVFP4_GROUP}")


def dequantized_modelopt(tensors: dict, scheme: ModelOptScheme, dtype, where, file_name=None) -> dict:
    """``tensors`` with every ModelOpt quantized linear's weight ``X.weight (R, C)`` computed in
    float32 from its values and scales (module docstring) and cast to ``dtype`` (None: the
    checkpoint's other floating tensors' dtype, ``dequantized_dtype``), its scales and the
    activation and KV-cache scales dropped. Memory-mapped parts are released once read.
    ``file_name`` (default: the identity) maps a module's name here to the one
    ``quantized_layers`` uses (a container's language model, ``Container.file_name``).

    Raises:
      ``CheckpointError`` naming values without scales, scales without values, an AWQ
      ``pre_quant_scale`` (not read), or a dtype or shape the algorithm does not store.
    """
    scale_names = [n for n in tensors if n.endswith(".weight_scale")]
    quantized = {n.removesuffix("_scale") for n in scale_names}
    dropped = {n for n in tensors if n.rpartition(".")[2] in ACTIVATION_SCALES}
    for name in tensors:
        if name.endswith(".pre_quant_scale"):
            raise CheckpointError(f"{where}: {name!r} is an AWQ input scale; ModelOpt's AWQ checkpoints are not read")
        if name.endswith(".weight_scale_2") and name.removesuffix("_2") not in tensors:
            raise CheckpointError(f"{where}: {name!r} scales no quantized weight")
        if name.endswith(".weight") and name not in quantized and (
                is_fp8_dtype(tensors[name].dtype) or tensors[name].dtype == np.uint8):
            raise CheckpointError(f"{where}: quantized weight {name!r} has no scales ({name}_scale)")
    parts = quantized | {w + "_scale" for w in quantized} | {w + "_scale_2" for w in quantized} | dropped
    out_dtype = dequantized_dtype(tensors, dtype, lambda n, t: n in parts)
    out = {n: t for n, t in tensors.items() if n not in parts}
    for weight in sorted(quantized):
        if weight not in tensors:
            raise CheckpointError(f"{where}: {weight + '_scale'!r} scales no weight {weight!r}")
        module = weight.removesuffix(".weight")
        algo = scheme.algo_of(module if file_name is None else file_name(module), where)
        out[weight] = dequantized_weight(tensors, weight, algo, where).astype(out_dtype)
    for name in parts & set(tensors):
        release(tensors[name])
    return out


def dequantized_weight(tensors: dict, weight: str, algo: str, where) -> np.ndarray:
    """One quantized linear's weight ``(R, C)`` float32 from ``weight``, ``weight + "_scale"`` and
    (NVFP4) ``weight + "_scale_2"`` in ``tensors``, as ``algo`` stores them (its scales laid out as
    the compressed-tensors strategy ``LAYOUTS[algo]``, ``compressed.expanded_scale``)."""
    values, scale = tensors[weight], tensors[weight + "_scale"]
    nvfp4 = algo in ("NVFP4", "W4A16_NVFP4")
    if nvfp4:
        second = tensors.get(weight + "_scale_2")
        if not is_fp8_dtype(scale.dtype):
            raise CheckpointError(f"{where}: NVFP4 scales {weight + '_scale'!r} must be FP8, got {scale.dtype}")
        if second is None or second.size != 1 or not np.issubdtype(np.dtype(second.dtype), np.floating):
            raise CheckpointError(f"{where}: NVFP4 weight {weight!r} needs one float {weight + '_scale_2'!r}")
        q = unpacked_fp4(values, weight)
    else:
        if not is_fp8_dtype(values.dtype) or values.ndim != 2:
            raise CheckpointError(f"{where}: {algo} weight {weight!r} must be an FP8 matrix, got {values.dtype} "
                                  f"{tuple(values.shape)}")
        q = np.asarray(values, np.float32)
    s = expanded_scale(scale, LAYOUTS[algo], q.shape, None, weight + "_scale", where)
    if nvfp4:
        s = s * np.asarray(second, np.float32).reshape(())  # group scale x second-level scale, then x value
    return q * s


__all__ = ["METHOD", "QUANT_CONFIG", "ALGOS", "LAYOUTS", "ModelOptScheme", "quant_config_section", "with_hf_quant_config",
           "modelopt_scheme",
           "dequantized_modelopt", "dequantized_weight"]
