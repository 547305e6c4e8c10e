"""Loading by Hugging Face repository id from the local cache (no network), tokenizers read
from the checkpoint, and ``--text`` on the command line with a repository id.

The cache is built in a temporary directory in ``huggingface_hub``'s own layout
(``models--ORG--NAME/blobs/<hash>``, ``snapshots/<commit>/<file>`` as relative symlinks to
the blobs, ``refs/<branch or tag>`` holding the commit hash without a newline), and checked
with ``huggingface_hub.scan_cache_dir``; it is found through ``HF_HUB_CACHE`` set after
``huggingface_hub`` was imported.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.cli import main
from implicit_attn.families import mamba

WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "dog", "ran"]
REPO = "tiny-org/mamba-tiny"
COMMIT_A = "a" * 40  # refs/main: single-file weights and a tokenizer
COMMIT_B = "b" * 40  # refs/v2 (a tag, stored under the name it was downloaded by): other weights, sharded
IDS = np.array([[1, 2, 3, 4, 5, 1, 2]])


def put_in_cache(cache: Path, repo_id: str, src: Path, commit: str, ref: str | None = "main") -> Path:
    """Copy the files of ``src`` into ``cache`` as ``huggingface_hub`` stores a download:
    content-addressed blobs, a snapshot folder of relative symlinks, and ``refs/<ref>``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


def tiny(seed: int):
    cfg = mamba.Config(vocab_size=len(WORDS) + 4, hidden_size=8, state_size=4, num_hidden_layers=2)
    return mamba.LM(cfg, mamba.init_params(cfg, jax.random.PRNGKey(seed)))


def save_tokenizer(path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Local checkpoint directories and a cache holding them as repositories."""
    root = tmp_path_factory.mktemp("load_by_name")
    model_a, model_b = tiny(0), tiny(1)
    ia.save(model_a, root / "a")
    save_tokenizer(root / "a")
    ia.save(model_b, root / "b", max_shard_bytes=400)
    assert (root / "b" / "model.safetensors.index.json").exists()
    ia.save(model_a, root / "no_tok")
    (root / "bin_only").mkdir()
    (root / "bin_only" / "config.json").write_text((root / "a" / "config.json").read_text())
    (root / "bin_only" / "pytorch_model.bin").write_bytes(b"not read")
    cache = root / "hub"
    put_in_cache(cache, REPO, root / "a", COMMIT_A)
    put_in_cache(cache, REPO, root / "b", COMMIT_B, ref="v2")
    put_in_cache(cache, "tiny-org/no-tok", root / "no_tok", "c" * 40)
    put_in_cache(cache, "tiny-org/bin-only", root / "bin_only", "d" * 40)
    return root, cache, model_a, model_b


@pytest.fixture(autouse=True)
def offline_cache(world, monkeypatch):
    """The cache through ``HF_HUB_CACHE`` (read at call time), offline mode on, and any socket
    connection an error; every ``snapshot_download`` call recorded."""
    import huggingface_hub
    from huggingface_hub import constants

    _, cache, _, _ = world
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def no_network(*a, **k):
        raise AssertionError(f"network access attempted: {a}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    calls = []
    real = huggingface_hub.snapshot_download

    def spy(*a, **k):
        calls.append((k, str(ia.hub_cache_dir())))
        return real(*a, **k)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    yield calls
    # never a download, and always the cache named by the environment at call time
    assert all(k.get("local_files_only") is True and k.get("cache_dir") == env_cache for k, env_cache in calls), calls


def test_the_fake_cache_has_the_huggingface_hub_layout(world):
    from huggingface_hub import scan_cache_dir

    _, cache, _, _ = world
    info = scan_cache_dir(cache)
    assert info.warnings == []
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {REPO, "tiny-org/no-tok", "tiny-org/bin-only"}
    revs = {r.commit_hash: r.refs for r in repos[REPO].revisions}
    assert revs == {COMMIT_A: frozenset({"main"}), COMMIT_B: frozenset({"v2"})}


def test_repo_id_gives_the_same_model_as_the_directory(world, offline_cache):
    root, cache, model_a, _ = world
    by_dir, by_id = ia.load(root / "a"), ia.load(REPO)
    assert by_id.source == str(cache / f"models--tiny-org--mamba-tiny/snapshots/{COMMIT_A}")
    np.testing.assert_array_equal(np.asarray(by_id(IDS)), np.asarray(by_dir(IDS)))
    np.testing.assert_array_equal(np.asarray(by_id(IDS)), np.asarray(model_a(IDS)))
    assert ia.family_of(REPO) == "mamba"
    assert ia.resolve(REPO) == cache / f"models--tiny-org--mamba-tiny/snapshots/{COMMIT_A}"
    leaves = jax.tree_util.tree_leaves(ia.load(REPO, dtype="bfloat16").params())
    assert leaves and all(x.dtype == jax.numpy.bfloat16 for x in leaves if jax.numpy.issubdtype(x.dtype, jax.numpy.floating))
    assert offline_cache, "repository ids go through huggingface_hub.snapshot_download"


def test_a_local_directory_never_touches_huggingface_hub(world, offline_cache):
    root, _, _, _ = world
    ia.load(root / "a")
    ia.load(str(root / "a"))
    assert ia.load_tokenizer(root / "a") is not None
    assert offline_cache == []


def test_revisions_by_tag_commit_and_default(world):
    root, cache, model_a, model_b = world
    for rev, ref in [("v2", model_b), (COMMIT_B, model_b), (COMMIT_A, model_a),
                     ("main", model_a), (None, model_a)]:
        got = ia.load(REPO, revision=rev)
        np.testing.assert_array_equal(np.asarray(got(IDS)), np.asarray(ref(IDS)), err_msg=str(rev))
    # the sharded revision has no tokenizer; the default one has
    assert ia.load_tokenizer(REPO, revision="v2") is None
    assert ia.load_tokenizer(REPO) is not None
    with pytest.raises(ia.CheckpointError, match="revision 'nope' of tiny-org/mamba-tiny is not in the local") as e:
        ia.load(REPO, revision="nope")
    msg = str(e.value)
    assert "refs [main, v2]" in msg and COMMIT_B in msg  # what the cache does have
    assert "hf download tiny-org/mamba-tiny --revision nope" in msg
    with pytest.raises(ia.CheckpointError, match="applies to Hugging Face repository ids"):
        ia.load(root / "a", revision="main")


def test_uncached_repo_says_where_it_looked_and_how_to_get_it(world, monkeypatch):
    from huggingface_hub import constants

    _, cache, _, _ = world
    # offline mode off: local_files_only alone keeps it off the network (sockets fail here)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ia.CheckpointError) as e:
        ia.load("state-spaces/mamba-130m-hf")
    msg = str(e.value)
    assert "state-spaces/mamba-130m-hf is not in the local Hugging Face cache" in msg
    assert str(cache / "models--state-spaces--mamba-130m-hf") in msg
    assert "hf download state-spaces/mamba-130m-hf" in msg and "huggingface-cli download" in msg
    assert "local checkpoint directory" in msg and "nothing is downloaded" in msg


def test_the_cache_follows_hf_home_and_hf_hub_cache_at_call_time(world, tmp_path, monkeypatch):
    _, cache, _, _ = world
    assert ia.hub_cache_dir() == cache
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert ia.hub_cache_dir() == tmp_path / "home" / "hub"
    with pytest.raises(ia.CheckpointError, match=str(tmp_path / "home" / "hub")):
        ia.load(REPO)
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ia.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"


def test_a_cached_repo_without_safetensors_says_so(world):
    with pytest.raises(ia.CheckpointError, match=r"tiny-org/bin-only .*it has pytorch_model\.bin but no "
                                                 r"model\.safetensors.*only safetensors"):
        ia.load("tiny-org/bin-only")


@pytest.mark.parametrize("bad, why", [
    ("no/such/dir", "no such directory, and not a Hugging Face repository id of the form 'ORG/NAME'"),
    ("nosuchdir", "no such directory, and not a Hugging Face repository id"),
    ("org/bad--name", "not a valid Hugging Face repository id"),
    (Path("tiny-org/mamba-tiny"), "no such directory"),  # a Path is a path, never a repository id
    (3, "a directory or a Hugging Face repository id 'ORG/NAME', got int"),
])
def test_strings_that_are_neither_a_directory_nor_a_repo_id(world, bad, why, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ia.CheckpointError, match=why.replace("(", r"\(").replace(")", r"\)")):
        ia.load(bad)


def test_an_existing_directory_wins_over_a_repo_id_of_the_same_name(world, tmp_path, monkeypatch):
    root, _, _, model_b = world
    (tmp_path / "tiny-org").mkdir()
    (tmp_path / "tiny-org" / "mamba-tiny").symlink_to(root / "b")
    monkeypatch.chdir(tmp_path)
    np.testing.assert_array_equal(np.asarray(ia.load(REPO)(IDS)), np.asarray(model_b(IDS)))


def test_tokenizer_from_the_cached_repo(world):
    ids, tokens = ia.tokenize(REPO, "the cat sat on the mat")
    assert tokens == "the cat sat on the mat".split()
    assert ids.shape == (1, 6) and ids.dtype == np.int64
    assert ids[0].tolist() == [WORDS.index(w) for w in tokens]
    assert ia.load_tokenizer("tiny-org/no-tok") is None
    with pytest.raises(ia.CheckpointError, match="no tokenizer.json in .*snapshots"):
        ia.tokenize("tiny-org/no-tok", "the cat")
    with pytest.raises(ValueError, match="tokenizes to nothing"):
        ia.tokenize(REPO, "   ")


def test_cli_text_with_a_repo_id(world, tmp_path, capsys):
    _, _, model_a, _ = world
    text = "the cat sat on the mat"
    ids = np.array([[WORDS.index(w) for w in text.split()]])
    assert main(["info", REPO]) == 0
    assert '"family": "mamba"' in capsys.readouterr().out
    assert main(["operator", REPO, "--text", text, "--layer", "1", "--out", str(tmp_path / "op")]) == 0
    arr = np.load(tmp_path / "op" / "layer1_full_abs_mean.npy")
    ref = np.asarray(model_a.operators(ids, layers=[1])[0].reduce("abs_mean"))[0]
    np.testing.assert_allclose(arr, ref, rtol=1e-6)
    assert main(["operator", REPO, "--ids", ",".join(map(str, ids[0])), "--layer", "1",
                 "--out", str(tmp_path / "op_ids")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "op_ids" / "layer1_full_abs_mean.npy"), arr)
    assert main(["explain", REPO, "--text", text, "--method", "raw", "--out", str(tmp_path / "ex")]) == 0
    res = json.loads((tmp_path / "ex" / "relevance.json").read_text())
    assert res["tokens"] == text.split() and res["ids"] == ids[0].tolist()
    capsys.readouterr()


def test_cli_errors_for_a_repo_without_tokenizer_or_not_cached(world, tmp_path, capsys):
    for cmd in ("operator", "explain"):
        assert main([cmd, "tiny-org/no-tok", "--text", "the cat", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "no tokenizer.json" in err and "--ids" in err
    assert main(["info", "tiny-org/absent"]) == 2
    assert "tiny-org/absent is not in the local Hugging Face cache" in capsys.readouterr().err
