"""``implicit-attn explain`` end to end on a small saved checkpoint with a tokenizer.json."""
from __future__ import annotations

import argparse
import json
from html import escape as html_escape

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.cli import main
from implicit_attn.explain import activation, explain
from implicit_attn.explain import cli as explain_cli
from implicit_attn.families import mamba

WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "<script>", "a&b", "dog", "ran"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("explain_cli")
    cfg = mamba.Config(vocab_size=len(WORDS) + 6, hidden_size=8, state_size=4, num_hidden_layers=2)
    model = mamba.LM(cfg, mamba.init_params(cfg, jax.random.PRNGKey(2)))
    ia.save(model, root / "with_tok")
    ia.save(model, root / "no_tok")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "with_tok" / "tokenizer.json"))
    return root, model


def test_parser_options():
    p = argparse.ArgumentParser()
    explain_cli.add_parser(p.add_subparsers(dest="command"))
    a = p.parse_args(["explain", "ck", "--ids", "1,2", "--method", "attribution", "--variant", "s6_only",
                      "--layers", "0,1", "--query", "-2", "--out", "o"])
    assert (a.ckpt, a.method, a.variant, a.layers, a.query, a.out) == ("ck", "attribution", "s6_only", "0,1", -2, "o")
    assert a.func is explain_cli.run
    with pytest.raises(SystemExit):  # --text and --ids are exclusive
        p.parse_args(["explain", "ck", "--ids", "1", "--text", "x"])


def test_list_options_take_lists_that_start_with_a_negative_number():
    p = argparse.ArgumentParser()
    explain_cli.add_parser(p.add_subparsers(dest="command"))
    argv = ["explain", "ck", "--ids", "1,2", "--layers", "-1,-2", "--exclude", "-3, 0", "--query", "-2", "--out", "o"]
    with pytest.raises(SystemExit):  # argparse alone reads "-1,-2" as an option
        p.parse_args(argv)
    fixed = explain_cli.attach_negative_lists(argv)
    assert fixed[4:6] == ["--layers=-1,-2", "--exclude=-3, 0"] and fixed[6:8] == ["--query", "-2"]
    a = p.parse_args(fixed)
    assert (a.ids, a.layers, a.exclude, a.query, a.out) == ("1,2", "-1,-2", "-3, 0", -2, "o")
    # the value of an option that is itself a negative list, and a lone negative number, are left alone
    assert explain_cli.attach_negative_lists(["--layers=-1,2", "-5"]) == ["--layers=-1,2", "-5"]


def test_explain_cli_text_with_tokenizer(ckpt, capsys):
    root, model = ckpt
    out = root / "out_text"
    text = "the cat <script> sat on the a&b mat"
    assert main(["explain", str(root / "with_tok"), "--text", text, "--method", "raw",
                 "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "report:" in cap.out and str(out / "report.html") in cap.out
    assert "layer" in cap.err and "2/2" in cap.err  # the progress bar over layers
    res = json.loads((out / "relevance.json").read_text())
    assert res["tokens"] == text.split()
    ids = np.array([[WORDS.index(w) for w in text.split()]])
    assert res["ids"] == ids[0].tolist()
    ref = explain(model, ids, "raw").relevance[0]
    np.testing.assert_allclose(res["relevance"]["raw"], ref, rtol=1e-5, atol=1e-7)
    for png in ("raw_layers.png", "raw_matrix.png", "relevance.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    html = (out / "report.html").read_text()
    assert "&lt;script&gt;" in html and "<script>" not in html and "a&amp;b" in html
    assert html.count("data:image/png;base64,") == 3  # strip, layer grid, layer-mean matrix
    # the target is shown as the token text the tokenizer knows, with its id
    t = res["target"]
    known = WORDS[t] if t < len(WORDS) else None
    assert res["target_token"] == known
    shown = f"{known!r} (id {t})" if known is not None else f"id {t}"
    assert f"<b>target token</b>: {html_escape(shown)}<" in html


def test_explain_cli_ids_and_errors(ckpt, capsys):
    root, model = ckpt
    out = root / "out_ids"
    assert main(["explain", str(root / "no_tok"), "--ids", "1 2 3 4 5", "--method", "rollout",
                 "--variant", "s6_only", "--layers", "1", "--query", "3", "--metrics", "--out", str(out)]) == 0
    res = json.loads((out / "relevance.json").read_text())
    assert res["tokens"] == ["1", "2", "3", "4", "5"] and res["query"] == 3
    ids = np.array([[1, 2, 3, 4, 5]])
    ref = explain(model, ids, "rollout", variant="s6_only", layers=[1], query=3)
    np.testing.assert_allclose(res["relevance"]["rollout"], ref.relevance[0], rtol=1e-5, atol=1e-7)
    assert set(res["metrics"]["rollout"]) == {"auac", "au_mse", "positive_auc", "negative_auc",
                                              "comprehensiveness", "sufficiency"}
    np.testing.assert_allclose(res["metrics"]["rollout"]["auac"],
                               activation(model, ids, ref.relevance, query=3).mean_area, rtol=1e-6)
    assert "faithfulness" in (out / "report.html").read_text().lower()
    capsys.readouterr()
    assert main(["explain", str(root / "no_tok"), "--text", "the cat", "--out", str(out)]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert main(["explain", str(root / "no_tok"), "--ids", "1,99", "--out", str(out)]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["explain", str(root / "no_tok"), "--ids", "1,2", "--variant", "bad", "--out", str(out)]) == 2
    assert "variant" in capsys.readouterr().err
    # a list starting with a negative number reaches the list check, not argparse's option parsing
    assert main(["explain", str(root / "no_tok"), "--ids", "-1,2", "--out", str(out)]) == 2
    assert "argument --ids: must be integers in [0, " in capsys.readouterr().err



def test_explain_cli_heads_and_segment_pos_reach_explain(ckpt, capsys):
    """--heads and --segment-pos are passed to ``explain`` (Mamba has neither heads nor
    documents: the library's errors come back as exit code 2)."""
    root, _ = ckpt
    out = root / "out_err"
    assert main(["explain", str(root / "no_tok"), "--ids", "1,2", "--segment-pos", "0,0", "--out", str(out)]) == 2
    assert "only taken by Griffin" in capsys.readouterr().err
    assert main(["explain", str(root / "no_tok"), "--ids", "1,2", "--heads", "0", "--out", str(out)]) == 2
    assert "use channels=" in capsys.readouterr().err
    assert main(["explain", str(root / "no_tok"), "--ids", "1,2", "--heads", "x", "--out", str(out)]) == 2
    assert "argument --heads: must be integers" in capsys.readouterr().err
