"""Checkpoint reading/writing and every bad-input error."""
import json
import shutil

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.models import mamba
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
    with pytest.raises(CheckpointError, match="not a directory"):
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
