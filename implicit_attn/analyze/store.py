"""The results store: a Zarr v3 hierarchy written with TensorStore.

Layout under ``STORE/``: ``zarr.json`` (the root group; its attributes hold the manifest),
``manifest.json`` (the same manifest, plain JSON; ``paths`` and ``library_version`` are
informational, the rest must match for a run to resume), and one array per result, one example
per chunk (so processes writing different rows never touch the same file):

    ids        (N, Lmax) int32    the example's tokens, -1 after its length
    length     (N,)      int32
    line       (N,)      int64    line of the corpus file (item index for sequences)
    done       (N,)      uint8    1 once every other array of the row is written
    ...        one array per analysis result (``manifest["arrays"]`` lists them)

A row's ``done`` is written only after all its other chunks are (each chunk is written to a
temporary file and renamed into place by TensorStore), so a killed run never leaves a row
that reads as done with missing data. Reopening a store checks that the manifest's model,
corpus and settings are those of the run (``StoreMismatch`` otherwise).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import tensorstore as ts

MANIFEST = "manifest.json"
FORMAT = "implicit_attn.analyze/1"
CHECKED = ("format", "settings", "model", "corpus", "arrays")  # the order of the messages


class StoreMismatch(ValueError):
    """An existing store was written with other settings, model or corpus."""


def array_spec(path: Path, name: str) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / name)}}


def create_array(path: Path, name: str, shape, dtype: str, fill) -> ts.TensorStore:
    """A zarr v3 array chunked one row (first axis) per chunk, zstd-compressed."""
    spec = array_spec(path, name)
    spec["metadata"] = {"shape": list(shape), "data_type": dtype,
                        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *shape[1:]]}},
                        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                   {"name": "zstd", "configuration": {"level": 3}}],
                        "fill_value": fill}
    return ts.open(spec, create=True, delete_existing=True).result()


def write_json(path: Path, obj) -> None:
    """Write JSON atomically (temporary file + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def mismatch(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ between two manifests (dotted paths)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += mismatch(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: store has {json.dumps(a)[:80]}, this run {json.dumps(b)[:80]}")
    return out


class Store:
    """An open results store (see module doc): ``arrays {name: TensorStore}``, ``manifest``."""

    def __init__(self, path, manifest: dict, arrays: dict):
        self.path, self.manifest, self.arrays = Path(path), manifest, arrays

    @classmethod
    def open_or_create(cls, path, manifest: dict, create: bool = True, wait_s: float = 600.0) -> "Store":
        """Open the store at ``path`` if it has a manifest (checked against ``manifest``), else
        create it (``create``, the writing process 0) or wait up to ``wait_s`` for another
        process to create it.

        ``manifest["arrays"]``: ``{name: {"shape", "dtype", "fill"}}``.
        """
        path = Path(path)
        man = path / MANIFEST
        if not man.is_file():
            if create:
                path.mkdir(parents=True, exist_ok=True)
                ours = {n.split("/")[0] for n in manifest["arrays"]} | {"zarr.json"}
                foreign = sorted(p.name for p in path.iterdir() if p.name not in ours)
                if foreign:  # (a creation killed before the manifest leaves only our own names)
                    raise StoreMismatch(f"{path} exists and is not an analysis store (no {MANIFEST}, has "
                                        f"{foreign[:3]}); give a new or empty directory")
                for name, a in manifest["arrays"].items():
                    create_array(path, name, a["shape"], a["dtype"], a["fill"])
                for group in {n.rsplit("/", 1)[0] for n in manifest["arrays"] if "/" in n}:
                    write_json(path / group / "zarr.json", {"zarr_format": 3, "node_type": "group"})
                write_json(path / "zarr.json", {"zarr_format": 3, "node_type": "group",
                                                "attributes": {"implicit_attn": manifest}})
                write_json(man, manifest)  # last: its presence means the arrays exist
            else:
                t0 = time.monotonic()
                while not man.is_file():
                    if time.monotonic() - t0 > wait_s:
                        raise TimeoutError(f"no {man} after {wait_s:.0f} s: process 0 did not create the store")
                    time.sleep(0.05)
        old = json.loads(man.read_text())
        diff = [d for k in CHECKED for d in mismatch({k: old.get(k)}, {k: manifest.get(k)})]
        if diff:
            raise StoreMismatch(f"{path} holds results of another run; rerun with the same settings to resume, "
                                f"or give a new --out. Differences: " + "; ".join(diff[:6]))
        arrays = {name: ts.open(array_spec(path, name)).result() for name in old["arrays"]}
        return cls(path, old, arrays)

    def done(self) -> np.ndarray:
        """``(N,)`` bool: rows whose results are complete."""
        return self.arrays["done"].read().result().astype(bool)

    def write_rows(self, rows, values: dict, mark_done: bool = True) -> None:
        """Write ``values {name: (len(rows), ...) array}`` for each row, wait until every chunk
        is written, then mark the rows done (unless not ``mark_done``)."""
        futures = []
        for k, r in enumerate(rows):
            for name, v in values.items():
                futures.append(self.arrays[name][int(r)].write(np.asarray(v[k])))
        for f in futures:
            f.result()
        if not mark_done:
            return
        for f in [self.arrays["done"][int(r)].write(np.uint8(1)) for r in rows]:
            f.result()


def read_array(path, name: str) -> np.ndarray:
    """One array of a store as numpy (e.g. ``read_array(out, "relevance")``)."""
    return ts.open(array_spec(Path(path), name)).result().read().result()


def read_manifest(path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


__all__ = ["Store", "StoreMismatch", "read_array", "read_manifest", "MANIFEST", "FORMAT"]
