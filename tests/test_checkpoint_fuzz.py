"""Fuzzing the checkpoint reader (issue 16): random mutations of a real saved checkpoint
(the safetensors header bytes and JSON, the file length, ``config.json`` values, the
shard index) must end in a model equal to the unmutated one or in a ``ValueError``
(``CheckpointError`` included) that says where the problem is; never another exception
type, and never a model with different weights.

The data section is the exception by design: safetensors has no checksum, so a changed
data byte loads; ``test_data_bytes_are_read_in_place`` checks that exactly that element
changes (no offset is shifted or aliased).

Deterministic (``derandomize``) with a small fixed budget so the file stays fast.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import implicit_attn as ia  # noqa: E402
from implicit_attn.families import mamba  # noqa: E402
from weights_convert import INDEX, SINGLE, read_safetensors  # noqa: E402

CFG = mamba.Config(vocab_size=24, hidden_size=8, state_size=4, num_hidden_layers=2, conv_kernel=3)
FUZZ = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
_COUNTER = itertools.count()


@pytest.fixture(scope="module")
def base():
    """A tiny saved model twice (single file and 3+ shards) and its reference parameters."""
    root = Path(tempfile.mkdtemp(prefix="ckpt-fuzz-"))
    model = mamba.LM(CFG, mamba.init_params(CFG, jax.random.PRNGKey(0)))
    ia.save(model, root / "single")
    ia.save(model, root / "sharded", max_shard_bytes=700)
    assert len(list((root / "sharded").glob("model-*.safetensors"))) >= 3
    yield _Base(root, ia.load(root / "single"))
    shutil.rmtree(root, ignore_errors=True)


class _Base(tuple):
    """``(root dir, reference model)`` with a short repr for hypothesis' reports."""

    def __new__(cls, root, ref):
        return super().__new__(cls, (root, ref))

    def __repr__(self):
        return f"base({self[0]})"


def _copy(root: Path, kind: str) -> Path:
    d = root / f"case{next(_COUNTER)}"
    shutil.copytree(root / kind, d)
    return d


def _same_model(a, b) -> bool:
    if a.config != b.config:
        return False
    pa, pb = a.params(), b.params()
    if jax.tree.structure(pa) != jax.tree.structure(pb):
        return False
    return all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))


def _outcome(path: Path, ref):
    """Load ``path``: "equal" (same config and weights), or the ``ValueError`` raised.
    Any other exception type, or a model that differs, fails the test."""
    try:
        model = ia.load(path)
    except ValueError as e:  # CheckpointError is a ValueError
        msg = str(e)
        assert msg and (str(path) in msg or any(w in msg for w in ("config", "checkpoint", "model_type"))), \
            f"error does not say where the problem is: {msg!r}"
        return e
    assert _same_model(model, ref), f"{path}: a mutated checkpoint loaded as a different model"
    return "equal"


def _split(f: Path):
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return data[:8 + n], data[8 + n:]


def _single(base):
    """A fresh copy of the single-file checkpoint: ``(dir, file, header bytes, data bytes)``."""
    d = _copy(base[0], "single")
    return (d, d / SINGLE, *_split(d / SINGLE))


# ----------------------------------------------------------------------------- strategies

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                         st.floats(allow_nan=False), st.text(max_size=6),
                         st.sampled_from([0, 1, -1, 2 ** 32, 2 ** 63, 2 ** 64, 8, 16, "F32", "I32", "BF16", "F16",
                                          "F64", "U8", "BOOL", "silu", "mamba", "rwkv"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda c: st.one_of(st.lists(c, max_size=3),
                                                             st.dictionaries(st.text(max_size=4), c, max_size=3)),
                           max_leaves=6)
INT_LISTS = st.lists(st.one_of(st.integers(-3, 2 ** 66), st.sampled_from([0, 1, 2, 4, 8, 16, 24, 2 ** 32])),
                     max_size=4)


# ----------------------------------------------------------------------------- header bytes

@FUZZ
@given(data=st.data())
def test_header_byte_mutations(base, data):
    ref = base[1]
    d, f, head, body = _single(base)
    how = data.draw(st.sampled_from(["flip", "length", "truncate", "append"]))
    if how == "flip":  # overwrite 1-4 bytes of the length field or the JSON
        i = data.draw(st.integers(0, len(head) - 1))
        new = data.draw(st.binary(min_size=1, max_size=4))
        head = head[:i] + new + head[i + len(new):]
        raw = head[:len(_split(f)[0])] + body  # same length: bytes replaced, not inserted
    elif how == "length":
        n = data.draw(st.one_of(st.integers(0, len(head) + 64), st.integers(0, 2 ** 64 - 1)))
        raw = n.to_bytes(8, "little") + head[8:] + body
    elif how == "truncate":
        raw = (head + body)[:data.draw(st.integers(0, len(head) + len(body) - 1))]
    else:
        raw = head + body + data.draw(st.binary(min_size=1, max_size=16))
    f.write_bytes(raw)
    out = _outcome(d, ref)
    if how in ("truncate", "append"):
        assert out != "equal"


# ----------------------------------------------------------------------------- header JSON

@FUZZ
@given(data=st.data())
def test_header_json_mutations(base, data):
    ref = base[1]
    d, f, head, body = _single(base)
    header = json.loads(head[8:])
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names))
    how = data.draw(st.sampled_from(["dtype", "shape", "offsets", "drop_field", "entry", "rename", "metadata",
                                     "extra_field", "delete", "alias", "wrap"]))
    entry = header[name]
    if how == "alias":  # read the bytes of another tensor of the same byte size
        size = lambda n: header[n]["data_offsets"][1] - header[n]["data_offsets"][0]
        entry["data_offsets"] = header[data.draw(st.sampled_from([n for n in names if size(n) == size(name)]))][
            "data_offsets"]
    elif how == "wrap":  # element counts whose int64 product wraps to 0
        entry["shape"] = data.draw(st.sampled_from([[2 ** 32, 2 ** 32], [2 ** 62, 4], [2 ** 63, 2], [2 ** 64]]))
        entry["data_offsets"] = data.draw(st.sampled_from([[0, 0], entry["data_offsets"]]))
    elif how == "dtype":
        entry["dtype"] = data.draw(JSON_SCALARS)
    elif how == "shape":
        entry["shape"] = data.draw(st.one_of(INT_LISTS, JSON_VALUES))
    elif how == "offsets":
        entry["data_offsets"] = data.draw(st.one_of(INT_LISTS, JSON_VALUES, st.sampled_from(
            [header[n]["data_offsets"] for n in names])))
    elif how == "drop_field":
        del entry[data.draw(st.sampled_from(sorted(entry)))]
    elif how == "entry":
        header[name] = data.draw(JSON_VALUES)
    elif how == "rename":
        header[data.draw(st.text(min_size=1, max_size=30))] = header.pop(name)
    elif how == "metadata":
        header["__metadata__"] = data.draw(JSON_VALUES)
    elif how == "extra_field":
        entry[data.draw(st.text(max_size=8))] = data.draw(JSON_VALUES)
    else:
        del header[name]
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + body)
    _outcome(d, ref)


@FUZZ
@given(i=st.integers(0, 10 ** 6), value=st.integers(0, 255))
def test_data_bytes_are_read_in_place(base, i, value):
    """No checksum in the format: a changed data byte loads, and changes exactly the one
    element that holds it."""
    root, ref = base
    d, f, head, body = _single(base)
    i %= len(body)
    body = body[:i] + bytes([value]) + body[i + 1:]
    f.write_bytes(head + body)
    before = {k: np.array(v) for k, v in read_safetensors(root / "single" / SINGLE).items()}
    after = read_safetensors(f)
    changed = [k for k in before if before[k].tobytes() != np.asarray(after[k]).tobytes()]
    header = json.loads(head[8:])
    owner = next(k for k in before if header[k]["data_offsets"][0] <= i < header[k]["data_offsets"][1])
    assert changed in ([], [owner])
    model = ia.load(d)  # loads (floating data is never validated); same everywhere else
    assert model.config == ref.config


# ----------------------------------------------------------------------------- config.json

@FUZZ
@given(data=st.data())
def test_config_mutations(base, data):
    root, ref = base
    d = _copy(root, "single")
    config = json.loads((d / "config.json").read_text())
    how = data.draw(st.sampled_from(["set", "set", "delete", "add"]))
    key = data.draw(st.sampled_from(sorted(config)))
    if how == "set":
        config[key] = data.draw(JSON_VALUES)
    elif how == "delete":
        del config[key]
    else:
        key = data.draw(st.text(min_size=1, max_size=10))
        config[key] = data.draw(JSON_VALUES)
    (d / "config.json").write_text(json.dumps(config))
    try:
        model = ia.load(d)
    except ValueError as e:
        assert str(e)
        return
    # a config that loads must have been read as written: the weights are the file's,
    # and a changed known field is not silently replaced by another value
    pa, pb = model.params(), ref.params()
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
    if how == "set" and key in {f.name for f in dataclasses.fields(ref.config)}:
        assert model.config.to_hf()[key] == config[key], (key, config[key], model.config.to_hf()[key])


# ----------------------------------------------------------------------------- index

@FUZZ
@given(data=st.data())
def test_index_mutations(base, data):
    root, ref = base
    d = _copy(root, "sharded")
    index = json.loads((d / INDEX).read_text())
    wmap = index["weight_map"]
    shards = sorted(set(wmap.values()))
    name = data.draw(st.sampled_from(sorted(wmap)))
    how = data.draw(st.sampled_from(["move", "path", "value", "delete", "add", "weight_map", "metadata", "whole"]))
    if how == "move":
        wmap[name] = data.draw(st.sampled_from(shards))
    elif how == "path":
        wmap[name] = data.draw(st.sampled_from(["../sharded/", "/", "./", "sub/../", "..\\", "", "x/"])) + wmap[name]
    elif how == "value":
        wmap[name] = data.draw(JSON_VALUES)
    elif how == "delete":
        del wmap[name]
    elif how == "add":
        wmap[data.draw(st.text(min_size=1, max_size=20))] = data.draw(st.sampled_from(shards))
    elif how == "weight_map":
        index["weight_map"] = data.draw(JSON_VALUES)
    elif how == "metadata":
        index["metadata"] = data.draw(JSON_VALUES)
    else:
        index = data.draw(JSON_VALUES)
    (d / INDEX).write_text(json.dumps(index))
    out = _outcome(d, ref)
    if how == "metadata":
        assert out == "equal"
