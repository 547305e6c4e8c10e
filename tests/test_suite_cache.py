"""The suite's compilation cache (conftest.suite_compile_cache_dir): each worker keeps the programs
it compiles on disk, per CPU, and a later run loads them instead of compiling them again."""
import collections
import os
import secrets
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import conftest
from implicit_attn import compile_cache
from implicit_attn.kernels.cpu.cache import cpu_key


def test_the_cache_directory_follows_the_environment_and_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("IMPLICIT_ATTN_CACHE", str(tmp_path / "root"))  # nothing made in the user's cache
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv(conftest.TEST_CACHE_ENV, off)
        assert conftest.suite_compile_cache_dir() is None
    monkeypatch.setenv(conftest.TEST_CACHE_ENV, str(tmp_path / "mine"))
    key = cpu_key()
    assert conftest.suite_compile_cache_dir() == tmp_path / "mine" / key
    monkeypatch.delenv(conftest.TEST_CACHE_ENV)
    here = conftest.suite_compile_cache_dir()
    assert here == tmp_path / "root" / "jax_tests" / key and here.is_dir() and len(key) == 16
    monkeypatch.setattr(compile_cache, "cpu_key", lambda: "another-cpu")
    assert conftest.suite_compile_cache_dir() == tmp_path / "root" / "jax_tests" / "another-cpu"


def test_a_cache_past_its_size_keeps_the_programs_written_last(tmp_path):
    for i, size in enumerate([400, 300, 200, 100]):  # written in this order
        f = tmp_path / f"p{i}-cache"
        f.write_bytes(b"x" * size)
        os.utime(f, (1000 + i, 1000 + i))
    assert conftest.prune_cache(tmp_path, 1000) == 0  # 1000 bytes: at the limit, nothing goes
    assert conftest.prune_cache(tmp_path, 900) == 700  # past it: cut to at most half, oldest first
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p2-cache", "p3-cache"]


def test_a_program_compiled_again_is_loaded_from_the_cache():
    path = conftest.suite_compile_cache_dir()
    if path is None:
        pytest.skip(f"${conftest.TEST_CACHE_ENV} turns the suite's compilation cache off")
    assert Path(jax.config.jax_compilation_cache_dir) == path
    events = collections.Counter()

    def listen(event, **kwargs):
        events[event] += 1

    def timed(event, duration_secs, **kwargs):
        events[event] += 1

    jax.monitoring.register_event_listener(listen)
    jax.monitoring.register_event_duration_secs_listener(timed)
    try:
        c = float(secrets.randbelow(2**30))  # a program no run has compiled before
        x = jnp.arange(3.0)
        # a new function each time: JAX's in-memory caches miss, the program is the same
        compiled = lambda: jax.jit(lambda x: jnp.sin(x) * c).lower(x).compile()  # noqa: E731
        hits, misses = events["/jax/compilation_cache/cache_hits"], events["/jax/compilation_cache/cache_misses"]
        compiles = events["/jax/core/compile/backend_compile_duration"]
        first = compiled()
        assert (events["/jax/compilation_cache/cache_hits"], events["/jax/compilation_cache/cache_misses"]) == (
            hits, misses + 1)
        second = compiled()
        assert (events["/jax/compilation_cache/cache_hits"], events["/jax/compilation_cache/cache_misses"]) == (
            hits + 1, misses + 1)
        # the loaded program is timed as a compile too: conftest's memory-mapping guard counts it
        assert events["/jax/core/compile/backend_compile_duration"] == compiles + 2
        assert (first(x) == second(x)).all() and float(second(x)[1]) == pytest.approx(c * 0.8414709848)
    finally:
        jax.monitoring.unregister_event_listener(listen)
        jax.monitoring.unregister_event_duration_listener(timed)
