"""JAX's persistent compilation cache for implicit_attn: compiled programs kept on disk, so a
second run of the same command (same model shapes, same jax and jaxlib, same machine) loads
them instead of compiling again.

The command line turns it on by default; Python code opts in with ``enable_compile_cache()``.
Where: ``$IMPLICIT_ATTN_CACHE/jax`` (default ``~/.cache/implicit_attn/jax``; a private per-user
temp directory if that is not writable). ``IMPLICIT_ATTN_COMPILE_CACHE=0`` (or ``off``,
``false``, ``no``) turns it off for the command line, as does ``implicit-attn
--no-compile-cache``; any other value is taken as the directory to use.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

from .kernels.cpu import CpuKernelUnavailable, cache_dir

ENV = "IMPLICIT_ATTN_COMPILE_CACHE"
OFF = ("0", "off", "false", "no")


def compile_cache_dir() -> Path | None:
    """The directory the command line would cache compiled programs in, or ``None`` when
    ``$IMPLICIT_ATTN_COMPILE_CACHE`` turns the cache off. Creates the directory."""
    raw = os.environ.get(ENV, "").strip()
    if raw.lower() in OFF:
        return None
    if raw:
        path = Path(os.path.expanduser(raw))
        path.mkdir(parents=True, exist_ok=True)
        return path
    return cache_dir("jax")


def enable_compile_cache(path=None) -> Path | None:
    """Keep every program JAX compiles from now on in ``path`` (default ``compile_cache_dir()``)
    and load it from there next time. Every program is cached, however quick its compile
    (JAX's default skips those under a second, which on our models is most of them).
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


__all__ = ["ENV", "compile_cache_dir", "enable_compile_cache"]
