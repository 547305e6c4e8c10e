"""Checkpoint I/O: Hugging Face directories (config.json + safetensors) to and from
``(config dict, {name: numpy array})``, with strict checks. Imports nothing else of the
library; families use ``check_tensors`` and ``CheckpointError`` for their mappings.

The safetensors format is read and written here directly (an 8-byte header length,
a JSON header, raw little-endian data) so that bfloat16 works through ``ml_dtypes``
and a damaged file gets an error naming the file and the problem.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in _DTYPES.items()}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the problem."""


# --------------------------------------------------------------------------- safetensors

def read_safetensors(path) -> dict[str, np.ndarray]:
    """Read every tensor of one ``.safetensors`` file into numpy arrays."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({len(data)} bytes, no header)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise CheckpointError(f"{path}: truncated safetensors file (header says {n} bytes, "
                              f"file has {len(data) - 8})")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON object is expected, "
                              f"got {type(header).__name__})")
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r} needs dtype, shape "
                                  f"and data_offsets, got {info!r}")
        code = info["dtype"]
        if code not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {code!r} "
                                  f"(supported: {', '.join(_DTYPES)})")
        dt = _DTYPES[code]
        offs, shape = info["data_offsets"], info["shape"]
        ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                    for x in v)
        if not ints(offs) or len(offs) != 2 or offs[1] < offs[0] or not ints(shape):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r} has shape {shape!r} "
                                  f"and data_offsets {offs!r} (non-negative ints, start <= end expected)")
        start, end = offs
        shape = tuple(shape)
        if end > len(body):
            raise CheckpointError(f"{path}: truncated safetensors file (tensor {name!r} needs bytes "
                                  f"{start}..{end}, only {len(body)} present)")
        if end - start != dt.itemsize * int(np.prod(shape)):
            raise CheckpointError(f"{path}: tensor {name!r} has {end - start} bytes for shape {shape}")
        out[name] = np.frombuffer(body[start:end], dtype=dt).reshape(shape).copy()
    return out


def write_safetensors(path, tensors: Mapping[str, np.ndarray], metadata: dict | None = None):
    """Write ``{name: array}`` as one ``.safetensors`` file (names sorted, 8-byte aligned)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in _CODES:
            raise CheckpointError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)


# --------------------------------------------------------------------------- HF directories

def read_config(path) -> dict:
    """``config.json`` of a checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a Hugging Face checkpoint dir)")
    cfg = path / "config.json"
    if not cfg.exists():
        raise CheckpointError(f"{path}: no config.json")
    try:
        config = json.loads(cfg.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg}: a JSON object is expected, got {type(config).__name__}")
    return config


def read_index(path) -> dict[str, str]:
    """``weight_map`` (tensor name -> shard file) of ``model.safetensors.index.json``."""
    f = Path(path) / INDEX
    try:
        index = json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict):
        raise CheckpointError(f"{f}: no weight_map")
    bad = [k for k, v in wmap.items() if not isinstance(v, str)]
    if bad:
        raise CheckpointError(f"{f}: weight_map entries must name a shard file; {bad[0]!r} maps to "
                              f"{wmap[bad[0]]!r}")
    return wmap


def read_hf_dir(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a Hugging Face directory: ``config.json`` plus ``model.safetensors`` or shards
    listed in ``model.safetensors.index.json``. Returns ``(config, tensors)``."""
    path = Path(path)
    config = read_config(path)
    if (path / INDEX).exists():
        wmap = read_index(path)
        tensors = {}
        for shard in sorted(set(wmap.values())):
            if not (path / shard).exists():
                raise CheckpointError(f"{path}: shard {shard} listed in {INDEX} is missing")
            part = read_safetensors(path / shard)
            for name, arr in part.items():
                if wmap.get(name) != shard:
                    raise CheckpointError(f"{path / shard}: tensor {name!r} is not mapped to this "
                                          f"shard in {INDEX}")
                tensors[name] = arr
        lost = sorted(set(wmap) - set(tensors))
        if lost:
            where = "; ".join(f"{n!r} (in {wmap[n]})" for n in lost[:5])
            raise CheckpointError(f"{path}: tensors listed in {INDEX} not found in their shard files: "
                                  f"{where}" + (f" and {len(lost) - 5} more" if len(lost) > 5 else ""))
        return config, tensors
    if (path / SINGLE).exists():
        return config, read_safetensors(path / SINGLE)
    raise CheckpointError(f"{path}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")


def write_hf_dir(path, config: dict, tensors: Mapping[str, np.ndarray],
                 max_shard_bytes: int | None = None):
    """Write ``config.json`` and the tensors (one file, or shards of at most
    ``max_shard_bytes`` with an index) in Hugging Face layout."""
    path = Path(path)
    os.makedirs(path, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        write_safetensors(path / SINGLE, tensors, meta)
        return
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        nb = np.asarray(tensors[name]).nbytes
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += nb
    shards.append(cur)
    wmap = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / fname, shard, meta)
        wmap.update({n: fname for n in shard})
    total = sum(np.asarray(t).nbytes for t in tensors.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap},
                                         indent=2, sort_keys=True))


def check_tensors(tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple],
                  optional: Mapping[str, tuple] | None = None, where: str = "checkpoint"):
    """Raise ``CheckpointError`` naming every missing, unexpected or mis-shaped tensor.

    ``expected`` maps required names to shapes; ``optional`` names may be absent.
    """
    optional = dict(optional or {})
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - set(optional))
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    for name, shape in {**optional, **expected}.items():
        if name in tensors and tuple(tensors[name].shape) != tuple(shape):
            problems.append(f"tensor {name} has shape {tuple(tensors[name].shape)}, "
                            f"expected {tuple(shape)}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def cast_floating(tensors: Mapping[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """Cast floating tensors to ``dtype`` (None keeps the checkpoint dtype)."""
    if dtype is None:
        return dict(tensors)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype (use e.g. 'float32', 'bfloat16')") from None
    if not (np.issubdtype(dt, np.floating) or dt == _DTYPES["BF16"]):
        raise ValueError(f"dtype must be a floating type, got {dtype!r}")
    return {k: (v.astype(dt) if (np.issubdtype(v.dtype, np.floating) or v.dtype == _DTYPES["BF16"])
                else v) for k, v in tensors.items()}


__all__ = ["CheckpointError", "read_safetensors", "write_safetensors", "read_config", "read_index", "read_hf_dir",
           "write_hf_dir", "check_tensors", "cast_floating"]
