"""Checkpoint I/O: Hugging Face directories (config.json + safetensors) to and from
``(config dict, {name: numpy array})``, with strict checks. Imports nothing else of the
library; families use ``check_tensors`` and ``CheckpointError`` for their mappings.

Reading is lazy and zero-copy: the header of each ``.safetensors`` file is parsed and
checked here (an 8-byte length, a JSON header, raw little-endian data), then the file is
memory-mapped read-only and every tensor is a numpy view into the mapping, so nothing is
read until a tensor is used and a loaded model holds the only copy of its weights
(``release`` drops the mapped pages of a tensor once it has been copied). bfloat16 works
through ``ml_dtypes``. The checks are stricter than the ``safetensors`` package where a
damaged file could otherwise load: offsets must tile the data section exactly (sorted, no
overlap, no gap), sizes are computed with Python integers (no overflow), names appear once,
shard names in an index stay inside the checkpoint directory. Writing is atomic per file
(temporary file + rename) and removes the files of a previous save that the new one
supersedes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import struct
import tempfile
from pathlib import Path, PurePosixPath
from typing import Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_CODES = {v: k for k, v in _DTYPES.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# the largest header accepted (the safetensors package's limit too): a damaged length field
# must not make us read a whole file as JSON
MAX_HEADER_BYTES = 100_000_000
# shard file names written by ``write_hf_dir`` (and by Hugging Face's save_pretrained)
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the problem."""


# --------------------------------------------------------------------------- safetensors

def _unique_keys(pairs):
    """``json.loads`` object hook: a name given twice is an error, not "the last one wins"."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _strict_json(raw):
    """Parse JSON (bytes or str) with unique keys; ``ValueError`` for anything unreadable
    (bad UTF-8, bad syntax, duplicate keys, absurd nesting)."""
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _is_index_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def read_header(path) -> tuple[dict[str, tuple[np.dtype, tuple, int, int]], dict, int]:
    """Parse and check the header of a ``.safetensors`` file without reading its data.

    Returns ``(tensors, metadata, data_start)``: ``tensors`` maps each name to
    ``(dtype, shape, start, end)`` (byte offsets relative to ``data_start``, the file offset
    of the data section); ``metadata`` is the ``__metadata__`` dict (str -> str).
    Raises ``CheckpointError`` naming the file and the problem: truncated file, header not a
    JSON object, a tensor entry without ``dtype``/``shape``/``data_offsets``, an unknown
    dtype, a byte count that does not match the shape, offsets that overlap, leave gaps or
    do not end at the end of the file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({len(head)} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: corrupt safetensors header (header length {n} exceeds "
                                      f"{MAX_HEADER_BYTES} bytes)")
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated safetensors file (header says {n} bytes, "
                                      f"file has {size - 8})")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
    try:
        header = _strict_json(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON object is expected, "
                              f"got {type(header).__name__})")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ must map strings to "
                              f"strings, got {metadata!r})")
    body = size - 8 - n
    out = {}
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r} needs dtype, shape "
                                  f"and data_offsets, got {info!r}")
        code = info["dtype"]
        if not isinstance(code, str) or code not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {code!r} "
                                  f"(supported: {', '.join(_DTYPES)})")
        dt = _DTYPES[code]
        offs, shape = info["data_offsets"], info["shape"]
        if not _is_index_list(offs) or len(offs) != 2 or offs[1] < offs[0] or not _is_index_list(shape):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r} has shape {shape!r} "
                                  f"and data_offsets {offs!r} (non-negative ints, start <= end expected)")
        start, end = offs
        nbytes = dt.itemsize * math.prod(shape)  # Python ints: no wrap-around
        if end - start != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - start} bytes (data_offsets "
                                  f"{offs}) for shape {tuple(shape)} of {code}, which needs {nbytes}")
        if end > body:
            raise CheckpointError(f"{path}: truncated safetensors file (tensor {name!r} needs bytes "
                                  f"{start}..{end}, only {body} present)")
        out[name] = (dt, tuple(shape), start, end)
    pos, prev = 0, None
    for name, (_, _, start, end) in sorted(out.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if start < pos:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r} (bytes {start}..{end}) "
                                  f"overlaps tensor {prev!r} (which ends at {pos})")
        if start > pos:
            raise CheckpointError(f"{path}: corrupt safetensors header: {start - pos} unused bytes before "
                                  f"tensor {name!r} (bytes {pos}..{start} belong to no tensor)")
        pos, prev = end, name
    if pos != body:
        raise CheckpointError(f"{path}: corrupt safetensors header: the data section has {body} bytes but "
                              f"the tensors cover {pos} (trailing bytes belong to no tensor)")
    return out, metadata, 8 + n


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file, as read-only numpy views into a memory
    map of the file (zero-copy, lazy: pages are read when a tensor is used). The header is
    checked first (``read_header``). Copy a tensor (``np.array(t)``) to own it; do not
    modify the file in place while its views are in use (``write_hf_dir`` replaces files,
    which is safe)."""
    path = Path(path)
    entries, _, data_start = read_header(path)
    if not any(end > start for _, _, start, end in entries.values()):
        return {name: np.zeros(shape, dt) for name, (dt, shape, _, _) in entries.items()}
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot memory-map safetensors file ({e})") from None
    if len(mm) != data_start + max(end for _, _, _, end in entries.values()):
        raise CheckpointError(f"{path}: the file changed size while being read")
    out = {}
    for name, (dt, shape, start, end) in entries.items():
        a = np.frombuffer(mm, dtype=dt, count=(end - start) // dt.itemsize, offset=data_start + start)
        out[name] = a.reshape(shape)
    return out


def release(array) -> None:
    """Tell the OS that the memory-mapped pages under ``array`` (a view returned by
    ``read_safetensors``) are no longer needed, after it has been copied: the pages leave
    this process's resident memory (they are read back from the file if used again).
    A no-op for any other array."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap) or base.closed or not hasattr(base, "madvise"):
        return
    origin = np.frombuffer(base, np.uint8, count=1).ctypes.data
    start = array.ctypes.data - origin
    page = mmap.PAGESIZE
    lo = -(-start // page) * page
    hi = (start + array.nbytes) // page * page
    if hi > lo:
        base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _encode(tensors: Mapping[str, np.ndarray], metadata: dict | None) -> tuple[bytes, list]:
    """Header bytes (8-byte aligned JSON) and the array blobs of a safetensors file."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        code = _CODES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
        if code is None:
            raise CheckpointError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
        a = a.astype(_DTYPES[code], copy=False)
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        blobs.append(a)
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    return struct.pack("<Q", len(hbytes)) + hbytes, blobs


def _write_file(f, header: bytes, blobs) -> None:
    f.write(header)
    for a in blobs:
        if a.nbytes:
            f.write(a.reshape(-1).view(np.uint8).data)


def _temp_in(directory: Path, name: str):
    """A new temporary file next to ``directory / name`` (same file system, so the final
    rename is atomic); returns ``(file object, path)``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    return os.fdopen(fd, "wb"), Path(tmp)


def _atomic_write(path: Path, write) -> Path:
    """Write a temporary file with ``write(f)`` next to ``path`` (flushed and synced);
    returns its path, to be renamed onto ``path`` by the caller."""
    f, tmp = _temp_in(path.parent, path.name)
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_safetensors(path, tensors: Mapping[str, np.ndarray], metadata: dict | None = None):
    """Write ``{name: array}`` as one ``.safetensors`` file (names sorted, 8-byte aligned
    header, little-endian data), atomically: a temporary file renamed onto ``path``."""
    path = Path(path)
    header, blobs = _encode(tensors, metadata)
    tmp = _atomic_write(path, lambda f: _write_file(f, header, blobs))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- HF directories

def read_config(path) -> dict:
    """``config.json`` of a checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a Hugging Face checkpoint dir)")
    cfg = path / "config.json"
    if not cfg.exists():
        raise CheckpointError(f"{path}: no config.json")
    return read_json_object(cfg)


def read_json_object(file) -> dict:
    """The JSON object in ``file``; ``CheckpointError`` naming the file where it is not valid JSON
    or not an object."""
    try:
        config = json.loads(Path(file).read_bytes())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: a JSON object is expected, got {type(config).__name__}")
    return config


def shard_path(path, shard) -> Path:
    """``path / shard`` for a shard name from an index, which must be a relative path that
    stays inside the checkpoint directory (no absolute path, no ``..``, no backslash);
    ``CheckpointError`` otherwise. Symbolic links inside the directory are followed as
    they are (the Hugging Face cache links snapshot files to its blobs)."""
    path = Path(path)
    p = PurePosixPath(shard) if isinstance(shard, str) else None
    if (p is None or not shard or "\\" in shard or "\0" in shard or p.is_absolute() or ".." in p.parts
            or str(p) in ("", ".")):
        raise CheckpointError(f"{path / INDEX}: shard name {shard!r} must be a file name inside the "
                              f"checkpoint directory")
    return path.joinpath(*p.parts)


def read_index(path) -> dict[str, str]:
    """``weight_map`` (tensor name -> shard file) of ``model.safetensors.index.json``;
    every shard name is checked to stay inside the directory."""
    f = Path(path) / INDEX
    try:
        index = _strict_json(f.read_bytes())
    except ValueError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict):
        raise CheckpointError(f"{f}: no weight_map")
    bad = [k for k, v in wmap.items() if not isinstance(v, str)]
    if bad:
        raise CheckpointError(f"{f}: weight_map entries must name a shard file; {bad[0]!r} maps to "
                              f"{wmap[bad[0]]!r}")
    for shard in sorted(set(wmap.values())):
        shard_path(path, shard)
    return wmap


def with_prefixes(tensors: dict, renames, where) -> dict:
    """``tensors`` with every name that starts with a ``(source, target)`` pair's source prefix
    renamed to start with its target (the first pair that applies). ``CheckpointError``
    naming both if two tensors would get one name."""
    return renamed_tensors(((next((new + name[len(old):] for old, new in renames if name.startswith(old)), name),
                             name, t) for name, t in tensors.items()), where)


def renamed_tensors(items, where) -> dict:
    """``{new name: tensor}`` of ``(new name, file name, tensor)`` items; ``CheckpointError``
    naming both file names if two tensors would get one name (a checkpoint holds each tensor
    once, under one of the names it may take)."""
    out, source = {}, {}
    for new, old, t in items:
        if new in out:
            raise CheckpointError(f"{where}: tensors {source[new]!r} and {old!r} would both be {new!r}")
        out[new], source[new] = t, old
    return out


@dataclasses.dataclass(frozen=True)
class Container:
    """A checkpoint type whose language model is a family's model inside a larger one (a
    vision-language model's text part), read as that family's checkpoint.

    Attributes:
      model_type: the outer ``config.json`` ``model_type`` (e.g. ``"qwen3_5"``).
      config_key: the key of the language model's config in it (``"text_config"``); that
        config's own ``model_type`` names the family. ``legacy_config_key``: its older name,
        read where ``config_key`` is absent.
      prefix: the language model's tensor names start with it (``"model.language_model."``);
        it is replaced by ``target`` (``"model."``, the family's own prefix; ``""`` where the
        container holds the whole ``*ForCausalLM``).
      skipped: prefixes of the tensors that are not read (the vision tower, the projector);
        any other tensor is kept for the family's strict name check.
      shared: keys of the outer config that apply to the language model and replace its
        own (the outer class ties the output head: ``tie_word_embeddings``), with their
        values where the outer config leaves them out (its class's defaults).
      aliases: other names of ``shared`` keys in the outer config, which win where present
        (LFM2-VL's ``tie_embedding``).
    """

    model_type: str
    config_key: str
    prefix: str
    skipped: tuple[str, ...] = ()
    shared: dict = dataclasses.field(default_factory=dict)
    aliases: dict = dataclasses.field(default_factory=dict)
    target: str = "model."
    legacy_config_key: str | None = None

    def language_config(self, config: dict, where) -> dict:
        """The language model's config dict: ``config[config_key]`` with the ``shared`` keys
        taken from ``config``. ``CheckpointError`` if there is no such object or it has no
        ``model_type``."""
        inner = config.get(self.config_key)
        if inner is None and self.legacy_config_key is not None:
            inner = config.get(self.legacy_config_key)
        if not isinstance(inner, dict) or not isinstance(inner.get("model_type"), str):
            raise CheckpointError(f"{where}: config.json of model_type {self.model_type!r} has no "
                                  f"{self.config_key!r} object with a model_type (the language model's config)")
        shared = {k: config.get(k, default) for k, default in self.shared.items()}
        shared.update({key: config[alias] for alias, key in self.aliases.items() if alias in config})
        return {**inner, **shared}

    def language_tensors(self, tensors: dict, where) -> dict:
        """The language model's tensors under the family's names (``prefix`` -> ``target``),
        the ``skipped`` ones dropped. ``CheckpointError`` if two would get one name."""
        kept = {k: v for k, v in tensors.items() if not k.startswith(self.skipped)}
        return with_prefixes(kept, ((self.prefix, self.target),), where)

    def file_name(self, name: str) -> str:
        """The name in the container's file of the language model's tensor (or module) ``name``
        (``target`` -> ``prefix``), as the outer config's quantization names them."""
        return self.prefix + name[len(self.target):] if name.startswith(self.target) else name


def without_unread(tensors: dict, patterns) -> dict:
    """``tensors`` without the names any of the regex ``patterns`` finds (``re.search``, as
    transformers applies ``_keys_to_ignore_on_load_unexpected``)."""
    found = [re.compile(p) for p in patterns]
    return {k: v for k, v in tensors.items() if not any(f.search(k) for f in found)}


@dataclasses.dataclass(frozen=True)
class StateDictNames:
    """How transformers (5.x) names a family's tensors in ``model.state_dict()`` where that
    differs from the names it saves and the released checkpoints use (its conversion mapping
    undone): a checkpoint written from a raw state dict is read as the saved form. Each rule
    applies to the names it finds, so files in the saved form, in the state-dict form or in
    a mix of the two all load.

    Attributes:
      renamed: ``(regex, replacement)`` pairs applied in order with ``re.sub`` to every name
        (state-dict names -> saved names); they run first, so the other rules name saved forms.
      stacked: ``{"experts.NAME": [part, ...]}`` (``nn.moe.stack_experts``' table): a tensor
        whose name ends with ``experts.NAME`` holds every expert on its first axis, ``(E, F, ...)``;
        expert ``e``'s slice is its ``experts.{e}.{part}`` tensors joined in equal sizes along
        ``F`` (transformers' fused ``experts.gate_up_proj``: the gate's rows, then the up
        projection's).
      concatenated: ``(suffix, parts)``: a tensor whose name ends with ``suffix`` is the
        concatenation of ``parts`` (replacing ``suffix``) along its first axis, sized as the
        family's shape table says (the q, k and v convolutions fused into one).
    """

    renamed: tuple[tuple[str, str], ...] = ()
    stacked: Mapping[str, list] = dataclasses.field(default_factory=dict)
    concatenated: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def saved_tensors(self, tensors: dict, shapes: Mapping[str, tuple], where) -> dict:
        """``tensors`` under the saved names; the parts are views of the fused tensors (no copy).
        A name is changed only where the result is in ``shapes``, so a tensor the family does
        not read keeps the file's name for the strict check to name.

        Args:
          tensors: ``{name: array}`` as read.
          shapes: ``{saved name: shape}``, the family's shape table for the checkpoint's config
            (required and optional names); it sizes the parts of a ``concatenated`` tensor.
          where: named in errors.
        Raises:
          ``CheckpointError`` naming the tensors when two would get one name, when a stacked
          tensor's second axis does not split into its parts, or when a concatenated tensor's
          rows are not the sum of its parts' rows.
        """
        def rule(rules, name):  # the parts of the rule whose suffix ends ``name`` at a dot, and the name's head
            for suffix, parts in rules:
                if name.endswith("." + suffix):
                    return parts, name[:-len(suffix)]
            return None, None

        def saved(old, t):  # ``(saved name, file name, tensor)`` of one tensor or of each of its parts
            name = old
            for pattern, replacement in self.renamed:
                name = re.sub(pattern, replacement, name)
            parts, head = rule(self.stacked.items(), name)
            if parts is not None and t.ndim >= 1:
                names = [[f"{head}experts.{e}.{part}" for part in parts] for e in range(t.shape[0])]
                if all(n in shapes for row in names for n in row):
                    if t.ndim < 2 or t.shape[1] % len(parts):
                        raise CheckpointError(f"{where}: tensor {old!r} of shape {tuple(t.shape)} should hold the "
                                              f"experts on its first axis and {len(parts)} equal parts on its second")
                    rows = t.shape[1] // len(parts)
                    return [(n, old, t[e, k * rows:(k + 1) * rows]) for e, row in enumerate(names)
                            for k, n in enumerate(row)]
            parts, head = rule(self.concatenated, name)
            if parts is not None and all(head + part in shapes for part in parts):
                names = [head + part for part in parts]
                sizes = [shapes[n][0] for n in names]
                if t.ndim < 1 or t.shape[0] != sum(sizes):
                    raise CheckpointError(f"{where}: tensor {old!r} of shape {tuple(t.shape)} should be "
                                          f"{', '.join(names)} joined ({' + '.join(map(str, sizes))} rows)")
                starts = np.cumsum([0, *sizes]).tolist()
                return [(n, old, t[lo:hi]) for n, lo, hi in zip(names, starts, starts[1:])]
            return [(name if name in shapes else old, old, t)]

        return renamed_tensors((item for old, t in tensors.items() for item in saved(old, t)), where)


# transformers' fine-grained FP8 checkpoints: ``X.weight`` in FP8, ``X.weight_scale_inv`` its per-block scales
FP8_SCALE = "_scale_inv"


def fp8_blocks(config: dict, where) -> tuple[int, int] | None:
    """The ``weight_block_size`` ``(rows, columns)`` of a checkpoint whose ``config.json`` says it is
    quantized by transformers' fine-grained FP8 (``quantization_config.quant_method`` ``"fp8"``,
    dynamic activations; default blocks 128 x 128), None for an unquantized one.
    ``CheckpointError`` naming any other quantization (not read) or a bad block size."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise CheckpointError(f"{where}: config.json's quantization_config has quant_method {method!r}; only "
                              f"transformers' block-wise FP8 checkpoints ('fp8'), compressed-tensors "
                              f"checkpoints ('compressed-tensors') and ModelOpt exports ('modelopt') are read "
                              f"(dequantized on load)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}: the FP8 quantization_config's activation_scheme is "
                              f"{q['activation_scheme']!r}; only 'dynamic' is read")
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: the FP8 quantization_config's weight_block_size must be two positive "
                              f"ints, got {block!r}")
    return tuple(block)


def dequantized_fp8(tensors: dict, blocks: tuple[int, int], dtype, where) -> dict:
    """``tensors`` with every FP8 weight ``X.weight (..., R, C)`` (E4M3 or E5M2) replaced by its value,
    ``X.weight`` times ``X.weight_scale_inv (..., ceil(R / rows), ceil(C / columns))`` broadcast over
    its ``blocks`` (computed in float32, then cast to ``dtype``), and the scales dropped, as
    transformers dequantizes them; the FP8 pages are released once read.

    Args:
      tensors: ``{name: array}`` as read (memory-mapped views).
      blocks: ``(rows, columns)`` of a scale's block (``fp8_blocks``).
      dtype: the dequantized weights' dtype; None: the one dtype of the other floating tensors
        (the checkpoint's, usually bfloat16), float32 where they have several or none.
      where: named in errors.
    Raises:
      ``CheckpointError`` naming an FP8 tensor without its scale, a scale without its FP8
      weight, or a scale of the wrong shape or dtype.
    """
    out_dtype = dequantized_dtype(tensors, dtype, lambda n, t: n.endswith(FP8_SCALE) or is_fp8_dtype(t.dtype))
    rows, cols = blocks
    out = {}
    for name, t in tensors.items():
        if name.endswith(FP8_SCALE):
            weight = name[:-len(FP8_SCALE)]
            if weight not in tensors or not is_fp8_dtype(tensors[weight].dtype):
                raise CheckpointError(f"{where}: tensor {name!r} scales no FP8 tensor {weight!r}")
            continue
        if not is_fp8_dtype(t.dtype):
            out[name] = t
            continue
        scale = tensors.get(name + FP8_SCALE)
        if scale is None:
            raise CheckpointError(f"{where}: FP8 tensor {name!r} has no scales ({name + FP8_SCALE!r})")
        R, C = t.shape[-2:] if t.ndim >= 2 else (None, None)
        if R is None or scale.shape != (*t.shape[:-2], -(-R // rows), -(-C // cols)):
            raise CheckpointError(f"{where}: FP8 tensor {name!r} of shape {tuple(t.shape)} needs scales of shape "
                                  f"(..., ceil(R / {rows}), ceil(C / {cols})) for its {rows} x {cols} blocks; "
                                  f"{name + FP8_SCALE!r} has shape {tuple(scale.shape)}")
        if not is_floating_dtype(np.dtype(scale.dtype)):
            raise CheckpointError(f"{where}: FP8 scales {name + FP8_SCALE!r} must be floating point, got "
                                  f"{_CODES.get(np.dtype(scale.dtype), scale.dtype)}")
        s = np.repeat(np.repeat(np.asarray(scale, np.float32), rows, axis=-2), cols, axis=-1)[..., :R, :C]
        out[name] = (np.asarray(t, np.float32) * s).astype(out_dtype)
        release(t)
        release(scale)
    return out


def dequantized_dtype(tensors: Mapping[str, np.ndarray], dtype, quantized) -> np.dtype:
    """The dtype dequantized weights are given: ``dtype`` where one is asked for; otherwise the one
    dtype of the floating tensors that ``quantized(name, tensor)`` does not mark as quantized
    values or scales (the checkpoint's, usually bfloat16), float32 where they have several or none."""
    if dtype is not None:
        return np.dtype(dtype)
    others = {np.dtype(t.dtype) for n, t in tensors.items()
              if is_floating_dtype(np.dtype(t.dtype)) and not quantized(n, t)}
    return others.pop() if len(others) == 1 else np.dtype(np.float32)


def is_fp8_dtype(dt) -> bool:
    """Whether ``dt`` is one of the safetensors FP8 types (E4M3, E5M2)."""
    return np.dtype(dt) in (_DTYPES["F8_E4M3"], _DTYPES["F8_E5M2"])


def vision_language(model_type: str, skipped: tuple[str, ...], tied: bool, aliases: tuple[str, ...] = ()) -> Container:
    """The ``Container`` of a transformers vision-language checkpoint type laid out as its
    ``*ForConditionalGeneration`` saves it: the language model's config under
    ``text_config``, its tensors under ``model.language_model.``, the output head tied by the
    outer config's ``tie_word_embeddings`` (default ``tied``, the class's; ``aliases`` of it
    win), and the tensors under ``skipped`` (vision tower, projector) not read."""
    return Container(model_type=model_type, config_key="text_config", prefix="model.language_model.",
                     skipped=skipped, shared={"tie_word_embeddings": tied},
                     aliases={alias: "tie_word_embeddings" for alias in aliases})


def read_hf_dir(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a Hugging Face directory: ``config.json`` plus ``model.safetensors`` or shards
    listed in ``model.safetensors.index.json`` (``model.safetensors`` wins when both exist,
    as in ``transformers``). Returns ``(config, tensors)``; the tensors are read-only views
    into memory maps (see ``read_safetensors``)."""
    path = Path(path)
    config = read_config(path)
    if (path / SINGLE).exists():
        return config, read_safetensors(path / SINGLE)
    if (path / INDEX).exists():
        wmap = read_index(path)
        tensors = {}
        for shard in sorted(set(wmap.values())):
            file = shard_path(path, shard)
            if not file.is_file():
                raise CheckpointError(f"{path}: shard {shard} listed in {INDEX} is missing")
            part = read_safetensors(file)
            for name, arr in part.items():
                if wmap.get(name) != shard:
                    raise CheckpointError(f"{file}: tensor {name!r} is not mapped to this "
                                          f"shard in {INDEX}")
                tensors[name] = arr
        lost = sorted(set(wmap) - set(tensors))
        if lost:
            where = "; ".join(f"{n!r} (in {wmap[n]})" for n in lost[:5])
            raise CheckpointError(f"{path}: tensors listed in {INDEX} not found in their shard files: "
                                  f"{where}" + (f" and {len(lost) - 5} more" if len(lost) > 5 else ""))
        return config, tensors
    raise CheckpointError(f"{path}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")


def _weight_files(path: Path) -> set[str]:
    """The weight files a previous save may have left in ``path``: the single file, the
    index, the shards it lists (when readable) and files named like shards."""
    names = {p.name for p in path.iterdir() if p.is_file()}
    found = {n for n in names if n in (SINGLE, INDEX) or SHARD_NAME.fullmatch(n)}
    if INDEX in found:
        try:
            found |= set(read_index(path).values()) & names  # plain file names only
        except CheckpointError:
            pass  # an unreadable old index is removed; the shards it named cannot be known
    return found


def write_hf_dir(path, config: dict, tensors: Mapping[str, np.ndarray],
                 max_shard_bytes: int | None = None):
    """Write ``config.json`` and the tensors (one file, or shards of at most
    ``max_shard_bytes`` with an index) in Hugging Face layout.

    Every file is written to a temporary file in ``path`` and renamed into place (shards
    first, then the index or single file, then ``config.json``), so a reader never sees a
    half-written file; then the weight files of a previous save that the new one does not
    use (an old index, single file or shards) are removed, so the directory holds exactly
    the new model. Other files (tokenizer, generation config) are kept."""
    path = Path(path)
    os.makedirs(path, exist_ok=True)
    old = _weight_files(path)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        files = [(SINGLE, dict(tensors))]
    else:
        shards, cur, size = [], {}, 0
        for name in sorted(tensors):
            nb = np.asarray(tensors[name]).nbytes
            if cur and size + nb > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[name] = tensors[name]
            size += nb
        shards.append(cur)
        files = [(f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors", s) for k, s in enumerate(shards)]
    temps = []
    try:
        for fname, part in files:
            header, blobs = _encode(part, meta)
            temps.append((_atomic_write(path / fname, lambda f: _write_file(f, header, blobs)), fname))
        if max_shard_bytes is not None:
            wmap = {n: fname for fname, part in files for n in part}
            total = sum(np.asarray(t).nbytes for t in tensors.values())
            text = json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2, sort_keys=True)
            temps.append((_atomic_write(path / INDEX, lambda f: f.write(text.encode())), INDEX))
        text = json.dumps(config, indent=2, sort_keys=True)
        temps.append((_atomic_write(path / "config.json", lambda f: f.write(text.encode())), "config.json"))
    except BaseException:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, fname in temps:
        os.replace(tmp, path / fname)
    for fname in sorted(old - {f for _, f in temps}):
        (path / fname).unlink(missing_ok=True)


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


def is_floating_dtype(dt) -> bool:
    """Whether ``dt`` (an ``np.dtype``) is a floating type the models compute in: numpy's or bfloat16 (not FP8)."""
    return np.issubdtype(dt, np.floating) or dt == _DTYPES["BF16"]


def check_floating(tensors: Mapping[str, np.ndarray], where: str = "checkpoint"):
    """Raise ``CheckpointError`` naming every tensor whose dtype is not floating: model
    parameters are floating point, and an integer or boolean weight would otherwise load
    and silently truncate what is computed from it."""
    bad = [(n, np.dtype(t.dtype)) for n, t in sorted(tensors.items()) if not is_floating_dtype(np.dtype(t.dtype))]
    if bad:
        what = ", ".join(f"{n} ({_CODES.get(d, str(d))})" for n, d in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        fp8 = "" if not any(is_fp8_dtype(d) for _, d in bad) else (
            " (FP8 tensors are read from transformers' fine-grained FP8 checkpoints, quantization_config "
            "with quant_method 'fp8' and X.weight_scale_inv scales, from compressed-tensors ones, and "
            "from ModelOpt exports, described in hf_quant_config.json)")
        raise CheckpointError(f"{where}: parameters must be floating point ({', '.join(FLOAT_CODES)}); "
                              f"non-floating tensors: {what}{more}{fp8}")


def floating_dtype(dtype):
    """``np.dtype`` of a floating ``dtype`` argument (None stays None); ``ValueError`` otherwise."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype (use e.g. 'float32', 'bfloat16')") from None
    if not is_floating_dtype(dt):
        raise ValueError(f"dtype must be a floating type, got {dtype!r}")
    return dt


def cast_floating(tensors: Mapping[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """Cast floating tensors to ``dtype`` (None keeps the checkpoint dtype)."""
    dt = floating_dtype(dtype)
    if dt is None:
        return dict(tensors)
    return {k: (v.astype(dt) if is_floating_dtype(v.dtype) else v) for k, v in tensors.items()}


__all__ = ["CheckpointError", "Container", "StateDictNames", "FP8_SCALE", "fp8_blocks", "dequantized_fp8",
           "dequantized_dtype", "is_floating_dtype", "is_fp8_dtype",
           "vision_language", "without_unread", "with_prefixes", "renamed_tensors", "read_header",
           "read_safetensors", "release", "write_safetensors", "read_config", "read_json_object", "read_index",
           "shard_path",
           "read_hf_dir", "write_hf_dir", "check_tensors", "check_floating", "floating_dtype", "cast_floating",
           "SINGLE", "INDEX", "FLOAT_CODES", "MAX_HEADER_BYTES"]
