"""The atomic-task benchmark of the LaS paper (benchmarks.las.atomic): generators, causality,
R^2 and a two-step training smoke run. No long training here."""
import dataclasses

import numpy as np
import pytest

from benchmarks.las import atomic as A


def loop_targets(task, x, marker):
    """The targets by direct per-position loops (float64)."""
    n, L = x.shape
    y, w = np.zeros((n, L)), np.ones((n, L))
    for r in range(n):
        p = int(np.flatnonzero(marker[r])[0]) if task == "select" else -1
        for i in range(L):
            if task == "cumsum":
                y[r, i] = sum(float(x[r, j]) for j in range(i)) / np.sqrt(max(i, 1))
            elif task == "cummax":
                y[r, i] = max(float(x[r, j]) for j in range(i + 1))
            else:
                y[r, i] = float(x[r, p]) if i >= p else 0.0
                w[r, i] = 1.0 if i >= L // 2 else 0.0
    return y, w


@pytest.mark.parametrize("task", A.TASKS)
@pytest.mark.parametrize("length", [2, 9, 32])
def test_targets_match_direct_computation(task, length):
    b = A.batch_at(task, 3, 7, 6, length)
    assert b.feats.shape == (6, length, A.FEATURES) and b.feats.dtype == np.float32
    x, marker, start = b.feats[..., 0], b.feats[..., 1], b.feats[..., 2]
    assert (start[:, 0] == 1).all() and (start[:, 1:] == 0).all()
    if task == "select":
        assert (marker.sum(1) == 1).all() and (np.argmax(marker, 1) < length // 2).all()
    else:
        assert (marker == 0).all()
    y, w = loop_targets(task, x.astype(np.float64), marker)
    np.testing.assert_allclose(b.y, y, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(b.weight, w)


@pytest.mark.parametrize("task", A.TASKS)
def test_targets_are_causal(task):
    b = A.batch_at(task, 0, 0, 4, 24)
    x, marker = b.feats[..., 0].astype(np.float64), b.feats[..., 1]
    for t in (0, 5, 23):
        x2 = x.copy()
        x2[:, t:] = np.random.default_rng(t).standard_normal(x2[:, t:].shape) * 10
        m2 = marker.copy()
        if task == "select" and t > 0:   # keep the marker if it is before t, else move it within [0, t)
            late = np.argmax(marker, 1) >= t
            m2[late] = 0
            m2[late, 0] = 1
            y1, _ = A.targets(task, x, np.where(late[:, None], m2, marker))
        else:
            y1, _ = A.targets(task, x, marker)
        y2, _ = A.targets(task, x2, m2)
        np.testing.assert_array_equal(y1[:, :t], y2[:, :t])


def test_batches_are_deterministic_and_streams_differ():
    a, b = A.batch_at("cumsum", 1, 4, 3, 16), A.batch_at("cumsum", 1, 4, 3, 16)
    np.testing.assert_array_equal(a.feats, b.feats)
    assert not np.array_equal(a.feats, A.batch_at("cumsum", 1, 5, 3, 16).feats)
    assert not np.array_equal(a.feats, A.batch_at("cumsum", 2, 4, 3, 16).feats)
    assert not np.array_equal(A.eval_set("cumsum", 1, 3, 16).feats, A.batch_at("cumsum", 1, 0, 3, 16).feats)


def test_r2_against_float64_formula():
    g = np.random.default_rng(0)
    y, pred = g.standard_normal(200), g.standard_normal(200)
    want = 1 - np.sum((y - pred) ** 2) / np.sum((y - y.mean()) ** 2)
    assert A.r2_score(y, pred) == pytest.approx(want, rel=1e-12)
    assert A.r2_score(y, y) == 1.0
    assert A.r2_score(y, np.full_like(y, y.mean())) == pytest.approx(0.0, abs=1e-12)
    w = (np.arange(200) % 2).astype(float)
    assert A.r2_score(y, pred, w) == pytest.approx(A.r2_score(y[1::2], pred[1::2]), rel=1e-12)


def test_bad_names():
    with pytest.raises(ValueError, match="task"):
        A.Run(task="sort", model="las")
    with pytest.raises(ValueError, match="model"):
        A.Run(task="cumsum", model="mamba")


# the ablations run the same training code with other flags: a repeat, in the deep tier
@pytest.mark.parametrize("model", [pytest.param(m, marks=[pytest.mark.deep] if m not in A.DEFAULT_MODELS else [])
                                   for m in A.MODELS])
def test_two_steps_decrease_the_loss(model):
    run = A.Run(task="cummax", model=model, steps=2, batch_size=8, length=8, hidden=16, layers=1, heads=2,
                lr=1e-2, warmup=1)
    assert run.config.kind == model
    b = A.device_batch(A.batch_at(run.task, run.seed, 1, run.batch_size, run.length))
    before = float(A.mse(A.init_params(run), *b, run.config))
    res = A.train(run, log_every=1)
    after = float(A.mse(res["params"], *b, run.config))
    assert np.isfinite(after) and after < before
    again = A.train(dataclasses.replace(run), log_every=1)   # deterministic
    assert again["losses"] == res["losses"]
