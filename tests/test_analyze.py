"""Batch analysis (``implicit_attn.analyze``): every stored row equals the example run alone
through ``explain`` (padding changes nothing), statistics against a float64 reference,
interrupt-and-resume equals an uninterrupted run byte for byte, bad lines, changed settings,
the command line; deep: 8 emulated devices and 2 ``jax.distributed`` processes give the
store of 1."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.analyze import StoreMismatch, read_array, read_manifest
from implicit_attn.analyze.run import KILL_AFTER_ENV
from implicit_attn.cli import main
from implicit_attn.demo import induction
from implicit_attn.explain import explain, faithfulness
from implicit_attn.families import mamba
from implicit_attn.registry import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
DEMO = induction.ASSET_DIR


def write_corpus(path: Path, lengths, seed: int = 0, vocab: int = 16, text_every: int = 0) -> list[np.ndarray]:
    """A ``.jsonl`` corpus of random ids (every ``text_every``-th line as demo text); returns the ids."""
    rng = np.random.default_rng(seed)
    out = []
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            ids = rng.integers(0, vocab, n)
            out.append(ids)
            if text_every and i % text_every == 0:
                f.write(json.dumps({"text": " ".join(induction.decode(ids))}) + "\n")
            else:
                f.write(json.dumps({"ids": ids.tolist()}) + "\n")
    return out


def stats_reference(A: np.ndarray, n: int):
    """Mean attention distance and entropy of one ``(L, L)`` map over rows ``< n``, float64 loops."""
    dist, ent = [], []
    for i in range(n):
        w = np.abs(A[i, :i + 1].astype(np.float64))
        if w.sum() == 0:
            continue
        p = w / w.sum()
        dist.append(sum(p[j] * (i - j) for j in range(i + 1)))
        ent.append(-sum(p[j] * np.log(p[j]) for j in range(i + 1) if p[j] > 0))
    return np.mean(dist), np.mean(ent)


@pytest.fixture(scope="module")
def tiny_mamba(tmp_path_factory):
    cfg = mamba.Config(vocab_size=20, hidden_size=8, state_size=4, num_hidden_layers=2)
    model = mamba.LM(cfg, mamba.init_params(cfg, jax.random.PRNGKey(3)))
    path = tmp_path_factory.mktemp("tiny") / "mamba"
    ia.save(model, path)
    return ia.load(path)


CASES = {  # model, method, analyses
    "demo-rollout": ("demo", "rollout", ("maps", "relevance", "faithfulness", "stats")),
    "mamba-contributions": ("tiny", "contributions", ("relevance",)),
    "mamba-attribution": ("tiny", "attribution", ("maps", "relevance")),
}


# default tier: every analysis on the demo model at short lengths; the gradient methods are deep
@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "demo-rollout" else pytest.mark.deep)
                                  for c in CASES])
def test_padded_batches_equal_each_example_alone(case, tmp_path, tiny_mamba):
    """Lengths 3..21 in buckets of 16 and 32, batches of 4 (partly filler): every row
    equals ``explain`` / ``faithfulness`` on the example alone to float32 rounding
    (rtol 1e-5, atol 1e-6), and is exactly 0 (ids: -1) after its length."""
    which, method, analyses = CASES[case]
    model = induction.load_default()[0] if which == "demo" else tiny_mamba
    # (the default-tier case: 3 distinct lengths, one bucket, a batch with 3 filler rows)
    lengths = [9, 3, 9, 5, 3] if case == "demo-rollout" else [21, 3, 9, 17, 9, 5]
    ids = write_corpus(tmp_path / "c.jsonl", lengths, text_every=3 if which == "demo" else 0)
    out = tmp_path / "store"
    summary = ia.analyze(model, tmp_path / "c.jsonl", out, analyses, method=method, batch_size=4,
                         exclude=(0,) if method == "attribution" else (), progress=False)
    assert summary["computed"] == len(lengths) and summary["rows"] == len(lengths)
    assert read_array(out, "done").tolist() == [1] * len(lengths)
    assert read_array(out, "length").tolist() == lengths
    sids, target = read_array(out, "ids"), read_array(out, "target")
    Lmax = max(lengths)
    tol = dict(rtol=1e-5, atol=1e-6)
    for r, x in enumerate(ids):
        n = x.size
        np.testing.assert_array_equal(sids[r, :n], x)
        assert np.all(sids[r, n:] == -1)
        ex = explain(model, x[None], method=method, exclude=(0,) if method == "attribution" else ())
        assert target[r] == ex.target[0]
        if "relevance" in analyses:
            rel = read_array(out, "relevance")[r]
            assert rel.shape == (Lmax,) and np.all(rel[n:] == 0)
            np.testing.assert_allclose(rel[:n], ex.relevance[0], **tol)
        if "maps" in analyses:
            m = read_array(out, "maps")[r]
            assert m.shape == (len(model.layers), Lmax, Lmax) and np.all(m[:, n:] == 0) and np.all(m[:, :, n:] == 0)
            # (attribution's layer_maps are (g A)^+; the maps are raw's A_l)
            ref = (explain(model, x[None], method="raw") if method == "attribution" else ex).layer_maps[:, 0]
            np.testing.assert_allclose(m[:, :n, :n], ref, **tol)
        if "stats" in analyses:
            for l in range(len(model.layers)):
                d, e = stats_reference(ex.layer_maps[l, 0], n)
                np.testing.assert_allclose(read_array(out, "stats/distance")[r, l], d, rtol=1e-5)
                np.testing.assert_allclose(read_array(out, "stats/entropy")[r, l], e, rtol=1e-5)
        if "faithfulness" in analyses:
            curves = faithfulness(model, x[None], read_array(out, "relevance")[r:r + 1, :n], target=target[r:r + 1])
            for name, c in curves.items():
                np.testing.assert_allclose(read_array(out, f"faithfulness/{name}")[r], c.area[0], rtol=1e-5, atol=1e-7)
                np.testing.assert_allclose(read_array(out, f"faithfulness/{name}_curve")[r], c.values[0],
                                           rtol=1e-5, atol=1e-7)
    man = read_manifest(out)
    assert man["settings"]["method"] == method and man["model"]["family"] == "mamba"
    assert man["corpus"]["rows"] == len(lengths) and man["library_version"] == ia.__version__
    assert all((out / name / "zarr.json").is_file() for name in man["arrays"])


def run_cli(args, env_extra=None, xla_devices=None, timeout=300):
    """``python -m implicit_attn.cli analyze ...`` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    if xla_devices is not None:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=1", "") + \
            f" --xla_force_host_platform_device_count={xla_devices}"
    return subprocess.Popen([sys.executable, "-m", "implicit_attn.cli", "analyze", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def same_store(a: Path, b: Path, exact: bool = True):
    names = read_manifest(a)["arrays"]
    assert names == read_manifest(b)["arrays"]
    for n in names:
        x, y = read_array(a, n), read_array(b, n)
        if exact or x.dtype.kind in "iu":
            assert x.tobytes() == y.tobytes(), n
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=n)


ANALYSES = "maps,relevance,faithfulness,stats"


@pytest.mark.parametrize("stage", [pytest.param("done", marks=pytest.mark.deep), "data"])
def test_killed_run_resumes_to_the_uninterrupted_store(stage, tmp_path):
    """SIGKILL after 4 rows are marked done ("done"), or after a batch's data is written but
    before it is marked done ("data"); the rerun computes only the rest and the store is
    byte-for-byte the uninterrupted one."""
    write_corpus(tmp_path / "c.jsonl", [9, 3, 9, 5, 12, 4], text_every=4)
    args = [DEMO, "--data", tmp_path / "c.jsonl", "--analyses", ANALYSES, "--batch-size", "2", "--no-progress"]
    p = run_cli(args + ["--out", tmp_path / "killed"], {KILL_AFTER_ENV: f"4:{stage}" if stage == "data" else "4"})
    p.communicate(timeout=300)
    assert p.returncode == -9
    done = read_array(tmp_path / "killed", "done")
    assert done.sum() == (4 if stage == "done" else 2)
    assert main(["analyze", *map(str, args), "--out", str(tmp_path / "killed")]) == 0
    assert main(["analyze", *map(str, args), "--out", str(tmp_path / "whole")]) == 0
    same_store(tmp_path / "killed", tmp_path / "whole", exact=True)


def test_bad_lines_are_named_or_skipped_and_recorded(tmp_path, capsys):
    good = write_corpus(tmp_path / "c.jsonl", [5, 7, 6])
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    lines[1:1] = ['{"ids": [1, 2', '{"ids": [1, 99]}', '{"text": ""}', '[1, 2]', " "]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    model = induction.load_default()[0]
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        ia.analyze(model, tmp_path / "bad.jsonl", tmp_path / "s", ("relevance",), progress=False)
    assert not (tmp_path / "s").exists()
    assert main(["analyze", str(DEMO), "--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "s")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    ia.analyze(model, tmp_path / "bad.jsonl", tmp_path / "s", ("relevance",), skip_bad_lines=True, progress=False)
    man = read_manifest(tmp_path / "s")
    assert [b["line"] for b in man["corpus"]["skipped"]] == [2, 3, 4, 5, 6]
    assert man["corpus"]["skipped"][4]["error"] == "blank line"
    assert "outside the vocabulary [0, 17)" in man["corpus"]["skipped"][1]["error"]
    assert "empty" in man["corpus"]["skipped"][2]["error"] and "JSON object" in man["corpus"]["skipped"][3]["error"]
    assert read_array(tmp_path / "s", "line").tolist() == [1, 7, 8]
    assert read_array(tmp_path / "s", "length").tolist() == [x.size for x in good]
    with pytest.raises(ValueError, match="longer than max_length 6"):
        ia.analyze(model, tmp_path / "c.jsonl", tmp_path / "s2", ("relevance",), max_length=6, progress=False)


def test_a_changed_setting_or_corpus_is_refused(tmp_path):
    write_corpus(tmp_path / "c.jsonl", [5, 7])
    model = induction.load_default()[0]
    ia.analyze(model, tmp_path / "c.jsonl", tmp_path / "s", ("relevance",), progress=False)
    (tmp_path / "moved.jsonl").write_bytes((tmp_path / "c.jsonl").read_bytes())  # a moved corpus resumes
    again = ia.analyze(model, tmp_path / "moved.jsonl", tmp_path / "s", ("relevance",), progress=False)
    assert again["already_done"] == 2 and again["computed"] == 0
    with pytest.raises(StoreMismatch, match="settings.method: store has \"rollout\", this run \"raw\""):
        ia.analyze(model, tmp_path / "c.jsonl", tmp_path / "s", ("relevance",), method="raw", progress=False)
    write_corpus(tmp_path / "c.jsonl", [5, 7], seed=1)
    with pytest.raises(StoreMismatch, match="corpus.sha256"):
        ia.analyze(model, tmp_path / "c.jsonl", tmp_path / "s", ("relevance",), progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("mine")
    with pytest.raises(StoreMismatch, match="not an analysis store"):
        ia.analyze(model, tmp_path / "c.jsonl", tmp_path / "other", ("relevance",), progress=False)
    with pytest.raises(ValueError, match="analyses must be"):
        ia.analyze(model, tmp_path / "c.jsonl", tmp_path / "s3", ("maps", "heads"), progress=False)
    assert main(["analyze", str(DEMO), "--data", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "s4"),
                 "--analyses", "maps,nope"]) == 2
    with pytest.raises(ValueError, match="model_shards must be a positive int dividing the 1 devices"):
        ia.analyze(DEMO, tmp_path / "c.jsonl", tmp_path / "s5", ("relevance",), model_shards=2, progress=False)
    with pytest.raises(ValueError, match="model_shards > 1 needs a checkpoint path"):
        ia.analyze(model, tmp_path / "c.jsonl", tmp_path / "s5", ("relevance",), model_shards=2, progress=False)


def test_sequences_and_text_files_are_corpora(tmp_path):
    """A Python list (as a ``datasets.Dataset`` is read: ``len`` and ``[i]``) of dicts, and a
    plain text file with one text per line, give the rows of the equal ``.jsonl``."""
    model = induction.load_default()[0]
    ids = write_corpus(tmp_path / "c.jsonl", [4, 6, 5])
    texts = [" ".join(induction.decode(x)) for x in ids]
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    ia.analyze(model, tmp_path / "c.jsonl", tmp_path / "a", ("relevance",), progress=False)
    ia.analyze(model, tmp_path / "c.txt", tmp_path / "b", ("relevance",), progress=False)
    ia.analyze(model, [{"ids": x.tolist()} for x in ids], tmp_path / "c", ("relevance",), progress=False)
    for s in ("b", "c"):
        np.testing.assert_array_equal(read_array(tmp_path / s, "relevance"), read_array(tmp_path / "a", "relevance"))
        np.testing.assert_array_equal(read_array(tmp_path / s, "ids"), read_array(tmp_path / "a", "ids"))


@pytest.mark.deep
def test_eight_devices_give_the_store_of_one(tmp_path):
    """8 emulated CPU devices (batch axis sharded 8 ways) vs 1, same batch size: same store to
    float32 rounding (integer arrays exactly)."""
    write_corpus(tmp_path / "c.jsonl", [21, 3, 9, 17, 9, 5, 12, 30, 4, 11, 16, 2], text_every=5)
    args = [DEMO, "--data", tmp_path / "c.jsonl", "--analyses", ANALYSES, "--batch-size", "8", "--no-progress"]
    runs = [run_cli(args + ["--out", tmp_path / f"d{n}"], xla_devices=n) for n in (8, 1)]
    for p in runs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    assert json.loads(out.splitlines()[-1])["devices"] == 1
    same_store(tmp_path / "d8", tmp_path / "d1", exact=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.deep
def test_two_processes_give_the_store_of_one(tmp_path):
    """2 processes on localhost with ``jax.distributed`` (rows i % 2 == p each) write one
    store; it equals the 1-process store (integer arrays exactly, floats to rounding)."""
    write_corpus(tmp_path / "c.jsonl", [21, 3, 9, 17, 9, 5, 12, 30, 4, 11, 16], text_every=5)
    args = [DEMO, "--data", tmp_path / "c.jsonl", "--analyses", ANALYSES, "--batch-size", "2", "--no-progress"]
    port = free_port()
    procs = [run_cli(args + ["--out", tmp_path / "two", "--coordinator", f"localhost:{port}", "--num-processes", "2",
                             "--process-id", str(i)]) for i in range(2)]
    procs.append(run_cli(args + ["--out", tmp_path / "one"]))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.splitlines()[-1]))
    assert [o["process_rows"] for o in outs] == [6, 5, 11] and [o["computed"] for o in outs] == [6, 5, 11]
    same_store(tmp_path / "two", tmp_path / "one", exact=False)


SHARDED = """
import json, sys, numpy as np, jax
import implicit_attn as ia
from implicit_attn.analyze import model_sharding
from jax.sharding import Mesh
ckpt, data, out = sys.argv[1:4]
devs = jax.local_devices()
mesh = Mesh(np.array(devs).reshape(1, 4), ("batch", "model"))
model = ia.load(ckpt, sharding_of=model_sharding(mesh))
leaves = jax.tree_util.tree_leaves(model.params())
split = [[sh.data.nbytes for sh in x.addressable_shards] for x in leaves]
summary = ia.analyze(ckpt, data, out, ("maps", "relevance", "stats"), method="attribution", batch_size=4,
                     model_shards=4, progress=False)
print(json.dumps({"devices": len(devs), "total": sum(x.nbytes for x in leaves), "split": split, "summary": summary}))
"""


@pytest.mark.deep
def test_parameters_split_over_four_devices_give_the_store_of_one(tmp_path, tiny_mamba):
    """``model_shards=4`` on 4 emulated devices: every parameter of the tiny Mamba (all of its
    dimensions' largest divisible by 4) is read in 4 slices, one per device, each a quarter of
    it; the store equals the 1-device one (integers exactly, floats to rounding)."""
    ia.save(tiny_mamba, tmp_path / "ckpt")
    write_corpus(tmp_path / "c.jsonl", [9, 3, 17, 5, 12, 4, 7], vocab=20)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=1", "") + \
        " --xla_force_host_platform_device_count=4"
    p = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / "ckpt"), str(tmp_path / "c.jsonl"),
                        str(tmp_path / "four")], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.splitlines()[-1])
    assert r["devices"] == 4 and r["summary"]["model_shards"] == 4
    for shards in r["split"]:
        assert len(shards) == 4 and len(set(shards)) == 1
    assert sum(s[0] for s in r["split"]) * 4 == r["total"]
    ia.analyze(tmp_path / "ckpt", tmp_path / "c.jsonl", tmp_path / "one", ("maps", "relevance", "stats"),
               method="attribution", batch_size=4, progress=False)
    same_store(tmp_path / "four", tmp_path / "one", exact=False)


@pytest.mark.deep
@pytest.mark.parametrize("model_type", ["recurrent_gemma", "qwen3_next", "rwkv7"])
def test_padding_changes_nothing_in_other_families(model_type, tmp_path):
    """Local attention + RG-LRU (RecurrentGemma), the chunked delta rule with attention
    layers (Qwen3-Next), the DPLR recurrence (RWKV-7): right-padded batches give each
    example's ``explain`` maps and contributions alone (relative to their largest entry: 1e-4)."""
    spec = FAMILIES[model_type]
    cfg = spec.config.from_hf(spec.tiny)
    model = spec.lm(cfg, spec.init_params(cfg, 0))
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (11, 4, 7)]
    ia.analyze(model, data, tmp_path / "s", ("maps", "relevance"), method="contributions", batch_size=4,
               progress=False)
    rel, maps = read_array(tmp_path / "s", "relevance"), read_array(tmp_path / "s", "maps")
    for r, x in enumerate(data):
        n = len(x)
        ex = explain(model, np.array([x]), method="contributions")
        raw = explain(model, np.array([x]), method="raw").layer_maps[:, 0]
        assert np.all(rel[r, n:] == 0) and np.all(maps[r][:, n:] == 0)
        np.testing.assert_allclose(rel[r, :n], ex.relevance[0], rtol=0, atol=1e-4 * np.abs(ex.relevance).max())
        np.testing.assert_allclose(maps[r][:, :n, :n], raw, rtol=0, atol=1e-4 * np.abs(raw).max())
