"""Checkpoint reading/writing and every bad-input error."""
import json
import shutil

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import mamba
from weights_convert import (CheckpointError, convert, read_hf_dir, read_safetensors, release, write_hf_dir,
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
    C = op.shape[1]
    with pytest.raises(TypeError, match=r"weights must be real floating or boolean, got dtype int64 \(cast"):
        op.reduce("weighted", weights=np.ones(C, np.int64))
    with pytest.raises(TypeError, match="key_weights must be real floating or boolean, got dtype complex64"):
        op.reduce("weighted", weights=np.ones(C), key_weights=np.ones(C, np.complex64))
    mask = np.arange(C) % 2 == 0  # a boolean channel mask is exact in float32
    np.testing.assert_array_equal(op.reduce("weighted", weights=mask, impl="xla"),
                                  op.reduce("weighted", weights=mask.astype(np.float32), impl="xla"))
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
    header = json.dumps({"backbone.norm_f.weight": {"dtype": "F8_E8M0", "shape": [8], "data_offsets": [0, 8]}})
    _raw_safetensors(f, header.encode(), bytes(8))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'backbone\.norm_f\.weight' has "
                                              r"unsupported dtype 'F8_E8M0' \(supported: F64, F32"):
        ia.load(ckpt)
    with pytest.raises(CheckpointError, match="tensor 'c': dtype complex64 cannot be stored in safetensors"):
        write_safetensors(ckpt / "x.safetensors", {"c": np.zeros(2, np.complex64)})


def test_unsupported_load_dtype(ckpt):
    with pytest.raises(ValueError, match="dtype must be a floating type, got 'int8'"):
        ia.load(ckpt, dtype="int8")
    with pytest.raises(ValueError, match="dtype 'float33' is not a dtype"):
        ia.load(ckpt, dtype="float33")


# ----------------------------------------------------------------------------- issue 16: saving

def _other_model():
    return mamba.LM(CFG, mamba.init_params(CFG, jax.random.PRNGKey(1)))


def _same_logits(a, b):
    ids = np.arange(10)[None] % 40
    np.testing.assert_array_equal(np.asarray(a(ids)), np.asarray(b(ids)))


def test_save_replaces_a_previous_save_in_every_layout(model, tmp_path):
    d, other = tmp_path / "m", _other_model()
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")  # not a weight file: kept
    ia.save(model, d, max_shard_bytes=1500)
    ia.save(other, d)  # the stale index used to win here and load the first model
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    _same_logits(ia.load(d), other)
    ia.save(model, d, max_shard_bytes=1500)
    assert not (d / "model.safetensors").exists()
    _same_logits(ia.load(d), model)
    n = len(list(d.glob("model-*.safetensors")))
    ia.save(other, d, max_shard_bytes=4000)  # fewer shards: the old ones go
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) < n and sorted(set(_index(d)["weight_map"].values())) == shards
    _same_logits(ia.load(d), other)
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_failed_save_leaves_the_previous_checkpoint(model, tmp_path):
    d = tmp_path / "m"
    ia.save(model, d, max_shard_bytes=1500)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    ia.save(_other_model(), tmp_path / "o")
    config, tensors = read_hf_dir(tmp_path / "o")
    tensors = {**tensors, "zzz.bad": np.zeros(2, np.complex64)}  # other weights; fails on the last file
    with pytest.raises(CheckpointError, match="dtype complex64 cannot be stored"):
        write_hf_dir(d, config, tensors)
    with pytest.raises(CheckpointError, match="dtype complex64 cannot be stored"):
        write_hf_dir(d, config, tensors, max_shard_bytes=1500)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    _same_logits(ia.load(d), model)


def test_single_file_wins_over_an_index_like_transformers(model, tmp_path):
    d, other = tmp_path / "m", _other_model()
    ia.save(model, d, max_shard_bytes=1500)
    ia.save(other, tmp_path / "o")
    shutil.copy(tmp_path / "o" / "model.safetensors", d / "model.safetensors")  # a stray index stays
    _same_logits(ia.load(d), other)


# ----------------------------------------------------------------------------- issue 16: strict headers

def _header(f):
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _rewrite_header(f, edit):
    header, body = _header(f)
    edit(header)
    _raw_safetensors(f, json.dumps(header).encode(), body)


def test_overlapping_offsets_are_rejected(ckpt):
    f = ckpt / "model.safetensors"

    def alias(h):  # D of layer 1 reads the bytes of D of layer 0; the freed bytes stay
        h["backbone.layers.1.mixer.D"]["data_offsets"] = h["backbone.layers.0.mixer.D"]["data_offsets"]
    _rewrite_header(f, alias)
    with pytest.raises(CheckpointError, match=r"tensor 'backbone\.layers\.(0|1)\.mixer\.D' .*overlaps tensor"):
        ia.load(ckpt)
    st = pytest.importorskip("safetensors.numpy")
    with pytest.raises(Exception):  # the reference reader rejects it too
        st.load_file(str(f))


def test_sizes_are_computed_without_overflow(ckpt):
    f = ckpt / "model.safetensors"
    _raw_safetensors(f, json.dumps({"backbone.norm_f.weight": {"dtype": "F32", "shape": [2 ** 32, 2 ** 32],
                                                               "data_offsets": [0, 0]}}).encode())
    with pytest.raises(CheckpointError, match=r"tensor 'backbone\.norm_f\.weight' has 0 bytes .* which needs "
                                              r"73786976294838206464"):
        ia.load(ckpt)


def test_offsets_must_tile_the_data_section(ckpt):
    f = ckpt / "model.safetensors"
    header, body = _header(f)
    _raw_safetensors(f, json.dumps(header).encode(), body + bytes(8))
    with pytest.raises(CheckpointError, match=r"the data section has \d+ bytes but the tensors cover \d+ \(trailing bytes belong to no tensor\)"):
        ia.load(ckpt)
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    del header[first]
    _raw_safetensors(f, json.dumps(header).encode(), body)
    with pytest.raises(CheckpointError, match=r"unused bytes before tensor"):
        ia.load(ckpt)


def test_duplicate_names_and_bad_metadata(ckpt):
    f = ckpt / "model.safetensors"
    header, body = _header(f)
    text = json.dumps(header)
    name = "backbone.norm_f.weight"
    dup = text[:-1] + f', "{name}": ' + json.dumps(header[name]) + "}"
    _raw_safetensors(f, dup.encode(), body)
    with pytest.raises(CheckpointError, match=rf"corrupt safetensors header \(key '{name}' appears twice\)"):
        ia.load(ckpt)
    header["__metadata__"] = {"format": 1}
    _raw_safetensors(f, json.dumps(header).encode(), body)
    with pytest.raises(CheckpointError, match="__metadata__ must map strings to strings"):
        ia.load(ckpt)


@pytest.mark.parametrize("where", ["../outside/{}", "/abs/{}", "sub/../../outside/{}", ""])
def test_shard_names_stay_inside_the_directory(sharded, tmp_path, where):
    path, shards = sharded
    (tmp_path / "outside").mkdir(exist_ok=True)
    shutil.copy(path / shards[0], tmp_path / "outside" / shards[0])  # a loadable file out there
    name = where.format(shards[0]).replace("/abs", str(tmp_path / "outside").replace("\\", "/"))
    index = _index(path)
    index["weight_map"] = {k: (name if v == shards[0] else v) for k, v in index["weight_map"].items()}
    _write_index(path, index)
    with pytest.raises(CheckpointError, match="must be a file name inside the checkpoint directory"):
        ia.load(path)


def test_tensors_are_lazy_read_only_views(ckpt):
    t = read_safetensors(ckpt / "model.safetensors")
    a = t["backbone.embeddings.weight"]
    assert isinstance(a, np.ndarray) and not a.flags.writeable and not a.flags.owndata
    release(a)  # pages dropped: reading again reads the file
    np.testing.assert_array_equal(a, read_safetensors(ckpt / "model.safetensors")["backbone.embeddings.weight"])


# ----------------------------------------------------------------------------- issue 16: dtypes

@pytest.mark.parametrize("code,dtype", [("I32", np.int32), ("I64", np.int64), ("U8", np.uint8), ("BOOL", np.bool_)])
def test_non_floating_weights_are_rejected(ckpt, code, dtype):
    def f(c, t):  # a tied Mamba: integer embeddings used to give integer-truncated logits
        t["backbone.embeddings.weight"] = (np.asarray(t["backbone.embeddings.weight"]) * 10).astype(dtype)
        return c, t
    _rewrite(ckpt, f)
    msg = rf"parameters must be floating point .*non-floating tensors: backbone\.embeddings\.weight \({code}\)"
    with pytest.raises(CheckpointError, match=msg):
        ia.load(ckpt)
    with pytest.raises(CheckpointError, match=msg):
        convert(ckpt)


# ----------------------------------------------------------------------------- issue 16: tied heads vs HF

@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "recurrent_gemma", "rwkv", "lfm2"])
def test_tied_config_with_a_head_in_the_file_follows_transformers(model_type, tmp_path):
    """transformers 5.23 (every family): when a tied config's file also holds an output head
    that differs from the embeddings, the head is NOT tied and the file's head is used; an
    equal head changes nothing (LFM2, whose ``embedding_norm`` is a second "embed" tensor,
    was untied with a warning before 2026-12-02)."""
    from hf_build import build_hf
    from implicit_attn.testing import random_ids, reference_class, torch_forward

    pytest.importorskip("torch")
    spec = ia.registry.family(model_type)
    d = tmp_path / "hf"
    build_hf(model_type, d, tie_word_embeddings=True)
    f = d / "model.safetensors"
    tensors = {k: np.array(v) for k, v in read_safetensors(f).items()}
    cfg = spec.config.from_hf(read_hf_dir(d)[0])
    head = sorted(set(spec.expected_shapes(spec.config.from_hf({**cfg.to_hf(), "tie_word_embeddings": False}))[0])
                  - set(spec.expected_shapes(cfg)[0]))
    assert len(head) == 1 and head[0] not in tensors
    emb = next(k for k in tensors if "embed" in k)
    ids = random_ids(cfg.vocab_size, 1, 7)

    write_safetensors(f, {**tensors, head[0]: tensors[emb]}, {"format": "pt"})  # equal head: still tied
    mine = ia.load(d)
    assert mine.config.tie_word_embeddings
    ref = reference_class(spec.hf_class).from_pretrained(d).eval()
    np.testing.assert_allclose(np.asarray(mine(ids)), torch_forward(ref, ids)[0], atol=1e-4, rtol=1e-4)

    other = np.random.default_rng(1).standard_normal(tensors[emb].shape).astype(tensors[emb].dtype)
    write_safetensors(f, {**tensors, head[0]: other}, {"format": "pt"})
    with pytest.warns(UserWarning, match=rf"ties the output head .* holds a different {head[0]}; like "
                                         r"transformers, the file's head is used"):
        mine = ia.load(d)
    assert not mine.config.tie_word_embeddings
    ref = reference_class(spec.hf_class).from_pretrained(d).eval()
    got, want = np.asarray(mine(ids)), torch_forward(ref, ids)[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    ia.save(mine, tmp_path / "back")  # round trip keeps the file's head
    np.testing.assert_array_equal(np.asarray(ia.load(tmp_path / "back")(ids)), got)
