"""The command line, end to end, in-process."""
import jax
import numpy as np

import implicit_attn as ia
from implicit_attn.cli import main
from implicit_attn.families import mamba


def test_demo_runs_with_no_required_arguments(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--length", "40"]) == 0
    out = capsys.readouterr().out
    assert "(exact)" in out and "NOT EXACT" not in out
    assert "induction model" in out and "the model predicts" in out
    assert "strongest key" in out or "no off-diagonal key" in out
    png = tmp_path / "demo_layer_last_abs_mean.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = np.load(tmp_path / "demo_layer_last_abs_mean.npy")
    assert m.shape == (40, 40) and np.all(np.triu(m, 1) == 0) and m.max() > 0
    rel = np.load(tmp_path / "demo_rollout_relevance.npy")
    assert rel.shape == (40,) and np.all(np.isfinite(rel))
    assert (tmp_path / "demo_rollout_relevance.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["demo", "--out", str(tmp_path), "--length", "2"]) == 2
    assert "length" in capsys.readouterr().err


def test_info_and_operator(tmp_path, capsys):
    cfg = mamba.Config(vocab_size=20, hidden_size=8, state_size=4, num_hidden_layers=2)
    model = mamba.LM(cfg, mamba.init_params(cfg, jax.random.PRNGKey(0)))
    ia.save(model, tmp_path / "m")
    assert main(["info", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert '"family": "mamba"' in out and f'"parameters": {model.num_params}' in out
    assert main(["operator", str(tmp_path / "m"), "--ids", "1,2,3,4,5", "--layer", "1",
                 "--out", str(tmp_path / "o")]) == 0
    arr = np.load(tmp_path / "o" / "layer1_full_abs_mean.npy")
    ops = model.operators(np.array([[1, 2, 3, 4, 5]]), layers=[1])
    np.testing.assert_allclose(arr, np.asarray(ops[0].reduce("abs_mean"))[0], rtol=1e-6)
    assert (tmp_path / "o" / "layer1_full_abs_mean.png").exists()
    assert main(["operator", str(tmp_path / "m"), "--ids", "1,99", "--out", str(tmp_path / "o")]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
