"""Loading and saving whole models in Hugging Face layout, through the registry.

A checkpoint is named either by a local directory (``config.json`` + safetensors) or by a
Hugging Face repository id (``"ORG/NAME"``) that is already in the local Hugging Face cache
(the standard ``models--ORG--NAME/{blobs,refs,snapshots}`` layout, found through
``HF_HUB_CACHE``, ``HF_HOME`` or ``~/.cache/huggingface/hub`` as ``huggingface_hub`` does).
Nothing here touches the network: a repository that is not cached is an error saying how to
get it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import numpy as np

from .nn.checkpoint import (INDEX, SINGLE, CheckpointError, check_floating, floating_dtype, read_config, release,
                            write_hf_dir)
from .nn.checks import as_device_array
from .registry import FAMILIES, checkpoint_family, family, read_family_checkpoint

# ORG/NAME with Hugging Face's characters (letters, digits, "-", "_", "."); exactly one "/".
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# weight files of other frameworks, named when a checkpoint has no safetensors
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.msgpack", "*.h5", "*.gguf")
_PICKLES = ("*.bin", "*.pth", "*.pt")
TOKENIZER = "tokenizer.json"


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process uses, read from the environment at call time
    with ``huggingface_hub``'s precedence: ``HF_HUB_CACHE``, then the legacy
    ``HUGGINGFACE_HUB_CACHE``, then ``$HF_HOME/hub``, then
    ``$XDG_CACHE_HOME/huggingface/hub`` (default ``~/.cache/huggingface/hub``)."""
    env = os.environ
    raw = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not raw:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        raw = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(raw)))


def is_repo_id(name) -> bool:
    """Whether ``name`` is a string of Hugging Face repository id form ``ORG/NAME``."""
    return isinstance(name, str) and _REPO_ID.fullmatch(name) is not None


def resolve(path_or_repo_id, revision: str | None = None) -> Path:
    """The local directory holding a checkpoint.

    Args:
      path_or_repo_id: an existing local directory (used as it is, even if it also looks like
        a repo id), or a Hugging Face repository id ``"ORG/NAME"`` already in the local cache
        (``hub_cache_dir()``); the snapshot directory of ``revision`` is returned.
      revision: branch, tag or commit hash of a cached repository (default ``"main"``); only
        for repository ids.
    Returns:
      A ``Path`` to the directory (for a cached repository,
      ``<cache>/models--ORG--NAME/snapshots/<commit>``).
    Raises:
      ``CheckpointError`` naming the problem: neither a directory nor a repository id, a
      repository (or revision) not in the cache (with where it looked and how to get it),
      ``revision`` given with a local directory.
    """
    if isinstance(path_or_repo_id, (str, os.PathLike)) and Path(path_or_repo_id).exists():
        if revision is not None:
            raise CheckpointError(f"{path_or_repo_id}: revision={revision!r} applies to Hugging Face repository "
                                  f"ids, not to a local directory")
        return Path(path_or_repo_id)
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise CheckpointError(f"a checkpoint is a directory or a Hugging Face repository id 'ORG/NAME', got "
                              f"{type(path_or_repo_id).__name__} {path_or_repo_id!r}")
    if not is_repo_id(path_or_repo_id):
        raise CheckpointError(f"{path_or_repo_id}: no such directory, and not a Hugging Face repository id "
                              f"of the form 'ORG/NAME'")
    return _cached_snapshot(path_or_repo_id, revision)


def weight_bytes(path_or_repo_id, revision: str | None = None) -> int:
    """Bytes of safetensors weights a checkpoint holds (its ``*.safetensors`` files; 0 if it
    has none), read from the file system without loading anything. ``CheckpointError`` as
    ``resolve`` for a checkpoint that cannot be found."""
    path = resolve(path_or_repo_id, revision)
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    """Snapshot directory of a cached repository, through ``huggingface_hub`` with
    ``local_files_only=True`` (no network)."""
    # imported here, not at the top: only repository ids need it (0.5 s to import)
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError

    # recent huggingface_hub versions tell an incomplete cached snapshot apart from a missing one
    incomplete = getattr(hf_errors, "IncompleteSnapshotError", ())

    cache = hub_cache_dir()
    rev = "main" if revision is None else revision
    try:
        return Path(snapshot_download(repo_id, revision=rev, cache_dir=str(cache), local_files_only=True))
    except HFValidationError as e:
        raise CheckpointError(f"{repo_id}: no such directory, and not a valid Hugging Face repository id "
                              f"({e})") from None
    except incomplete as e:  # a cached tree listing shows files missing from the snapshot
        raise CheckpointError(f"{repo_id}: the cached snapshot is incomplete ({e}); nothing is downloaded here, "
                              f"pass a complete local directory instead") from None
    except LocalEntryNotFoundError:
        repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
        if repo_dir.is_dir():
            refs = sorted(p.relative_to(repo_dir / "refs").as_posix()
                          for p in (repo_dir / "refs").rglob("*") if p.is_file())
            snaps = sorted(p.name for p in (repo_dir / "snapshots").glob("*"))
            what = (f"revision {rev!r} of {repo_id} is not in the local Hugging Face cache ({repo_dir} has "
                    f"refs [{', '.join(refs)}], snapshots [{', '.join(snaps)}])")
            fetch = f"hf download {repo_id} --revision {rev}"
        else:
            what = f"{repo_id} is not in the local Hugging Face cache (looked for {repo_dir})"
            fetch = f"hf download {repo_id}"
        raise CheckpointError(
            f"{what}; nothing is downloaded here. Get it on a machine with network access with "
            f"`{fetch}` (older huggingface_hub: `huggingface-cli download ...`) into this cache, or point "
            f"HF_HUB_CACHE / HF_HOME at a cache that has it, or pass a local checkpoint directory") from None


def pickle_files(path: Path) -> list[str]:
    """Names of the PyTorch pickle weight files (``.bin``, ``.pth``, ``.pt``) in directory ``path``."""
    if not path.is_dir():
        return []
    return sorted({p.name for pat in _PICKLES for p in path.glob(pat)})


def _check_safetensors(path: Path, name) -> None:
    """``CheckpointError`` naming the weight files present when ``path`` has no safetensors."""
    if (path / SINGLE).exists() or (path / INDEX).exists() or not path.is_dir():
        return
    others = sorted({p.name for pat in _OTHER_WEIGHTS for p in path.glob(pat)})
    found = f"it has {', '.join(others)} but " if others else "it has "
    where = f"{name} ({path})" if str(name) != str(path) else str(path)
    how = (f"; PyTorch pickles are never unpickled by load: convert them once with `implicit-attn convert "
           f"{path} OUT_DIR` (reads them with torch.load(weights_only=True)) and load OUT_DIR"
           if pickle_files(path) else "")
    raise CheckpointError(f"{where}: {found}no {SINGLE} or {INDEX}; only safetensors weights are read "
                          f"(convert them, e.g. with transformers' save_pretrained(safe_serialization=True), "
                          f"or use a revision of the repository that has safetensors){how}")


def load(path_or_repo_id, dtype=None, revision: str | None = None, sharding_of=None):
    """Load a Hugging Face checkpoint (local directory or cached repository id) as a JAX model.

    Args:
      path_or_repo_id: directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``), or a repository id ``"ORG/NAME"`` (e.g.
        ``"state-spaces/mamba-130m-hf"``) already in the local Hugging Face cache (see
        ``resolve``; nothing is downloaded). ``model_type`` in the config picks the family;
        for a container type (``registry.CONTAINERS``: vision-language checkpoints such as
        Qwen3.5's) its language model is loaded, and the vision side is not read. Tensors
        may carry the names transformers saves or those of its ``state_dict()``, and a
        fine-grained FP8, compressed-tensors or ModelOpt checkpoint is dequantized
        (``registry.read_family_checkpoint``).
      dtype: optional floating dtype to cast parameters to (default: keep the checkpoint's;
        dequantized weights take the dtype of its other tensors).
      revision: branch, tag or commit of a cached repository (default ``"main"``).
      sharding_of: optional ``(tensor name, shape) -> jax.sharding.Sharding``: each tensor is
        then built with ``jax.make_array_from_callback``, every device reading only its own
        slice from the memory-mapped file (no device ever holds a whole sharded tensor; see
        ``analyze.model_sharding`` for a rule over a mesh's model axis).
    Returns:
      The family's ``LM`` (an NNX module): ``model(ids)`` with ids ``(B, L)`` gives logits
      ``(B, L, vocab)``; ``model.operators(ids)``, ``model.layers[i]``. ``model.source`` is the
      directory read.
    Raises:
      ``CheckpointError`` for a missing/uncached/unreadable/mismatched checkpoint or one with
      no safetensors weights, ``ValueError`` for an unknown ``model_type``.
    """
    path = resolve(path_or_repo_id, revision)
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type is None:
        if pickle_files(path):  # e.g. mamba_ssm's config.json + pytorch_model.bin: say how to convert
            _check_safetensors(path, path_or_repo_id)
        raise CheckpointError(f"{path}: config.json has no model_type; supported: {sorted(FAMILIES)}")
    checkpoint_family(config, path)  # fails early for unknown types
    _check_safetensors(path, path_or_repo_id)
    dt = floating_dtype(dtype)
    # header-checked views into memory maps (nothing read yet), as the family reads them
    spec, config, tensors = read_family_checkpoint(path, dt)
    check_floating(tensors, where=str(path))
    spec.to_params(config, tensors)  # config and every name and shape checked before any data is read
    arrays = {}
    for name in sorted(tensors):  # one tensor at a time: its pages are dropped once copied
        view = tensors.pop(name)
        if sharding_of is None:
            arrays[name] = as_device_array(view if dt is None else view.astype(dt)).block_until_ready()  # copied...
        else:
            arrays[name] = sharded_array(view, sharding_of(name, view.shape), dt)
        release(view)  # ...before the pages go
        del view
    cfg, params = spec.to_params(config, arrays)
    model = spec.lm(cfg, params)
    model.source = str(path)
    return model


def sharded_array(view, sharding, dtype=None):
    """A ``jax.Array`` with ``sharding`` whose device slices are read from ``view`` (a
    memory-mapped tensor) one slice at a time, cast to ``dtype`` (None: kept)."""
    def read(index):
        part = np.asarray(view[index])
        return part if dtype is None else part.astype(dtype)

    return jax.make_array_from_callback(view.shape, sharding, read).block_until_ready()


def load_tokenizer(path_or_repo_id, revision: str | None = None):
    """The checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None if it has none.

    ``path_or_repo_id`` and ``revision`` are as in ``load`` (a local directory or a cached
    repository id; errors as there).
    """
    p = resolve(path_or_repo_id, revision) / TOKENIZER
    if not p.is_file():
        return None
    from tokenizers import Tokenizer  # imported here: only checkpoints with a tokenizer need it

    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - the tokenizers error types are not exported
        raise CheckpointError(f"{p}: not a readable tokenizers file ({e})") from None


def tokenize(path_or_repo_id, text: str, revision: str | None = None) -> tuple[np.ndarray, list[str]]:
    """Token ids of ``text`` with the checkpoint's ``tokenizer.json``.

    Returns:
      ``(ids, tokens)``: int64 ids of shape ``(1, L)`` and the ``L`` token strings.
    Raises:
      ``CheckpointError`` if the checkpoint has no ``tokenizer.json`` (give token ids instead),
      ``ValueError`` if ``text`` tokenizes to nothing.
    """
    tok = load_tokenizer(path_or_repo_id, revision)
    if tok is None:
        where = resolve(path_or_repo_id, revision)
        raise CheckpointError(f"{path_or_repo_id}: no {TOKENIZER} in {where}, so text cannot be tokenized; "
                              f"give token ids instead (--ids on the command line)")
    enc = tok.encode(text)
    if not enc.ids:
        raise ValueError(f"text {text!r} tokenizes to nothing")
    return np.asarray(enc.ids, np.int64)[None], list(enc.tokens)


def save(model, path, max_shard_bytes: int | None = None):
    """Write ``model`` back to Hugging Face layout (config.json + safetensors, sharded with
    an index when ``max_shard_bytes`` is given). Each file is written to a temporary file
    and renamed into place, and the weight files of an earlier save into ``path`` that this
    one supersedes (an old index, single file or shards) are removed, so ``load(path)``
    returns this model."""
    config, tensors = family(model.family).from_params(model.config, model.params())
    write_hf_dir(path, config, tensors, max_shard_bytes=max_shard_bytes)


def family_of(path_or_repo_id, revision: str | None = None) -> str:
    """``model_type`` of a checkpoint (local directory or cached repository id)."""
    return read_config(resolve(path_or_repo_id, revision)).get("model_type")


__all__ = ["load", "sharded_array", "save", "family_of", "resolve", "load_tokenizer", "tokenize", "hub_cache_dir", "is_repo_id",
           "weight_bytes", "CheckpointError", "TOKENIZER"]
