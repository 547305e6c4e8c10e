"""The ViM digits benchmark (benchmarks.vim.digits): data split, patch blackout, the perturbation
ordering and a two-step training smoke run. No long training here."""
import numpy as np
import pytest

pytest.importorskip("sklearn")
from benchmarks.vim import digits as Dg  # noqa: E402

CFG = Dg.Run(steps=2, hidden_size=8, state_size=2).config


def test_data_split():
    tx, ty, vx, vy, black = Dg.load_data()
    assert tx.shape == (1348, 1, 8, 8) and vx.shape == (449, 1, 8, 8) and tx.dtype == np.float32
    assert len(ty) == 1348 and len(vy) == 449 and set(np.unique(vy)) == set(range(10))
    assert abs(float(tx.mean())) < 1e-5 and abs(float(tx.std()) - 1) < 1e-4
    assert np.isclose(tx.min(), black)  # a 0 pixel is the darkest value


def test_blackout_matches_loop():
    g = np.random.default_rng(0)
    x = g.standard_normal((3, 1, 8, 8)).astype(np.float32)
    order = np.stack([g.permutation(16) for _ in range(3)])
    got = Dg.blackout(x, order, 5, -9.0, CFG)
    want = x.copy()
    for b in range(3):
        for p in order[b, :5]:
            r, c = divmod(int(p), 4)          # row-major patch grid, as vim.patch_embed
            want[b, 0, 2 * r:2 * r + 2, 2 * c:2 * c + 2] = -9.0
    np.testing.assert_array_equal(got, want)


def test_perturbation_order_and_auc(monkeypatch):
    # a stand-in classifier: correct while patch 0 (top-left) is intact
    monkeypatch.setattr(Dg, "predict", lambda params, x, cfg: np.where(x[:, 0, 0, 0] == -9.0, -1, 0))
    x, y = np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64)
    rel = np.tile(-np.arange(16.0), (4, 1))                      # patch 0 most relevant
    pos = Dg.perturbation(None, x, y, rel, -9.0, CFG, positive=True)
    neg = Dg.perturbation(None, x, y, rel, -9.0, CFG, positive=False)
    assert pos["curve"] == [0.0] * 9 and pos["auc"] == 0.0
    # least relevant first: patch 0 goes last (k = 16 never reached at f <= 0.9)
    assert neg["curve"] == [100.0] * 9 and np.isclose(neg["auc"], 80.0)


@pytest.mark.deep
def test_two_training_steps():
    data = Dg.load_data()
    res = Dg.train(Dg.Run(steps=2, hidden_size=8, state_size=2), data)
    assert len(res["losses"]) == 1 and np.isfinite(res["losses"][0][1])
