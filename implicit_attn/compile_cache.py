"""How implicit_attn's programs get compiled: JAX's persistent compilation cache (compiled
programs kept on disk, so a second run of the same command, with the same model shapes, jax
and jaxlib and machine, loads them instead of compiling again), and XLA's quick-compile
settings for small models (``quick_compile``).

The command line turns it on by default; Python code opts in with ``enable_compile_cache()``.
Where: ``$IMPLICIT_ATTN_CACHE/jax/<CPU key>`` (default ``~/.cache/implicit_attn/jax/<CPU key>``;
a private per-user temp directory if that is not writable). ``IMPLICIT_ATTN_COMPILE_CACHE=0``
(or ``off``, ``false``, ``no``) turns it off for the command line, as does ``implicit-attn
--no-compile-cache``; any other value is taken as the directory to use (its ``<CPU key>``
subdirectory). The CPU key (``kernels.cpu.cache.cpu_key``) keeps one machine's programs from
another CPU: XLA loads a program compiled for other CPU features with only a logged error.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import os
import warnings
from pathlib import Path

import jax

from .kernels.cpu import CpuKernelUnavailable, cache_dir
from .kernels.cpu.cache import cpu_key

ENV = "IMPLICIT_ATTN_COMPILE_CACHE"
OFF = ("0", "off", "false", "no")


def compile_cache_dir(env: str = ENV, sub: str = "jax") -> Path | None:
    """The directory the command line would cache compiled programs in, or ``None`` when
    ``$IMPLICIT_ATTN_COMPILE_CACHE`` turns the cache off: ``<root>/<cpu_key()>``, the root
    being the variable's directory if it names one, else ``cache_dir(sub)``. Creates it.

    Programs compiled on one CPU are never offered to another, even where machines share the
    root (a home directory on a cluster's network file system): JAX's cache key may not tell
    their CPU features apart, and XLA runs a program built for features the CPU lacks.
    ``env`` and ``sub`` name another switch and default root (the tests use theirs,
    ``jax_tests``): the variable's value 0, off, false or no turns it off."""
    raw = os.environ.get(env, "").strip()
    if raw.lower() in OFF:
        return None
    path = (Path(os.path.expanduser(raw)) if raw else cache_dir(sub)) / cpu_key()
    path.mkdir(parents=True, exist_ok=True)
    return path


def enable_compile_cache(path=None) -> Path | None:
    """Keep every program JAX compiles from now on in ``path`` (default ``compile_cache_dir()``,
    which is per CPU; a ``path`` given is used as it is) and load it from there next time.
    Every program is cached, however quick its compile (JAX's default skips those under a
    second, which on our models is most of them).
    Returns the directory, or ``None`` (cache off) when ``path`` is ``None`` and the
    environment turns it off, or when no cache directory can be made (a warning says why)."""
    try:
        path = compile_cache_dir() if path is None else Path(path)
    except (OSError, CpuKernelUnavailable) as e:
        warnings.warn(f"implicit_attn: running without a compilation cache: {e}", stacklevel=2)
        return None
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


# XLA:CPU options that trade machine-code speed for compile speed: LLVM's cheap optimisation
# level, XLA's older CPU fusion emitters (the MLIR ones compile a tiny model about 3x slower),
# one codegen piece (splitting only adds work on a small program). Same HLO, so the same
# operations; the machine code runs slower (a 91M-parameter Mamba's forward at L = 512 took
# 1.9 s instead of 0.9-1.5 s), which is why only small models get them.
QUICK_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                   "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
# Checkpoints with at most this many bytes of weights compile quickly under the command
# line's --compile auto: compiling dominates their commands (the shipped model: 80 KB).
QUICK_MAX_WEIGHT_BYTES = 64 * 2 ** 20


# XLA ends the process at an option in $XLA_FLAGS it does not know, and its option names change
# between releases. The jaxlib releases whose XLA was run with every QUICK_XLA_FLAGS option and
# accepted it (0.6.0, 0.7.0, 0.8.0, 0.9.0 and 0.10.2, on 2026-12-01), as [first, past) version
# prefixes. On jax 0.11.2 (an H200 machine) test workers started with them died at start (and ran
# with them left out), and XLA's CPU backend has since retired the emitters that
# --xla_cpu_use_fusion_emitters chooses.
QUICK_FLAGS_JAXLIB = ((0, 6), (0, 11))


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def quick_flags(jaxlib_version: str | None = None) -> tuple[str, ...]:
    """``QUICK_XLA_FLAGS`` where the installed jaxlib (or ``jaxlib_version``) is among the
    releases known to accept them (``QUICK_FLAGS_JAXLIB``), else ``()``: elsewhere compiling
    quickly is skipped, never risked (an unknown option would end the process)."""
    if jaxlib_version is None:
        try:
            jaxlib_version = importlib.metadata.version("jaxlib")
        except importlib.metadata.PackageNotFoundError:
            return ()
    first, past = QUICK_FLAGS_JAXLIB
    return QUICK_XLA_FLAGS if first <= _release(jaxlib_version)[:2] < past else ()


def with_quick_flags(xla_flags: str) -> str:
    """``xla_flags`` (an ``$XLA_FLAGS`` value) with every ``quick_flags()`` option it does
    not already set appended; options it sets keep their values."""
    given = xla_flags.split()
    named = {f.split("=", 1)[0] for f in given}
    return " ".join(given + [f for f in quick_flags() if f.split("=", 1)[0] not in named])


@contextlib.contextmanager
def quick_compile(enabled: bool = True):
    """Inside the block, ``$XLA_FLAGS`` carries ``QUICK_XLA_FLAGS`` (``with_quick_flags``);
    it is restored on leaving. XLA reads its flags once per process, when JAX's CPU backend
    starts, so this acts only where the backend starts inside the block, as in a fresh
    command-line process; elsewhere nothing changes. ``enabled=False``: a no-op."""
    old = os.environ.get("XLA_FLAGS")
    if enabled:
        os.environ["XLA_FLAGS"] = with_quick_flags(old or "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = old


__all__ = ["ENV", "QUICK_FLAGS_JAXLIB", "QUICK_MAX_WEIGHT_BYTES", "QUICK_XLA_FLAGS", "compile_cache_dir", "enable_compile_cache",
           "quick_compile", "quick_flags", "with_quick_flags"]
