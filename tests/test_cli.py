"""The command line, end to end, in-process."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.cli import main
from implicit_attn.families import mamba
from implicit_attn.compile_cache import ENV, compile_cache_dir
from implicit_attn.kernels.cpu import cache
from implicit_attn.kernels.cpu.cache import cpu_key


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
    # a negative layer is named by its index: -2 of 2 layers writes layer0's files
    assert main(["operator", str(tmp_path / "m"), "--ids", "1,2,3,4,5", "--layer", "-2",
                 "--out", str(tmp_path / "neg")]) == 0
    assert "operator of layer 0:" in capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "neg").iterdir())
    assert names == ["layer0_full_abs_mean.npy", "layer0_full_abs_mean.png"]
    first = model.operators(np.array([[1, 2, 3, 4, 5]]), layers=[0])[0]
    np.testing.assert_allclose(np.load(tmp_path / "neg" / "layer0_full_abs_mean.npy"),
                               np.asarray(first.reduce("abs_mean"))[0], rtol=1e-6)
    assert main(["operator", str(tmp_path / "m"), "--ids", "1,99", "--out", str(tmp_path / "o")]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_quick_flags_only_on_jaxlib_releases_known_to_accept_them(monkeypatch, capsys):
    """XLA ends the process at an option in ``$XLA_FLAGS`` it does not know (processes on
    jaxlib 0.11.2 died at start with the quick options): they are set only on the releases
    where each was run and accepted (0.6 to 0.10); elsewhere XLA's defaults, and an explicit
    ``--compile quick`` says so on stderr."""
    from implicit_attn import cli, compile_cache
    from implicit_attn.compile_cache import QUICK_XLA_FLAGS, quick_compile, quick_flags, with_quick_flags

    for known in ("0.6.0", "0.7.2", "0.9.0.1", "0.10.2", "0.10.3.dev20261201"):
        assert quick_flags(known) == QUICK_XLA_FLAGS, known
    for unknown in ("0.5.3", "0.4.38", "0.11.2", "0.11.0rc1", "1.0.0", "weird"):
        assert quick_flags(unknown) == (), unknown
    monkeypatch.setattr(compile_cache.importlib.metadata, "version", lambda name: "0.11.2")
    assert quick_flags() == () and with_quick_flags("--foo=1") == "--foo=1"
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    with quick_compile():
        assert os.environ["XLA_FLAGS"] == "--foo=1"
    monkeypatch.setattr(cli, "quick_compile", lambda enabled: contextlib.nullcontext())
    assert cli.main(["--no-compile-cache", "--compile", "quick", "info", "/nonexistent/ckpt"]) == 2
    err = capsys.readouterr().err
    assert "--compile quick compiles with XLA's defaults here: jaxlib 0.11.2" in err
    assert cli.main(["--no-compile-cache", "info", "/nonexistent/ckpt"]) == 2
    assert "XLA's defaults" not in capsys.readouterr().err


def test_quick_compile_for_small_checkpoints_only(tmp_path, monkeypatch):
    """``--compile auto`` compiles quickly for checkpoints of at most ``QUICK_MAX_WEIGHT_BYTES``
    of safetensors weights (the demo's model among them), ``quick`` / ``optimized`` force it;
    the flags go into ``$XLA_FLAGS`` for the command only, and options already there win."""
    from implicit_attn.cli import build_parser, wants_quick_compile
    from implicit_attn.compile_cache import (QUICK_MAX_WEIGHT_BYTES, QUICK_XLA_FLAGS, quick_compile, quick_flags,
                                             with_quick_flags)
    from implicit_attn.demo.induction import ASSET_DIR

    p = build_parser()
    assert wants_quick_compile(p.parse_args(["demo"]))
    assert not wants_quick_compile(p.parse_args(["--compile", "optimized", "demo"]))
    assert wants_quick_compile(p.parse_args(["info", str(ASSET_DIR)]))
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:
        f.truncate(QUICK_MAX_WEIGHT_BYTES + 1)  # sparse: its size is all that is read
    assert not wants_quick_compile(p.parse_args(["info", str(big)]))
    assert wants_quick_compile(p.parse_args(["--compile", "quick", "info", str(big)]))
    assert not wants_quick_compile(p.parse_args(["info", str(tmp_path / "missing")]))
    assert not wants_quick_compile(p.parse_args(["convert", str(big), str(tmp_path / "out")]))

    assert quick_flags() == QUICK_XLA_FLAGS  # the jaxlib here is one of the releases checked
    assert with_quick_flags("") == " ".join(QUICK_XLA_FLAGS)
    kept = with_quick_flags("--xla_backend_optimization_level=2 --foo=1").split()
    assert kept[:2] == ["--xla_backend_optimization_level=2", "--foo=1"] and len(kept) == len(QUICK_XLA_FLAGS) + 1
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    with quick_compile():
        assert os.environ["XLA_FLAGS"] == with_quick_flags("--foo=1")
    assert os.environ["XLA_FLAGS"] == "--foo=1"
    with quick_compile(False):
        assert os.environ["XLA_FLAGS"] == "--foo=1"
    monkeypatch.delenv("XLA_FLAGS")
    with pytest.raises(RuntimeError):
        with quick_compile():
            assert os.environ["XLA_FLAGS"] == " ".join(QUICK_XLA_FLAGS)
            raise RuntimeError
    assert "XLA_FLAGS" not in os.environ


def test_the_command_lines_compile_cache_is_kept_per_cpu(tmp_path, monkeypatch):
    """Programs go under the CPU's key, in the default directory and in one the environment
    names: XLA runs a cached program compiled for CPU features this CPU lacks."""
    monkeypatch.setenv("IMPLICIT_ATTN_CACHE", str(tmp_path / "root"))
    monkeypatch.delenv(ENV, raising=False)  # the tests turn it off
    key = cache.cpu_key()
    assert len(key) == 16 and int(key, 16) >= 0
    assert compile_cache_dir() == tmp_path / "root" / "jax" / key and compile_cache_dir().is_dir()
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine" / key
    monkeypatch.setattr(cache, "cpu_model", lambda: "AMD EPYC 7B13\nflags\t\t: fpu avx2 fma")
    other = cache.cpu_key()
    assert other != key and compile_cache_dir() == tmp_path / "mine" / other
    monkeypatch.setattr(cache.platform, "machine", lambda: "aarch64")
    assert cache.cpu_key() != other
    monkeypatch.setenv(ENV, "off")
    assert compile_cache_dir() is None


COUNT_COMPILES = """
import collections, sys
import jax.monitoring
counts = collections.Counter()
jax.monitoring.register_event_listener(
    lambda event, **kw: counts.update([event.rsplit("/", 1)[1]]) if event.startswith("/jax/compilation_cache/") else None)
from implicit_attn.cli import main
rc = main(sys.argv[1:])
print("COMPILES", rc, counts["compile_requests_use_cache"], counts["cache_hits"])
"""


@pytest.mark.deep
def test_second_cli_run_compiles_nothing(tmp_path):
    """The command line keeps compiled programs in JAX's persistent cache: run the same
    command twice in fresh processes; the second loads every program from the cache."""
    cfg = mamba.Config(vocab_size=20, hidden_size=8, state_size=4, num_hidden_layers=2)
    ia.save(mamba.LM(cfg, mamba.init_params(cfg, jax.random.PRNGKey(0))), tmp_path / "m")
    script = tmp_path / "count.py"
    script.write_text(COUNT_COMPILES)
    repo = str(Path(__file__).resolve().parents[1])

    def run(cache, *flags, xla_flags=os.environ.get("XLA_FLAGS", "")):
        env = {**os.environ, "IMPLICIT_ATTN_COMPILE_CACHE": str(cache), "XLA_FLAGS": xla_flags,
               "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
        p = subprocess.run([sys.executable, str(script), *flags, "operator", str(tmp_path / "m"), "--ids",
                            "1,2,3,4,5", "--out", str(tmp_path / "out")], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("COMPILES")]
        assert p.returncode == 0 and line, p.stdout + p.stderr
        rc, requests, hits = map(int, line[0].split()[1:])
        assert rc == 0
        return requests, hits

    cache = tmp_path / "cache"
    requests, hits = run(cache)
    assert requests > 0 and hits < requests and [p.name for p in cache.iterdir()] == [cpu_key()]
    assert any((cache / cpu_key()).iterdir())  # every program under this CPU's key
    assert run(cache) == (requests, requests)  # every program from the cache
    off = tmp_path / "off"
    assert run(off, "--no-compile-cache")[1] == 0 and not off.exists()
    assert run("0")[1] == 0 and not (tmp_path / "0").exists()
    # --compile: JAX's cache key holds $XLA_FLAGS, so a quick program is never loaded for an
    # optimized run or the other way round (the tests' own XLA_FLAGS are the quick ones: drop them)
    modes = tmp_path / "modes"
    requests, hits = run(modes, "--compile", "quick", xla_flags="")  # hits: programs asked for twice
    assert run(modes, "--compile", "optimized", xla_flags="") == (requests, hits)  # as in an empty cache
    assert run(modes, "--compile", "auto", xla_flags="") == (requests, requests)  # 1 KB of weights: quick


IMPORT_KEEPS_GC = """
import gc, weakref

class Node:
    pass

a = Node(); a.loop = a; made_before = weakref.ref(a); del a  # cyclic garbage older than the import
import importlib.util, sys
assert "IPython" not in sys.modules
import implicit_attn
assert gc.isenabled() and gc.get_freeze_count() == 0, (gc.isenabled(), gc.get_freeze_count())
gc.collect()
assert made_before() is None, "the import kept an object from the garbage collector"
# IPython stays unimported and importable, and flax's answer is the one IPython gives
assert "IPython" not in sys.modules, sys.modules.get("IPython", "no entry")
from flax.nnx import summary, visualization
assert summary.in_ipython is False and visualization.in_ipython is False
if importlib.util.find_spec("IPython") is not None:
    import IPython
    assert IPython.get_ipython() is None
print("GC OK")
"""


def test_the_import_pauses_the_garbage_collector_and_keeps_nothing_from_it():
    """``import implicit_attn`` pauses Python's cyclic collector and moves what exists to its
    oldest generation (a speed measure, implicit_attn/__init__.py): afterwards the collector
    is on, nothing is frozen, and garbage made before the import is still collected. It also
    keeps flax from importing IPython (another speed measure): IPython is not imported
    afterwards, can still be, and says what flax concluded (no notebook shell)."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", IMPORT_KEEPS_GC], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "GC OK" in p.stdout, p.stdout + p.stderr
