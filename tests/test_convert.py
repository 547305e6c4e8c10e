"""Checkpoint reading/writing and every bad-input error."""
import json
import shutil

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import mamba
from weights_convert import (CheckpointError, read_hf_dir, read_safetensors, write_hf_dir,
                             write_safetensors)

CFG = mamba.Config(vocab_size=40, hidden_size=8, state_size=4, num_hidden_layers=2, conv_kernel=3)


@pytest.fixture(scope="module")
def model():
    return mamba.LM(CFG, mamba.init_params(CFG, jax.random.PRNGKey(0)))


@pytest.fixture
def ckpt(model, tmp_path):
    ia.save(model, tmp_path / "m")
    return tmp_path / "m"


def test_round_trip_single_and_sharded(model, tmp_path):
    ids = np.arange(12)[None] % 40
    ia.save(model, tmp_path / "a")
    ia.save(model, tmp_path / "b", max_shard_bytes=1500)
    assert (tmp_path / "b" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "b").glob("model-*.safetensors"))) > 1
    for d in ("a", "b"):
        np.testing.assert_array_equal(np.asarray(ia.load(tmp_path / d)(ids)), np.asarray(model(ids)))


def test_dtype_option_and_bf16_storage(model, tmp_path):
    ia.save(model, tmp_path / "a")
    m16 = ia.load(tmp_path / "a", dtype="bfloat16")
    assert m16.info()["dtype"] == "bfloat16"
    ia.save(m16, tmp_path / "b")  # bf16 tensors written and read back by our own format code
    back = read_safetensors(tmp_path / "b" / "model.safetensors")
    assert str(back["backbone.norm_f.weight"].dtype) == "bfloat16"
    ids = np.arange(9)[None]
    ref = np.asarray(model(ids))
    got = np.asarray(ia.load(tmp_path / "b")(ids))
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_safetensors_matches_reference_library(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy")
    t = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}
    write_safetensors(tmp_path / "x.safetensors", t)
    other = st.load_file(str(tmp_path / "x.safetensors"))
    for k in t:
        np.testing.assert_array_equal(other[k], t[k])
    st.save_file(t, str(tmp_path / "y.safetensors"))
    mine = read_safetensors(tmp_path / "y.safetensors")
    for k in t:
        np.testing.assert_array_equal(mine[k], t[k])


def _rewrite(ckpt, fn):
    config, tensors = read_hf_dir(ckpt)
    config, tensors = fn(config, dict(tensors))
    shutil.rmtree(ckpt)
    write_hf_dir(ckpt, config, tensors)


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda c, t: (c, {k: v for k, v in t.items() if "layers.1.mixer.D" not in k}))
    with pytest.raises(CheckpointError, match=r"missing tensors: backbone\.layers\.1\.mixer\.D"):
        ia.load(ckpt)


def test_unexpected_tensor(ckpt):
    _rewrite(ckpt, lambda c, t: (c, {**t, "backbone.layers.0.mixer.extra": np.zeros(2, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: backbone\.layers\.0\.mixer\.extra"):
        ia.load(ckpt)


def test_misshaped_tensor(ckpt):
    def f(c, t):
        t["backbone.layers.0.mixer.A_log"] = np.zeros((16, 5), np.float32)
        return c, t
    _rewrite(ckpt, f)
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.0\.mixer\.A_log has shape \(16, 5\), expected \(16, 4\)"):
        ia.load(ckpt)


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        ia.load(ckpt)
    f.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="truncated"):
        ia.load(ckpt)


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown model_type 'llama'; supported: \[.*'mamba'"):
        ia.load(ckpt)


def test_missing_files(tmp_path, ckpt):
    with pytest.raises(CheckpointError, match="no such directory"):
        ia.load(tmp_path / "nope")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        ia.load(ckpt)


def test_bad_token_ids(model):
    with pytest.raises(ValueError, match="token id 40 is outside the vocabulary"):
        model(np.array([[1, 40]]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        model(np.array([[-1, 2]]))
    with pytest.raises(ValueError, match=r"shape \(batch, length\).*ids\[None\]"):
        model(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"shape \(batch, length\)"):
        model(np.zeros((1, 2, 3), np.int32))
    with pytest.raises(TypeError, match="must be integers"):
        model(np.array([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="non-empty"):
        model(np.zeros((1, 0), np.int32))


def test_bad_operator_arguments(model):
    ids = np.arange(6)[None]
    op = model.operators(ids, layers=[0])[0]
    with pytest.raises(ValueError, match="variant must be one of"):
        model.operators(ids, variant="nope")
    with pytest.raises(ValueError, match="layer 5 out of range"):
        model.operators(ids, layers=[5])
    with pytest.raises(ValueError, match="channels out of range"):
        op.materialize(channels=[16])
    with pytest.raises(ValueError, match="how must be one of"):
        op.reduce("max")
    with pytest.raises(ValueError, match="needs weights"):
        op.reduce("weighted")
    with pytest.raises(ValueError, match="weights must have shape"):
        op.reduce("weighted", weights=np.ones(3))
    with pytest.raises(ValueError, match="impl must be one of"):
        op.materialize(impl="cuda")
    with pytest.raises(ValueError, match="mixer input must have shape"):
        model.layers[0].mixer.as_operator(np.zeros((1, 4, 3), np.float32))


# ----------------------------------------------------------------------------- damaged checkpoints

INDEX = "model.safetensors.index.json"


@pytest.fixture
def sharded(model, tmp_path):
    ia.save(model, tmp_path / "s", max_shard_bytes=1500)
    shards = sorted(p.name for p in (tmp_path / "s").glob("model-*.safetensors"))
    assert len(shards) > 2
    return tmp_path / "s", shards


def _index(path):
    return json.loads((path / INDEX).read_text())


def _write_index(path, index):
    (path / INDEX).write_text(json.dumps(index))


def _raw_safetensors(path, header: bytes, body: bytes = b""):
    """A safetensors file with the given header bytes (no checks: to build damaged files)."""
    path.write_bytes(len(header).to_bytes(8, "little") + header + body)


def test_sharded_missing_shard(sharded):
    path, shards = sharded
    (path / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"shard {shards[1]} listed in {INDEX} is missing"):
        ia.load(path)


def test_index_lists_a_tensor_its_shard_does_not_hold(sharded):
    path, shards = sharded
    index = _index(path)
    index["weight_map"]["backbone.layers.0.mixer.ghost"] = shards[0]
    _write_index(path, index)
    with pytest.raises(CheckpointError, match=rf"not found in their shard files: "
                                              rf"'backbone\.layers\.0\.mixer\.ghost' \(in {shards[0]}\)"):
        ia.load(path)


def test_shard_holds_a_tensor_the_index_does_not_list(sharded):
    path, shards = sharded
    index = _index(path)
    name = sorted(read_safetensors(path / shards[-1]))[0]
    del index["weight_map"][name]
    _write_index(path, index)
    with pytest.raises(CheckpointError, match=rf"{shards[-1]}: tensor '{name}' is not mapped to this shard"):
        ia.load(path)
    # listed, but under another shard than the file holding it
    index["weight_map"][name] = shards[0]
    _write_index(path, index)
    with pytest.raises(CheckpointError, match=rf"{shards[-1]}: tensor '{name}' is not mapped to this shard"):
        ia.load(path)


def test_corrupt_index_json(sharded):
    path, _ = sharded
    (path / INDEX).write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match=rf"{INDEX}: not valid JSON"):
        ia.load(path)
    _write_index(path, {"weight_map": {"backbone.norm_f.weight": ["x"]}})
    with pytest.raises(CheckpointError, match=r"'backbone\.norm_f\.weight' maps to \['x'\]"):
        ia.load(path)
    _write_index(path, ["not", "an", "index"])
    with pytest.raises(CheckpointError, match=rf"{INDEX}: no weight_map"):
        ia.load(path)


def test_corrupt_safetensors_header(ckpt):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8:8 + n] = b"{" + b"#" * (n - 1)  # same length, not JSON
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        ia.load(ckpt)
    _raw_safetensors(f, b'["a", "b"]')
    with pytest.raises(CheckpointError, match="corrupt safetensors header .a JSON object is expected, got list"):
        ia.load(ckpt)
    _raw_safetensors(f, json.dumps({"w": {"dtype": "F32", "shape": [2]}}).encode(), bytes(8))
    with pytest.raises(CheckpointError, match=r"tensor 'w' needs dtype, shape and data_offsets"):
        read_safetensors(f)
    _raw_safetensors(f, json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}).encode(),
                     bytes(8))
    with pytest.raises(CheckpointError, match=r"tensor 'w' has shape \[2\] and data_offsets \[8, 0\]"):
        read_safetensors(f)
    _raw_safetensors(f, json.dumps({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}).encode(),
                     bytes(8))
    with pytest.raises(CheckpointError, match=r"tensor 'w' has shape \['2'\]"):
        read_safetensors(f)


def test_config_without_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["model_type"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json has no model_type; supported: \[.*'mamba'"):
        ia.load(ckpt)
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config\.json: a JSON object is expected, got list"):
        ia.load(ckpt)
    (ckpt / "config.json").write_text("{model_type: mamba")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        ia.load(ckpt)


def test_unsupported_dtype(ckpt):
    f = ckpt / "model.safetensors"
    header = json.dumps({"backbone.norm_f.weight": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}})
    _raw_safetensors(f, header.encode(), bytes(8))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'backbone\.norm_f\.weight' has "
                                              r"unsupported dtype 'F8_E4M3' \(supported: F64, F32"):
        ia.load(ckpt)
    with pytest.raises(CheckpointError, match="tensor 'c': dtype complex64 cannot be stored in safetensors"):
        write_safetensors(ckpt / "x.safetensors", {"c": np.zeros(2, np.complex64)})


def test_unsupported_load_dtype(ckpt):
    with pytest.raises(ValueError, match="dtype must be a floating type, got 'int8'"):
        ia.load(ckpt, dtype="int8")
    with pytest.raises(ValueError, match="dtype 'float33' is not a dtype"):
        ia.load(ckpt, dtype="float33")
