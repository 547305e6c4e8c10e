"""The induction-head task, its training loop (resume), the mechanism check and the
shipped checkpoint."""
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from implicit_attn.demo import induction as I
from implicit_attn.families import mamba


# ----------------------------------------------------------------------------- generator

@pytest.mark.parametrize("length", [4, 17, 255])
def test_no_key_generator_invariants(length):
    b = I.batch_at(3, 5, 400, length, key=False)
    ids = b.ids
    assert ids.shape == (400, length) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < I.NUM_SYMBOLS       # no key token
    for r in range(400):
        last = ids[r, -1]
        occ = np.flatnonzero(ids[r, :-1] == last)
        assert occ.size > 0                                      # the answer is always defined
        assert b.earlier_pos[r] == occ[-1]                       # the latest earlier occurrence
        assert b.target_pos[r] == occ[-1] + 1
        assert b.answer[r] == ids[r, occ[-1] + 1]


@pytest.mark.parametrize("length", [4, 255])
def test_key_generator_places_exactly_two_keys(length):
    b = I.batch_at(0, 1, 400, length, key=True)
    ids = b.ids
    assert np.all((ids == I.KEY).sum(axis=1) == 2)
    assert np.all(ids[:, -1] == I.KEY)
    first = np.argmax(ids == I.KEY, axis=1)
    assert np.all(first == b.earlier_pos) and np.all(b.target_pos == first + 1)
    assert np.all(b.target_pos <= length - 2)                    # the answer is a symbol
    assert np.all(b.answer == ids[np.arange(400), first + 1]) and np.all(b.answer < I.NUM_SYMBOLS)
    assert len(set(first.tolist())) > 1                         # the position varies


def test_batches_are_pure_functions_of_seed_and_index():
    a, b = I.batch_at(1, 7, 8), I.batch_at(1, 7, 8)
    np.testing.assert_array_equal(a.ids, b.ids)
    assert not np.array_equal(a.ids, I.batch_at(1, 8, 8).ids)
    assert not np.array_equal(I.eval_set(8, 1).ids, I.batch_at(1, 0, 8).ids)   # eval stream differs
    # last token uniform over present symbols: every symbol shows up as the query
    assert set(I.batch_at(0, 0, 2000).ids[:, -1].tolist()) == set(range(I.NUM_SYMBOLS))


def test_generator_bad_input():
    with pytest.raises(ValueError, match="length"):
        I.batch_at(0, 0, 4, 3)
    with pytest.raises(ValueError, match="batch_size"):
        I.batch_at(0, 0, 0)
    with pytest.raises(ValueError, match="seed"):
        I.batch_at(-1, 0, 4)
    with pytest.raises(ValueError, match="logits"):
        I.accuracy_of(np.zeros((3, 17)), np.zeros(4))
    with pytest.raises(ValueError, match="token ids"):
        I.decode([17])


def test_tokenizer_round_trip():
    tok = I.build_tokenizer()
    assert tok.encode("s3 [key] s15 s0").ids == [3, I.KEY, 15, 0]
    assert I.decode([3, I.KEY, 15]) == ["s3", "[key]", "s15"]
    shipped = I.load_tokenizer()
    assert shipped.get_vocab() == tok.get_vocab()


# ----------------------------------------------------------------------------- training

def _tiny(train, model="conv_ssm", **kw):
    return train.RunConfig(model=model, key=True, steps=kw.pop("steps", 40), batch_size=16,
                           length=16, lr=1e-2, **kw)


def test_short_training_reduces_the_loss(tmp_path):
    from benchmarks.induction import train

    # 60 steps (was 40): with 40 the drop was within noise of the 0.2 margin and depended on
    # the exact initial values (0.198 for the numpy-drawn init_params of seed 0).
    rc = _tiny(train, steps=60)
    res = train.train(rc, tmp_path / "run", ckpt_every=1000, progress=False, log_every=1)
    losses = np.array([l for _, l in res["losses"]])
    assert res["step"] == 60 and len(losses) == 60
    assert losses[-10:].mean() < losses[:10].mean() - 0.2


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    from benchmarks.induction import train

    rc = _tiny(train, "ssm", steps=24, warm_length=8, warm_steps=10)
    full = train.train(rc, tmp_path / "a", ckpt_every=6, progress=False)["params"]
    part = train.train(rc, tmp_path / "b", ckpt_every=6, stop_at=14, progress=False)   # "killed" at 14
    assert part["step"] == 14
    resumed = train.train(rc, tmp_path / "b", ckpt_every=6, progress=False)
    assert resumed["resumed_from"] == 14 and resumed["step"] == 24
    for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(resumed["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _, loaded = train.load_run(tmp_path / "b")
    for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="other arguments"):
        train.train(_tiny(train, "ssm", steps=30), tmp_path / "b", progress=False)


def test_run_config_and_models_bad_input():
    from benchmarks.induction import models, train

    with pytest.raises(ValueError, match="unknown configuration"):
        train.RunConfig(model="gpt", key=True, steps=1)
    with pytest.raises(ValueError, match="steps"):
        train.RunConfig(model="conv", key=True, steps=0)
    with pytest.raises(ValueError, match="warm_length"):
        train.RunConfig(model="conv", key=True, steps=5, warm_steps=2, warm_length=1000)
    spec = models.get_spec("conv_ssm")
    with pytest.raises(ValueError, match="not a Hugging Face Mamba"):
        models.to_lm(models.init(spec, jax.random.PRNGKey(0)), spec)


def test_mamba_spec_is_the_hf_path():
    from benchmarks.induction import models

    spec = models.get_spec("mamba1")
    p = models.init(spec, jax.random.PRNGKey(1))
    ids = I.batch_at(0, 0, 2, 12, key=True).ids
    lm = models.to_lm(p, spec)
    fwd = jax.jit(lambda p, ids: models.forward(p, ids, spec))
    np.testing.assert_allclose(np.asarray(fwd(p, ids)), np.asarray(lm(ids)),
                               rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- mechanism

def test_last_row_equals_reduce_for_every_variant():
    cfg = mamba.Config(vocab_size=I.VOCAB_SIZE, hidden_size=8, state_size=4, num_hidden_layers=2,
                       conv_kernel=3)
    model = mamba.LM(cfg, mamba.init_params(cfg, jax.random.PRNGKey(2)))
    ids = I.batch_at(0, 0, 3, 21, key=False).ids
    x = model.mixer_inputs(ids, [1])[1]

    @jax.jit   # one compilation for all variants and reductions
    def both(p, x):
        out = {}
        for v in I.VARIANTS:
            op = mamba.mixer_operator(p, x, cfg, v)
            for how in I.HOWS:
                out[v, how] = (I.state_decay_last_row(op.core, how), op.reduce(how)[:, -1])
        return out

    for (v, how), (a, b) in both(model.layers[1].mixer.arrays(), x).items():
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max(), err_msg=f"{v} {how}")
    a = I.last_rows(model, ids, layer=-1, variant="no_gate", method="row", batch_size=2)
    b = I.last_rows(model, ids, layer=1, variant="no_gate", method="reduce", batch_size=2)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
    with pytest.raises(ValueError, match="variant"):
        I.last_rows(model, ids, variant="nope")
    with pytest.raises(ValueError, match="layer"):
        I.last_rows(model, ids, layer=2)


def test_strongest_keys_excludes_the_diagonal():
    row = np.array([[0.1, 0.5, 0.2, 9.0]])
    assert I.strongest_keys(row)[0] == 1 and I.strongest_keys(row, exclude_diagonal=False)[0] == 3


# ----------------------------------------------------------------------------- shipped model

def test_shipped_checkpoint_loads_and_reaches_its_reported_accuracy():
    model, meta = I.load_default()
    assert model.family == "mamba" and model.config.vocab_size == I.VOCAB_SIZE
    size = sum(p.stat().st_size for p in I.ASSET_DIR.iterdir())
    assert size < 5e6
    task = meta["task"]
    n = 256
    ev = I.eval_set(n, seed=99, length=task["length"], key=task["key"])
    acc = I.evaluate(lambda ids: model(ids), ev, batch_size=128)
    p = meta["accuracy"]
    tol = 4 * math.sqrt(max(p * (1 - p), 1.0 / n) / n)   # binomial, floor of one error in n
    assert abs(acc - p) <= tol, (acc, p, tol)
    assert acc > 0.5   # far above chance (1/16)
    res = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "results" /
                      "induction_table2.json").read_text())
    row = [r for r in res["rows"] if r["run"] == meta["run"]]
    assert row and abs(row[0]["accuracy_%"] / 100 - p) <= 4 * math.sqrt(max(p * (1 - p), 1e-3) / 1000) + 1e-3


def test_transformer_spec_is_the_las_model():
    from benchmarks.induction import models
    from implicit_attn.models import las

    spec = models.get_spec("transformer_alibi")
    cfg = spec.las_config()
    assert cfg.kind == "alibi" and cfg.vocab_size == I.VOCAB_SIZE and cfg.num_hidden_layers == 2
    assert models.get_spec("transformer_vanilla").las_config().kind == "vanilla"
    p = models.init(spec, jax.random.PRNGKey(0))
    ids = I.batch_at(0, 0, 2, 10, key=True).ids
    lm = models.to_lm(p, spec)
    assert isinstance(lm, las.LaSLM)
    np.testing.assert_allclose(np.asarray(models.forward(p, ids, spec)), np.asarray(lm(ids)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a transformer"):
        models.get_spec("mamba1").las_config()
