"""Validation at the boundaries (issue 16, items 10 and 11): config values per family,
token ids, channel selections and CLI list options end in a result or in a one-line
error naming the problem, never in a shape wall, a ZeroDivisionError or a traceback.

The fuzz tests (hypothesis) are deterministic (``derandomize``) with small budgets.
"""
from __future__ import annotations

import json
import re
import shutil

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.cli import build_parser, main
from implicit_attn.families import griffin, mamba, mamba2, rwkv
from implicit_attn.nn import check_input_ids
from implicit_attn.registry import FAMILIES

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """``{model_type: (directory, model)}``: each family's tiny random model, saved."""
    root = tmp_path_factory.mktemp("validation")
    out = {}
    for mt, spec in FAMILIES.items():
        cfg = spec.config.from_hf(dict(spec.tiny))
        model = spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(0)))
        ia.save(model, root / mt)
        out[mt] = (root / mt, model)
    return out


def with_config(src, dst, edit):
    """A copy of checkpoint ``src`` at ``dst`` whose ``config.json`` went through ``edit``."""
    if not dst.exists():
        shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def set_key(path, value):
    """An ``edit`` that sets ``config[path[0]][path[1]]...`` to ``value``."""
    def edit(config):
        d = config
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


# ----------------------------------------------------------------------------- item 10: config values

# (model_type, key path, value, words the message must contain)
LOAD_CASES = [
    ("mamba", ("hidden_size",), -16, ["hidden_size", "-16"]),
    ("mamba", ("state_size",), 0, ["state_size", "0"]),
    ("mamba", ("hidden_size",), "16", ["hidden_size", "'16'"]),
    ("mamba", ("expand",), 1.5, ["expand", "1.5"]),
    ("mamba", ("conv_kernel",), True, ["conv_kernel", "True"]),
    ("mamba", ("layer_norm_epsilon",), float("nan"), ["layer_norm_epsilon", "nan"]),
    ("mamba", ("use_bias",), 1, ["use_bias", "true or false"]),
    ("mamba", ("time_step_rank",), "big", ["time_step_rank", "'big'"]),
    ("mamba", ("vocab_size",), 2**63, ["vocab_size", str(2**63)]),
    ("mamba2", ("num_heads",), 0, ["num_heads", "0"]),
    ("mamba2", ("chunk_size",), -8, ["chunk_size", "-8"]),
    ("mamba2", ("time_step_limit",), 5, ["time_step_limit", "5"]),
    ("mamba2", ("time_step_limit",), ["a", 1.0], ["time_step_limit", "'a'"]),
    ("mamba2", ("time_step_limit",), [{"__float__": "huge"}, 1.0], ["time_step_limit", "huge"]),
    ("mamba2", ("n_groups",), 3, ["n_groups", "3"]),
    ("recurrent_gemma", ("num_attention_heads",), 0, ["num_attention_heads", "0"]),
    # config.json gives head_dim (HF writes it), so the heads must divide lru_width, not hidden_size
    ("recurrent_gemma", ("num_attention_heads",), 5, ["num_attention_heads (5)", "lru_width (24)"]),
    ("recurrent_gemma", ("head_dim",), 0, ["head_dim", "0"]),
    ("recurrent_gemma", ("num_key_value_heads",), 3, ["num_key_value_heads (3)"]),
    ("recurrent_gemma", ("block_types",), "recurrent", ["block_types", "'recurrent'"]),
    ("recurrent_gemma", ("block_types",), [["attention"]], ["block_types"]),
    ("recurrent_gemma", ("logits_soft_cap",), float("inf"), ["logits_soft_cap", "inf"]),
    ("recurrent_gemma", ("rope_parameters",), [1], ["rope_parameters", "[1]"]),
    ("recurrent_gemma", ("rope_parameters", "rope_theta"), -1.0, ["rope_theta", "-1.0"]),
    ("recurrent_gemma", ("rope_parameters", "partial_rotary_factor"), 2.0, ["partial_rotary_factor", "2.0"]),
    ("recurrent_gemma", ("intermediate_size",), 1, ["intermediate_size", "1"]),
    ("rwkv", ("hidden_size",), 16.0, ["hidden_size", "16.0"]),
    ("rwkv", ("attention_hidden_size",), -12, ["attention_hidden_size", "-12"]),
    ("rwkv", ("context_length",), 0, ["context_length", "0"]),
    ("rwkv", ("tie_word_embeddings",), "no", ["tie_word_embeddings", "'no'"]),
]


@pytest.mark.parametrize("mt,path,value,words", LOAD_CASES,
                         ids=[f"{c[0]}-{'.'.join(c[1])}={c[2]!r}" for c in LOAD_CASES])
def test_bad_config_value_is_an_error_naming_the_field(ckpts, tmp_path, mt, path, value, words):
    """A bad config value fails at load with a ``CheckpointError`` naming the field and
    the value (before: tensor-shape walls, ``ZeroDivisionError``, ``TypeError``)."""
    dst = with_config(ckpts[mt][0], tmp_path / "c", set_key(path, value))
    with pytest.raises(ia.CheckpointError) as e:
        ia.load(dst)
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    assert "has shape" not in msg, msg


def test_model_type_that_is_not_a_string(ckpts, tmp_path):
    dst = with_config(ckpts["mamba"][0], tmp_path / "c", set_key(("model_type",), ["mamba"]))
    with pytest.raises(ValueError, match=r"unknown model_type \['mamba'\]"):
        ia.load(dst)


@pytest.mark.parametrize("make,words", [
    (lambda: mamba.Config(vocab_size=8, hidden_size=np.int64(4)), None),
    (lambda: mamba.Config(vocab_size=8, hidden_size=False), "hidden_size must be an integer, got False"),
    (lambda: mamba.Config(vocab_size=8, hidden_size=4, hidden_act=["silu"]), "hidden_act ['silu']"),
    (lambda: mamba2.Config(vocab_size=8, hidden_size=8, num_heads=2, head_dim=4, expand=2.0), "expand"),
    (lambda: mamba2.Config(vocab_size=8, hidden_size=8, num_heads=2, head_dim=4, time_step_limit=(0.0, "x")),
     "time_step_limit"),
    (lambda: mamba2.Config(vocab_size=8, hidden_size=8, num_heads=2, head_dim=4,
                           time_step_limit=(float("nan"), 1.0)), "time_step_limit"),
    (lambda: griffin.Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                            num_attention_heads=2, block_types=("recurrent", "mlp")), "block_types"),
    (lambda: griffin.Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                            num_attention_heads=2, lru_width=5), "lru_width (5) must be a multiple"),
    (lambda: griffin.Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                            num_attention_heads=2, rms_norm_eps=-1e-6), "rms_norm_eps"),
    (lambda: rwkv.Config(vocab_size=8, hidden_size=4, rescale_every=2.0), "rescale_every must be an integer"),
    (lambda: rwkv.Config(vocab_size=8, hidden_size=2**31), "hidden_size must be a positive integer"),
])
def test_config_constructor_checks(make, words):
    """Each family's ``Config`` checks types (ints are ints, not bools, floats or strings),
    ranges, finiteness, enums and divisibility, naming the field; numpy ints are accepted
    and stored as Python ints."""
    if words is None:
        assert type(make().hidden_size) is int
        return
    with pytest.raises(ValueError) as e:
        make()
    assert words in str(e.value), str(e.value)


def test_configs_round_trip_unchanged():
    """Validation normalises but does not change a valid config (``to_hf``/``from_hf``)."""
    for spec in FAMILIES.values():
        cfg = spec.config.from_hf(dict(spec.tiny))
        assert spec.config.from_hf(cfg.to_hf()) == cfg


# Mutations: wrong types, zero, negative, huge, strings, and nearby values.
ODD_VALUES = [0, -1, -16, 1, 2, 3, 7, 2**31, 2**63, -2**63, 10**30, True, False, None, "", "16", "abc",
              [], [1], {}, {"a": 1}, 0.5, 1.5, -0.0, 16.0, float("nan"), float("inf"), float("-inf"), 1e300]


def leaf_paths(config):
    """Every key path of ``config``: top-level keys, and the entries of dict / list values."""
    out = []
    for k, v in sorted(config.items()):
        out.append((k,))
        if isinstance(v, dict):
            out += [(k, j) for j in sorted(v)]
        elif isinstance(v, list):
            out += [(k, i) for i in range(len(v))]
    return out


def value_for(original):
    """Odd values, and values derived from the original (negated, doubled, +1, as a string,
    as a float, wrapped in a list)."""
    derived = [[original], str(original)]
    if isinstance(original, (int, float)) and not isinstance(original, bool):
        derived += [-original, 2 * original, original + 1, float(original)]
    return st.one_of(st.sampled_from(ODD_VALUES + derived), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4))


SHAPE_ERROR = re.compile(r"has shape|missing tensors|unexpected tensors")


@pytest.mark.parametrize("mt", sorted(FAMILIES))
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_fuzz_config_values(ckpts, mt, data):
    """A random ``config.json`` value mutation loads a model or fails with a
    ``CheckpointError``/``ValueError`` that names the field (or, for a well-typed value
    that disagrees with the tensors, the mismatched tensor shapes): never another
    exception."""
    src = ckpts[mt][0]
    config = json.loads((src / "config.json").read_text())
    path = data.draw(st.sampled_from(leaf_paths(config)), label="path")
    d = config
    for k in path[:-1]:
        d = d[k]
    value = data.draw(value_for(d[path[-1]]), label="value")
    dst = with_config(src, src.parent / f"{mt}_fuzz", set_key(path, value))
    try:
        model = ia.load(dst)
    except ValueError as e:  # CheckpointError is a ValueError
        msg = str(e)
        names = [str(p) for p in path if isinstance(p, str)]
        named = any(n in msg for n in names)
        assert named or SHAPE_ERROR.search(msg), (path, value, msg)
        event("error naming the field" if named else "tensor shape error")
    else:
        assert model.family == mt
        event("loaded")


# ----------------------------------------------------------------------------- item 11: token ids, channels

def test_ragged_ids_are_a_clear_error(ckpts):
    model = ckpts["mamba"][1]
    with pytest.raises(ValueError, match=r"rectangular .* unequal lengths \[2, 1\]"):
        model([[1, 2], [3]])
    with pytest.raises(ValueError, match="rectangular"):
        model([[1, 2], 3])


def test_odd_token_ids(ckpts):
    model = ckpts["mamba"][1]
    with pytest.raises(ValueError, match=f"token id {2**70} is outside the vocabulary"):
        model([[1, 2**70]])
    with pytest.raises(TypeError, match="got an element None"):
        model([[1, None]])
    with pytest.raises(TypeError, match="bool"):
        model([[True, 2]])
    with pytest.raises(TypeError, match="element True of type bool"):
        model([[True, False]])
    with pytest.raises(TypeError, match="dtype bool"):
        model(np.ones((1, 2), bool))
    with pytest.raises(ValueError, match=f"token id {2**63} is outside"):
        model([[2**63, 1]])  # numpy makes this float64


def test_empty_channel_selections_are_clear_errors(ckpts):
    model = ckpts["mamba"][1]
    op = model.operators(np.array([[1, 2, 3]]), layers=[0])[0]
    with pytest.raises(ValueError, match=r"channels is empty"):
        op.reduce("mean", channels=[])
    with pytest.raises(ValueError, match=r"channels is empty"):
        op.materialize(channels=np.array([], np.int64))
    with pytest.raises(ValueError, match=r"slice\(5, 5, None\) selects no channel"):
        op.reduce("mean", channels=slice(5, 5))
    with pytest.raises(ValueError, match="not a valid slice"):
        op.reduce("mean", channels=slice(0, 4, 0))
    with pytest.raises(ValueError, match="1-D list of ints"):
        op.reduce("mean", channels=[[0, 1], [2]])
    with pytest.raises(ValueError, match="1-D list of ints"):
        op.reduce("mean", channels=True)
    np.testing.assert_allclose(np.asarray(op.reduce("mean", channels=slice(0, 2))),
                               np.asarray(op.reduce("mean", channels=[0, 1])), rtol=1e-6)
    # block sizes: a positive int (a float once failed inside jnp.pad, True counted as 1)
    for bad, error in ((0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError), ("4", TypeError)):
        with pytest.raises(error, match="block_channels must be"):
            op.reduce("mean", channels=[0, 1, 2], impl="xla", block_channels=bad)
    np.testing.assert_allclose(np.asarray(op.reduce("mean", channels=[0, 1, 2], impl="xla", block_channels=np.int64(2))),
                               np.asarray(op.reduce("mean", channels=[0, 1, 2], impl="xla")), rtol=1e-6)


def test_layer_selections_and_hook_shapes_are_named(ckpts):
    """``layers`` takes None, an int or ints (negatives from the end); a float or a bool was
    once "out of range" or taken as layer 1. A hook array of the wrong shape names the activation."""
    model = ckpts["mamba"][1]
    ids = np.array([[1, 2, 3]])
    n = len(model.layers)
    for bad in ([0.0], [True], True, "0", [np.bool_(False)]):
        with pytest.raises(ValueError, match="layers must be"):
            model.operators(ids, layers=bad)
    with pytest.raises(ValueError, match=f"layer {n} out of range for a model with {n} layers"):
        model.operators(ids, layers=[n])
    # an empty selection, like ``channels=[]``, is named (it gave [] here, and "need at least one
    # array to stack" or a start-layer error in the maps, explanations and smoothing)
    for call in (lambda: model.operators(ids, layers=[]), lambda: model.mixer_inputs(ids, layers=()),
                 lambda: ia.explain.model_maps(model, ids, layers=[]),
                 lambda: ia.explain.explain(model, ids, layers=np.array([], int)),
                 lambda: ia.explain.oversmoothing(model, ids, layers=[])):
        with pytest.raises(ValueError, match=r"layers is empty .*select at least one layer"):
            call()
    assert [op.shape for op in model.operators(ids, layers=np.int64(-1))] == [model.operators(ids, layers=[n - 1])[0].shape]
    D = model.config.hidden_size
    with pytest.raises(ValueError, match=r"adds\['hook_embed'\] must have the shape of hook_embed's activation = "
                                         rf"\(1, 3, {D}\), got \(1, 2, {D}\)"):
        model.run_with_hooks(ids, adds={"hook_embed": np.zeros((1, 2, D), np.float32)})


def test_explain_arguments_are_named(ckpts):
    """A float or bool query position, a float start layer and a relevance with NaN among the
    ranked positions are named errors (they were "out of range", taken as position 1, a
    TypeError from ``range``, and a curve from an arbitrary order)."""
    ex = ia.explain
    model = ckpts["mamba"][1]
    ids = np.array([[1, 2, 3, 4]])
    for q in (1.0, True):
        with pytest.raises(ValueError, match="query position must be an int"):
            ex.explain(model, ids, query=q)
    maps = np.full((2, 1, 4, 4), 0.25, np.float32)
    for bad in (0.5, True):
        with pytest.raises(ValueError, match="start_layer must be an int"):
            ex.rollout(maps, start_layer=bad)
    with pytest.raises(ValueError, match=r"start_layer must be in \[0, 2\) for 2 layer maps, got 2"):
        ex.rollout(maps, start_layer=2)
    rel = np.array([[0.1, np.nan, 0.3, 0.2]])
    with pytest.raises(ValueError, match=r"relevance is NaN or infinite at \(example, position\) \[\[0, 1\]\]"):
        ex.comprehensiveness(model, ids, rel)
    # after the query the relevance is not ranked: NaN there is allowed
    ex.comprehensiveness(model, ids, np.array([[0.1, 0.2, 0.3, np.nan]]), query=2)


def id_oracle(x):
    """The ``(B, L)`` int array ``x`` stands for when it is valid token ids, else None."""
    if isinstance(x, (np.ndarray, jax.Array)):
        if not np.issubdtype(x.dtype, np.integer) or x.ndim != 2 or x.size == 0:
            return None
        vals = np.asarray(x).tolist()
    else:
        if not (isinstance(x, (list, tuple)) and x and all(isinstance(r, (list, tuple)) for r in x)):
            return None
        vals = x
        if len({len(r) for r in vals}) != 1 or not vals[0]:
            return None
        if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) for r in vals for v in r):
            return None
    if any(not 0 <= v < VOCAB for r in vals for v in r):
        return None
    return np.asarray(vals, np.int32)


VOCAB = FAMILIES["mamba"].tiny["vocab_size"]
GOOD_ID = st.integers(0, VOCAB - 1)
ODD_ID = st.one_of(st.integers(-2**70, 2**70),
                   st.sampled_from([-1, VOCAB, True, False, 1.0, 2.5, float("nan"), None, "3", 2**63, 2**64,
                                    np.int64(3), np.uint8(2), np.float32(1.0), np.bool_(True), [1]]))
COMPILED = {(1, 3), (2, 3)}
DTYPES = ["int8", "uint8", "int16", "int32", "int64", "uint32", "uint64", "float16", "float32", "bool", "complex64"]


@st.composite
def token_inputs(draw):
    """Nested lists or tuples (rectangular or ragged, of depth 0-3) of valid ids with, half
    the time, one odd element (out of range, huge, a bool, a float, None, a string, a
    numpy scalar, a list); numpy arrays of any dtype and rank; jax arrays."""
    kind = draw(st.sampled_from(["rect", "rect", "rect", "ragged", "flat", "deep", "scalar", "numpy", "numpy",
                                 "jax"]))
    if kind in ("numpy", "jax"):
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        shape = draw(st.sampled_from([(1, 3), (2, 3), (1, 2), (3,), (1, 1, 2), (), (0, 3), (2, 0)]))
        hi = VOCAB + 3 if dtype.kind in "iu" else 2
        x = np.random.default_rng(draw(st.integers(0, 9))).integers(0, hi, shape).astype(dtype)
        return x if kind == "numpy" else jax.numpy.asarray(x)
    if kind == "scalar":
        return draw(st.one_of(GOOD_ID, ODD_ID))
    if kind == "rect":
        B, L = draw(st.sampled_from([(1, 3), (2, 3), (1, 3), (2, 3), (0, 3), (2, 0), (3, 1)]))
        x = [[draw(GOOD_ID) for _ in range(L)] for _ in range(B)]
    elif kind == "ragged":
        x = [[draw(GOOD_ID) for _ in range(draw(st.integers(0, 3)))] for _ in range(draw(st.integers(1, 3)))]
    elif kind == "flat":
        x = [[draw(GOOD_ID) for _ in range(draw(st.integers(1, 3)))]][0]
    else:
        x = [[[draw(GOOD_ID)] for _ in range(2)]]
    if draw(st.booleans()):
        flat = x if kind == "flat" else [r for r in x if r]
        if flat:
            row = draw(st.sampled_from(flat)) if kind != "flat" else x
            row[draw(st.integers(0, len(row) - 1))] = draw(ODD_ID)
    if draw(st.booleans()):
        x = tuple(tuple(r) if isinstance(r, list) else r for r in x)
    return x


@settings(FUZZ, max_examples=150)
@given(x=token_inputs())
def test_fuzz_token_ids(ckpts, x):
    """Random token-id inputs to a tiny model end in the logits of the ids they stand for
    or in a ``ValueError``/``TypeError`` naming the problem; never another exception."""
    model = ckpts["mamba"][1]
    want = id_oracle(x)
    if want is None:
        with pytest.raises((ValueError, TypeError)) as e:
            model(x)
        assert re.search(r"input_ids|token id", str(e.value)), str(e.value)
        event(type(e.value).__name__)
        return
    event("valid")
    np.testing.assert_array_equal(np.asarray(check_input_ids(x, VOCAB)), want)
    if want.shape in COMPILED:  # every new shape is a new compilation: a few only
        np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(model(want)))


# ----------------------------------------------------------------------------- item 11: CLI list options

def test_cli_ids_with_an_empty_entry_is_a_usage_error(ckpts, tmp_path, capsys):
    """``--ids "1,,2"`` ran on 2 tokens; now a usage error (exit code 2) before loading."""
    path = ckpts["mamba"][0]
    for argv in (["operator", str(path), "--ids", "1,,2", "--out", str(tmp_path)],
                 ["explain", str(path), "--ids", "1,,2", "--out", str(tmp_path)],
                 ["explain", str(path), "--ids", "1,2", "--layers", "0,", "--out", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is empty" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["operator", "ck", "--ids", "1,,2"])
    assert e.value.code == 2
    assert "argument --ids: must be integers separated by commas or spaces, got '1,,2' (entry 2 is empty)" \
        in capsys.readouterr().err
    for text, words in [("-1", "[0, 2147483647]"), (str(2**64), "[0, 2147483647]"), ("1_0", "'1_0'"),
                        ("\u0661", "is not an integer"), (" ", "blank")]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["operator", "ck", f"--ids={text}"])
        assert words in capsys.readouterr().err


def test_cli_info_on_bad_config_is_one_line(ckpts, tmp_path, capsys):
    """``implicit-attn info`` on Griffin ``num_attention_heads: 0`` printed a traceback."""
    dst = with_config(ckpts["recurrent_gemma"][0], tmp_path / "c", set_key(("num_attention_heads",), 0))
    assert main(["info", str(dst)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_attention_heads" in err, err


def test_cli_unexpected_error_is_one_line(ckpts, monkeypatch, capsys):
    """Any exception from the library is one line and a nonzero exit code, not a traceback."""
    def boom(*a, **k):
        raise ZeroDivisionError("integer modulo by zero\nsecond line")

    monkeypatch.setattr("implicit_attn.cli.load", boom)
    assert main(["info", str(ckpts["mamba"][0])]) == 1
    assert capsys.readouterr().err == ("implicit-attn: error: ZeroDivisionError: integer modulo by zero; "
                                       "second line\n")


LIST_OPTIONS = {"--ids": 0, "--layers": None, "--heads": None, "--exclude": None, "--segment-pos": None}
ARG_TEXT = st.one_of(
    st.text(alphabet=st.sampled_from(list("0123456789,, -+ \t_.xe\u0661")), max_size=8),
    st.lists(st.integers(-2**40, 2**40), max_size=4).map(lambda v: ",".join(map(str, v))),
    st.text(max_size=6))


def list_oracle(text, low):
    """The integers ``text`` stands for, or None where it is not a valid list option."""
    parts = text.split(",")
    toks = [p.split() for p in parts]
    if any(not t for t in toks):
        return None
    vals = [t for ts in toks for t in ts]
    if not all(re.fullmatch(r"[+-]?[0-9]+", t) for t in vals):
        return None
    vals = [int(t) for t in vals]
    lo = -(2**31 - 1) if low is None else low
    return vals if all(lo <= v <= 2**31 - 1 for v in vals) else None


@settings(FUZZ, max_examples=150)
@given(option=st.sampled_from(sorted(LIST_OPTIONS)), text=ARG_TEXT, command=st.sampled_from(["explain", "operator"]))
def test_fuzz_cli_list_options(option, text, command, capsys):
    """Random strings for the list options: a valid one parses, anything else is a usage
    error (``SystemExit`` 2 with a message naming the option); ``main`` returns 2 with one
    line (here the checkpoint does not exist, so a valid value fails at load)."""
    if command == "operator" and option != "--ids":
        option = "--ids"
    argv = [command, "no/such/ckpt/dir", f"{option}={text}"] + ([] if option == "--ids" else ["--ids", "1"])
    want = list_oracle(text, LIST_OPTIONS[option])
    if want is None:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
        assert f"argument {option}:" in capsys.readouterr().err
        event("usage error")
    else:
        event("valid")
        args = build_parser().parse_args(argv)
        assert getattr(args, option[2:].replace("-", "_")) == text
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip(), err
    if want is not None:
        assert err.count("\n") == 1 and "no/such/ckpt/dir" in err, err


def test_a_numpy_input_changed_right_after_the_call_is_not_seen():
    """``nn.as_device_array`` (block inputs, taps, checkpoint tensors): the device array holds the
    numpy input as it was at the call, though the transfer may finish later; the caller may
    overwrite its array at once (with a bare ``jax.device_put`` this failed in each of three runs)."""
    from implicit_attn.nn import as_device_array

    x = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)
    for _ in range(20):
        got = as_device_array(x)
        x[:] = np.nan
        assert np.array_equal(np.asarray(got), np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096))
        x[:] = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)


# the multi-token-prediction tensors released checkpoints carry, which HF's classes skip
UNREAD = {mt: ["mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight"] for mt in
          ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "nemotron_h")}
UNREAD["bailing_hybrid"] = ["model.layers.3.attention.dense.weight", "model.layers.3.mlp.gate_proj.weight"]


@pytest.mark.parametrize("mt", sorted(UNREAD))
def test_tensors_hf_skips_are_skipped(ckpts, tmp_path, mt):
    """A checkpoint holding a family's multi-token-prediction tensors (``FamilySpec.unread_tensors``,
    HF's ``_keys_to_ignore_on_load_unexpected``; Bailing's: the layers after the last one) loads
    as without them, and HF's class loads the same file to the same logits; before 2026-12-02
    the strict name check refused it. Any other extra tensor is still refused."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file

    from implicit_attn.testing import reference_class

    src, model = ckpts[mt]
    assert FAMILIES[mt].unread_tensors is not None
    dst = shutil.copytree(src, tmp_path / "c")
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(weights)
    extra = {name: np.ones((4, 4), np.float32) for name in UNREAD[mt]}
    save_file({**tensors, **extra}, weights, metadata={"format": "pt"})
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 9))
    np.testing.assert_array_equal(np.asarray(ia.load(dst)(ids)), np.asarray(model(ids)))
    tm = reference_class(FAMILIES[mt].hf_class).from_pretrained(dst).eval()
    with torch.no_grad():
        ref = tm(torch.tensor(ids)).logits.numpy()
    assert np.abs(ref - np.asarray(model(ids))).max() <= 1e-4 * np.abs(ref).max()
    save_file({**tensors, **extra, "model.extra.weight": np.ones(2, np.float32)}, weights, metadata={"format": "pt"})
    with pytest.raises(ia.CheckpointError, match="unexpected tensors: model.extra.weight$"):
        ia.load(dst)


def test_state_dict_names_that_clash_or_do_not_split_are_named(ckpts, tmp_path):
    """A file holding a tensor in both forms (the saved experts and transformers' stacked
    ones), a stacked tensor whose second axis does not split into its parts, or a fused conv
    whose rows are not its parts' fails with a ``CheckpointError`` naming the tensors."""
    from safetensors.numpy import load_file, save_file

    def with_tensors(mt, edit):
        dst = tmp_path / f"{mt}_{len(list(tmp_path.iterdir()))}"
        shutil.copytree(ckpts[mt][0], dst)
        (weights,) = dst.glob("*.safetensors")
        save_file(edit(load_file(weights)), weights, metadata={"format": "pt"})
        return dst

    mlp = "model.layers.0.mlp."
    both = with_tensors("qwen3_next", lambda t: {**t, mlp + "experts.down_proj": np.stack(
        [t[f"{mlp}experts.{e}.down_proj.weight"] for e in range(4)])})
    with pytest.raises(ia.CheckpointError, match=re.escape(
            f"tensors '{mlp}experts.0.down_proj.weight' and '{mlp}experts.down_proj' would both be "
            f"'{mlp}experts.0.down_proj.weight'")):
        ia.load(both)
    odd = with_tensors("qwen3_next", lambda t: {**t, mlp + "experts.gate_up_proj": np.ones((4, 15, 16), np.float32)})
    with pytest.raises(ia.CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.gate_up_proj' of shape "
                                                 r"\(4, 15, 16\) should hold the experts on its first axis and 2 equal"):
        ia.load(odd)
    attn = "model.layers.0.self_attn."
    fused = with_tensors("kimi_linear", lambda t: {**{k: v for k, v in t.items() if "_conv1d" not in k},
                                                   attn + "conv1d.weight": np.ones((23, 1, 4), np.float32)})
    with pytest.raises(ia.CheckpointError, match=re.escape(
            f"tensor '{attn}conv1d.weight' of shape (23, 1, 4) should be {attn}q_conv1d.weight, {attn}k_conv1d.weight, "
            f"{attn}v_conv1d.weight joined (8 + 8 + 8 rows)")):
        ia.load(fused)
