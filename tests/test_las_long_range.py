"""The LaS long-range benchmark (benchmarks.las.long_range): the digits as pixel sequences
(against scikit-learn's own 8x8 images read row by row), the split, the batch order, the
summary, and a two-step training smoke run on a tiny synthetic split. No long training here."""
import dataclasses

import numpy as np
import pytest

from benchmarks.las import long_range as R


def tiny_split(n_train=12, n_test=12, length=10, seed=0):
    g = np.random.default_rng(seed)
    ids = lambda n: g.integers(0, R.LEVELS, (n, length)).astype(np.int32)
    lab = lambda n: g.integers(0, R.CLASSES, n).astype(np.int32)
    return R.Split(ids(n_train), lab(n_train), ids(n_test), lab(n_test))


def test_digits_are_the_row_major_pixels_and_the_split_is_a_partition():
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    s = R.load_split()
    assert s.train_ids.shape == (len(d.target) - R.TEST, 64) and s.test_ids.shape == (R.TEST, 64)
    assert s.train_ids.dtype == np.int32 and s.train_ids.min() >= 0 and s.train_ids.max() == R.LEVELS - 1
    # every sequence is one image read row by row (images[k][r, c] at position 8 r + c), each image once
    want = sorted((np.ascontiguousarray(img, np.int32).tobytes(), int(t)) for img, t in zip(d.images, d.target))
    got = sorted((row.astype(np.int32).tobytes(), int(t))
                 for ids, y in ((s.train_ids, s.train_y), (s.test_ids, s.test_y)) for row, t in zip(ids, y))
    assert got == want
    again = R.load_split.__wrapped__()
    np.testing.assert_array_equal(again.test_ids, s.test_ids)
    other = R.load_split.__wrapped__(split_seed=1)
    assert not np.array_equal(other.test_y, s.test_y)
    with pytest.raises(ValueError, match="test must be"):
        R.load_split.__wrapped__(test=0)


def test_run_bad_input_and_variant_flags():
    with pytest.raises(ValueError, match="model"):
        R.Run(model="mamba")
    with pytest.raises(ValueError, match="epochs"):
        R.Run(model="las", epochs=0)
    with pytest.raises(ValueError, match="exceeds"):
        R.Run(model="las", batch_size=20, n_train=10)
    for m in R.MODELS:
        assert R.Run(model=m).config.kind == m
    run = R.Run(model="las", n_train=1297)
    assert run.steps == 20 * 25 and run.config.B == 0.016 and run.config.pool == 3


def test_batch_order_is_a_deterministic_permutation_per_epoch():
    run = R.Run(model="vanilla", seed=3, batch_size=4, n_train=10)
    a = R.batch_order(run, 0)
    assert a.shape == (2, 4) and len(set(a.ravel())) == 8 and a.max() < 10
    np.testing.assert_array_equal(a, R.batch_order(run, 0))
    assert not np.array_equal(a, R.batch_order(run, 1))
    assert not np.array_equal(a, R.batch_order(dataclasses.replace(run, seed=4), 0))


def test_summarize_mean_std_and_paper_columns():
    runs = [{"model": "las", "test_acc": a, "train_acc": 1.0} for a in (0.5, 0.7, 0.9)]
    (row,) = R.summarize(runs + [{"model": "alibi", "test_acc": 0.1, "train_acc": 0.2}], ["las"])
    assert row["seeds"] == 3 and row["test_acc_mean"] == pytest.approx(70.0)
    assert row["test_acc_std"] == pytest.approx(np.sqrt(((20 ** 2) * 2) / 3))
    assert row["paper_image"] == 64.90 and row["paper_avg"] == 68.52


def test_three_epochs_lower_the_loss_and_accuracy_counts_argmax_hits():
    split = tiny_split()
    run = R.Run(model="las", epochs=3, batch_size=6, hidden=16, layers=1, heads=2, lr=1e-2, warmup=1,
                n_train=len(split.train_y))
    def loss(params):   # cross-entropy in float64 from the logits (one compiled shape: 12 rows)
        z = np.asarray(R.class_logits_jit(params, split.train_ids, run.config), np.float64)
        z = z - z.max(-1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(-1)) - z[np.arange(len(z)), split.train_y]))

    before = loss(R.las.init_params(run.config, 0))
    res = R.train(run, split, log_every=1)
    after = loss(res["params"])
    assert np.isfinite(after) and after < before and len(res["losses"]) == run.steps == 6
    logits = np.asarray(R.class_logits_jit(res["params"], split.test_ids, run.config))
    want = np.mean(logits.argmax(-1) == split.test_y)
    assert R.accuracy(run, res["params"], split.test_ids, split.test_y, chunk=12) == want
    with pytest.raises(ValueError, match="n_train"):
        R.train(dataclasses.replace(run, n_train=18), split)


def test_merge_combines_per_seed_results_and_refuses_duplicates(tmp_path, monkeypatch):
    import json

    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    settings = {"epochs": 20, "B": 0.016}
    for seed, accs in ((0, (0.5, 0.6)), (1, (0.7, 0.9))):
        runs = [{"model": m, "seed": seed, "test_acc": a, "train_acc": 1.0} for m, a in zip(("vanilla", "las"), accs)]
        (tmp_path / f"s{seed}.json").write_text(json.dumps({"meta": {"settings": {**settings, "seeds": 1},
                                                                     "complete": True, "runs": runs, "paper": "x"}}))
    R.merge(["s1", "s0"], "both", ("vanilla", "las"), results=tmp_path)
    doc = json.loads((tmp_path / "both.json").read_text())
    assert [(r["seed"], r["model"]) for r in doc["meta"]["runs"]] == [(0, "vanilla"), (0, "las"), (1, "vanilla"),
                                                                       (1, "las")]
    assert doc["meta"]["complete"] and doc["meta"]["settings"]["seeds"] == 2
    rows = {r["model"]: r for r in doc["rows"]}
    assert rows["las"]["test_acc_mean"] == pytest.approx(75.0) and rows["vanilla"]["test_acc_mean"] == pytest.approx(60.0)
    with pytest.raises(ValueError, match="twice"):
        R.merge(["s0", "s0"], "dup", ("vanilla", "las"), results=tmp_path)
    (tmp_path / "s2.json").write_text(json.dumps({"meta": {"settings": {**settings, "B": 1e-3, "seeds": 1},
                                                           "complete": True, "runs": [], "paper": "x"}}))
    with pytest.raises(ValueError, match="different settings"):
        R.merge(["s0", "s2"], "bad", results=tmp_path)
