"""Over-smoothing (``explain.smoothing``, Eq. 24 of the hidden-attention paper's appendix A):
against a float64 double loop over the pairs ``i < j`` written from the paper's formula, on
known cases, on tiny random models of two families and the LaS transformer (against numpy
applied to ``run_with_cache``), and bad inputs. No torch."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from implicit_attn.explain import feature_smoothing, model_maps, oversmoothing, smoothing_plot, smoothing_summary
from implicit_attn.models import las
from implicit_attn.registry import FAMILIES


def m_feat(X, keep=None) -> float:
    """Eq. (24) as written: 2 / (n (n-1)) sum_{i<j} cos(X_i, X_j), float64, kept rows only
    (the Gram matrix's strict upper triangle, not the library's sum-of-unit-vectors form)."""
    X = np.asarray(X, np.float64)
    if keep is not None:
        X = X[np.asarray(keep, bool)]
    n = X.shape[0]
    cos = (X @ X.T) / np.outer(np.linalg.norm(X, axis=1), np.linalg.norm(X, axis=1))
    return 2.0 / (n * (n - 1)) * np.sum(np.triu(cos, k=1))      # the pairs j > i only


def test_random_feature_maps_match_the_float64_formula():
    rng = np.random.default_rng(0)
    for B, L, d in [(3, 2, 5), (2, 17, 8), (1, 40, 3)]:
        X = (rng.normal(size=(B, L, d)) + rng.normal(size=(1, 1, d))).astype(np.float32)
        got = feature_smoothing(X)
        assert got.dtype == np.float32 and got.shape == (B,)
        want = [m_feat(X[b]) for b in range(B)]
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    # exclude and mask drop the same rows from the pairs
    X = rng.normal(size=(2, 12, 6)).astype(np.float32) * 3.0
    mask = rng.random((2, 12)) > 0.3
    mask[:, :3] = True
    got = feature_smoothing(X, exclude=(0, -1), mask=mask)
    for b in range(2):
        keep = mask[b].copy()
        keep[[0, 11]] = False
        np.testing.assert_allclose(got[b], m_feat(X[b], keep), atol=2e-6)


def test_known_cases():
    d = 7
    v = np.arange(1, d + 1, dtype=np.float32)
    same = np.stack([v * s for s in (1.0, 2.0, 0.5, 10.0)])              # parallel rows -> 1
    np.testing.assert_allclose(feature_smoothing(same), [1.0], atol=1e-6)
    eye = np.eye(5, d, dtype=np.float32) * np.arange(1, 6, dtype=np.float32)[:, None]
    np.testing.assert_allclose(feature_smoothing(eye), [0.0], atol=1e-7)  # orthogonal rows -> 0
    # v and -v alternating: pairs i < j agree on parity -> +1, else -1; n = 4: 2 of 6 pairs +1
    alt = np.stack([v, -v, v, -v])
    np.testing.assert_allclose(feature_smoothing(alt), [(2 - 4) / 6], atol=1e-6)
    # the diagonal is not counted: two orthogonal tokens give 0, not (2 + 0) / 4
    np.testing.assert_allclose(feature_smoothing(eye[:2]), [0.0], atol=1e-7)
    # bfloat16 activations are measured in float32
    Xb = np.asarray(jax.numpy.asarray(same, jax.numpy.bfloat16))
    np.testing.assert_allclose(feature_smoothing(Xb), [m_feat(Xb.astype(np.float64))], atol=1e-6)
    # float32 on a long, nearly identical map: no cancellation loss
    rng = np.random.default_rng(1)
    X = (v[None] + 1e-3 * rng.normal(size=(2000, d))).astype(np.float32)
    np.testing.assert_allclose(feature_smoothing(X), [m_feat(X)], atol=1e-6)


def tiny(model_type):
    spec = FAMILIES[model_type]
    cfg = spec.config.from_hf(spec.tiny)
    return spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(0)))


def rows(x, point):
    x = np.asarray(x, np.float64)
    if point != "mixer.hook_out":
        return x
    return np.swapaxes(x, 1, 2) if x.ndim == 3 else np.transpose(x, (0, 2, 1, 3)).reshape(x.shape[0], x.shape[2], -1)


def las_model():
    cfg = las.Config(vocab_size=23, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
    return las.init(cfg, 0)


@pytest.mark.parametrize("which", ["mamba", "bamba", "las"])
def test_models_equal_numpy_on_run_with_cache(which):
    model = las_model() if which == "las" else tiny(which)
    n = len(model.layers)
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, (2, 9))
    points = ["hook_resid_post", "mixer.hook_out"] + (["hook_resid_mid"] if "hook_resid_mid" in model.hook_points else [])
    _, cache = model.run_with_cache(ids)
    for point in points:
        got = oversmoothing(model, ids, point=point)
        assert got.shape == (2, n) and got.dtype == np.float32
        want = [[m_feat(rows(cache[f"blocks.{i}.{point}"], point)[b]) for i in range(n)] for b in range(2)]
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=point)
    sub = oversmoothing(model, ids, layers=[-1], exclude=(0,))
    X = rows(cache[f"blocks.{n - 1}.hook_resid_post"], "hook_resid_post")
    np.testing.assert_allclose(sub[:, 0], [m_feat(X[b, 1:]) for b in range(2)], atol=2e-6)
    # right padding: masked positions neither enter the pairs nor change the kept ones (causal)
    mask = np.ones((2, 9), bool)
    mask[1, 6:] = False
    padded = oversmoothing(model, ids, mask=mask)
    short = oversmoothing(model, ids[1:, :6])
    np.testing.assert_allclose(padded[1], short[0], atol=2e-6)
    np.testing.assert_allclose(padded[0], oversmoothing(model, ids)[0], atol=0)


def test_summary_and_plot(tmp_path):
    v = np.array([[0.1, 0.5], [0.3, 0.7]], np.float32)
    s = smoothing_summary(v, layers=[1, 3], num_layers=4)
    assert s["depth"] == [0.5, 1.0] and s["n"] == 2
    np.testing.assert_allclose(s["mean"], [0.2, 0.6], atol=1e-7)
    np.testing.assert_allclose(s["std"], [0.1, 0.1], atol=1e-7)
    json.dumps(s)
    assert smoothing_plot({"a": s, "b": smoothing_summary(v[:, :1])}, tmp_path / "s.png").stat().st_size > 0
    with pytest.raises(ValueError, match="layer indices"):
        smoothing_summary(v, layers=[0])
    with pytest.raises(ValueError, match="num_layers"):
        smoothing_summary(v, layers=[0, 4], num_layers=4)


def test_bad_inputs_raise_value_errors_naming_the_problem():
    X = np.ones((2, 5, 3), np.float32)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        feature_smoothing(X[:, :1])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        feature_smoothing(X, exclude=(0, 1, 2, 3))
    with pytest.raises(ValueError, match="out of range"):
        feature_smoothing(X, exclude=(5,))
    with pytest.raises(ValueError, match="mask must have shape"):
        feature_smoothing(X, mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="boolean"):
        feature_smoothing(X, mask=np.ones((2, 5)))
    with pytest.raises(ValueError, match="feature map"):
        feature_smoothing(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="floating"):
        feature_smoothing(np.ones((2, 5, 3), np.int32))
    Z = X.copy()
    Z[1, 3] = 0.0
    with pytest.raises(ValueError, match="token 3 of example 1 has norm 0"):
        feature_smoothing(Z)
    np.testing.assert_allclose(feature_smoothing(Z, exclude=(3,)), [1.0, 1.0], atol=1e-6)
    Z[0, 2] = np.nan
    with pytest.raises(ValueError, match="token 2 of example 0"):
        feature_smoothing(Z)
    model = tiny("mamba")
    ids = np.zeros((1, 4), np.int64)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        oversmoothing(model, ids[:, :1])
    with pytest.raises(ValueError, match="point must be one of"):
        oversmoothing(model, ids, point="mixer.hook_values")
    with pytest.raises(ValueError, match="no 'hook_resid_mid' hook point"):
        oversmoothing(model, ids, point="hook_resid_mid")
    with pytest.raises(ValueError, match="layer 5 out of range"):
        oversmoothing(model, ids, layers=[5])
    with pytest.raises(ValueError, match="vocab"):
        oversmoothing(model, ids + model.config.vocab_size)


def test_compare_maps_script_on_tiny_models(tmp_path):
    from benchmarks.induction import compare_maps

    a = tiny("mamba")
    las.save(tmp_path / "b", las.init(las.Config(vocab_size=a.config.vocab_size, hidden_size=16,
                                                 num_hidden_layers=1, num_attention_heads=2), 1))
    b = compare_maps.load_checkpoint(tmp_path / "b")
    assert isinstance(b, las.LaSLM)
    ids = np.random.default_rng(3).integers(0, a.config.vocab_size, (3, 7))
    target, answer = np.array([2, 6, 4]), ids[np.arange(3), [2, 6, 4]]
    res = compare_maps.compare({"a": a, "b": b}, ids, tmp_path / "out", tag="_t", target_pos=target, answer=answer,
                               chunk=1)   # one row at a time: the shapes the panel already compiled
    for f in ("induction_compare_t.png", "induction_compare_t_smoothing.png", "induction_compare_t.json",
              "induction_compare_t_maps.npz"):
        assert (tmp_path / "out" / f).stat().st_size > 0, f
    assert json.loads((tmp_path / "out" / "induction_compare_t.json").read_text()) == res
    saved = np.load(tmp_path / "out" / "induction_compare_t_maps.npz")
    for name, m in (("a", a), ("b", b)):
        s = res["models"][name]["smoothing"]
        assert s["num_layers"] == len(m.layers) == len(s["mean"]) and s["n"] == 3
        np.testing.assert_allclose(s["mean"], oversmoothing(m, ids).mean(axis=0), atol=1e-6)
        maps = np.concatenate([model_maps(m, ids[k:k + 1], how="abs_mean") for k in range(3)], 1)  # (layers, 3, 7, 7)
        np.testing.assert_allclose(saved[name], maps[:, 0], rtol=1e-6, atol=1e-7)
        ind = res["models"][name]["induction"]
        for k, v in compare_maps.induction_masses(maps, target).items():
            np.testing.assert_allclose(ind[k], v, rtol=1e-5, atol=1e-7)
        want = np.mean([np.asarray(m(ids[k:k + 1]))[0, -1].argmax() == answer[k] for k in range(3)])
        assert res["models"][name]["accuracy"] == want
    with pytest.raises(ValueError, match="share a vocabulary"):
        compare_maps.compare({"a": a, "c": las_model()}, ids, tmp_path / "out")
    c = compare_maps.random_transformer(a, tmp_path / "c", layers=1, heads=2)
    assert c.config.hidden_size == a.config.hidden_size and not c.config.eld and c.config.pool == 1


def test_induction_masses_against_loops():
    from benchmarks.induction import compare_maps

    g = np.random.default_rng(5)
    maps = np.tril(g.random((2, 3, 6, 6)))          # (layers, B, L, L)
    maps[1, 2, 5] = 0.0
    maps[1, 2, 5, 3] = 2.0                          # layer 1, sequence 2: the last query reads position 3
    target = np.array([1, 5, 3])                    # sequence 1's target is the last position: not counted
    got = compare_maps.induction_masses(maps, target)
    for l in range(2):
        share = lambda b, i, j: maps[l, b, i, j] / maps[l, b, i].sum()
        assert got["answer_mass"][l] == pytest.approx(np.mean([share(b, 5, target[b]) for b in range(3)]))
        hits = [int(np.argmax(maps[l, b, 5, :5]) == target[b]) for b in (0, 2)]
        assert got["answer_top"][l] == pytest.approx(np.mean(hits))
        prev = [share(b, i, i - 1) for b in range(3) for i in range(1, 6)]
        assert got["prev_token_mass"][l] == pytest.approx(np.mean(prev))
    assert got["answer_top"][1] >= 0.5 and got["answer_mass"][1] > 1 / 3
    with pytest.raises(ValueError, match="non-negative"):
        compare_maps.induction_masses(-maps, target)
    with pytest.raises(ValueError, match="target_pos must lie"):
        compare_maps.induction_masses(maps, target + 3)
    with pytest.raises(ValueError, match="expected maps"):
        compare_maps.induction_masses(maps[0], target)


@pytest.mark.deep   # ~20 s (orbax, the shipped Mamba's operators, three models' figures)
def test_compare_maps_trained_run_vs_untrained_writes_per_layer_maps(tmp_path):
    """The script's whole path: the shipped Mamba, a transformer trained (2 steps) by the
    induction trainer and loaded from its run directory, and an untrained one."""
    from benchmarks.induction import compare_maps, models, train
    from implicit_attn.demo import induction

    rc = train.RunConfig(model="transformer_alibi", key=True, steps=2, batch_size=2, length=8)
    train.train(rc, tmp_path / "run", ckpt_every=2, progress=False)
    trained = compare_maps.load_checkpoint(tmp_path / "run")
    assert isinstance(trained, las.LaSLM) and trained.config.alibi and trained.config.kind == "alibi"
    ids = induction.batch_at(0, 3, 2, 8, key=True).ids
    spec = models.get_spec("transformer_alibi")
    np.testing.assert_allclose(np.asarray(trained(ids)), np.asarray(models.forward(trained.params(), ids, spec)),
                               rtol=1e-5, atol=1e-5)
    assert compare_maps.main(["--b", str(tmp_path / "run"), "random-las", "--random-dir", str(tmp_path / "rand"),
                              "--n", "3", "--length", "8", "--out", str(tmp_path / "out"), "--tag", "_t"]) == 0
    doc = json.loads((tmp_path / "out" / "induction_compare_t.json").read_text())
    maps = np.load(tmp_path / "out" / "induction_compare_t_maps.npz")
    want = {"shipped induction model": 1, "run": 2, "random vanilla transformer": 2}
    assert set(doc["models"]) == set(want) and set(maps.files) == set(want) | {"ids"}
    for name, layers in want.items():
        assert maps[name].shape == (layers, 8, 8) and (maps[name] >= 0).all()
        assert not np.triu(maps[name], 1).any()          # causal
        d = doc["models"][name]
        assert all(len(d["induction"][k]) == layers for k in ("answer_mass", "answer_top", "prev_token_mass"))
        assert 0.0 <= d["accuracy"] <= 1.0
    np.testing.assert_array_equal(maps["ids"], induction.eval_set(3, compare_maps.SEED, 8, True).ids[0])
