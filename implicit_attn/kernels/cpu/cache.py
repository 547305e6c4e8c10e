"""Building, caching and loading the fused CPU kernels' shared library, safely.

The library is compiled once per *key*: the kernel source, the compiler's identity (its
resolved path and ``--version`` output), the compiler command and flags, the CPU model and
feature flags (it is built with ``-march=native``) and any extra parts the caller adds (the
jax version). It is kept in ``cache_dir()`` as ``implicit_attn_cpu_<key>.so`` with a sidecar
``implicit_attn_cpu_<key>.json`` recording the size and SHA-256 of the file as it was built.
Both files are written atomically (a temporary file in the same directory, then
``os.replace``), so a reader sees a complete file or the previous one, never a partial one.

A cached library is used only if its bytes match the sidecar; any mismatch (a truncated
copy, a full disk, a stray or garbage file, a missing sidecar) rebuilds it. The bytes that
were checked are the bytes that get loaded: on Linux they are copied into an anonymous
memory file (``memfd``) and that is ``dlopen``-ed, so nothing can change or truncate the
library between the check and the load (a library truncated under its mapping kills the
process with SIGBUS); elsewhere a private temporary copy is loaded. No file that was not
verified is ever loaded. Processes that need the same library build it once: the build holds
an ``flock`` on ``implicit_attn_cpu_<key>.lock`` beside it, and a process that waited there finds
the build verified. A source may be compiled in parts side by side and linked
(``build_library(parts=...)``).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

# The memfds holding loaded libraries stay open for the life of the process: glibc
# recognises an already-loaded library by its path, so a reused ``/proc/self/fd/N`` would
# hand back the library loaded earlier under that number.
_LOADED_FDS: list[int] = []
_PREFIX = "implicit_attn_cpu_"


class CpuKernelUnavailable(RuntimeError):
    """The fused CPU kernel could not be built or loaded on this machine."""


def _user() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")


def _usable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _private_temp_dir(sub: str = "kernels") -> Path:
    """``<tempdir>/implicit_attn_<uid>/<sub>``, created if needed; the per-user directory
    must belong to this user and be writable by no one else (code is loaded from it)."""
    base = Path(tempfile.gettempdir()) / f"implicit_attn_{_user()}"
    base.mkdir(mode=0o700, exist_ok=True)
    if hasattr(os, "getuid"):
        st = base.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise CpuKernelUnavailable(
                f"the fallback kernel cache {base} belongs to another user or is writable by others "
                f"(mode {st.st_mode & 0o777:o}); refusing to load code from it. Remove it, or set "
                "IMPLICIT_ATTN_CACHE to a directory of your own")
    path = base / sub
    path.mkdir(parents=True, exist_ok=True)
    if not _usable(path):
        raise CpuKernelUnavailable(f"the fallback kernel cache {path} is not writable")
    return path


def cache_dir(sub: str = "kernels") -> Path:
    """Where compiled code is kept: ``$IMPLICIT_ATTN_CACHE/<sub>`` or
    ``~/.cache/implicit_attn/<sub>`` (``sub``: ``"kernels"`` for the CPU kernels, ``"jax"`` for
    JAX's persistent compilation cache); if that cannot be created or written, a per-user
    directory under the system temp dir (``<tempdir>/implicit_attn_<uid>/<sub>``, created
    private). Raises ``CpuKernelUnavailable`` naming both if neither is usable."""
    root = os.environ.get("IMPLICIT_ATTN_CACHE") or Path.home() / ".cache" / "implicit_attn"
    preferred = Path(root) / sub
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if _usable(preferred):
            return preferred
        why = "not writable"
    except OSError as e:
        why = f"{type(e).__name__}: {e}"
    try:
        return _private_temp_dir(sub)
    except OSError as e:
        raise CpuKernelUnavailable(
            f"no usable kernel cache: {preferred} ({why}), and the temp-dir fallback failed "
            f"({type(e).__name__}: {e}); set IMPLICIT_ATTN_CACHE to a writable directory") from e


@dataclasses.dataclass(frozen=True)
class Compiler:
    """A C++ compiler to build with.

    Attributes:
      command: the program (resolved to a path) and any arguments given in ``$CXX``.
      identity: the program's real path and its ``--version`` output; part of the cache key,
        so a different or upgraded compiler never reuses another one's build.
    """

    command: tuple[str, ...]
    identity: str


def _identify(command: list[str], origin: str) -> Compiler:
    try:
        p = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuKernelUnavailable(f"cannot run the C++ compiler {command[0]} ({origin}): {e}") from e
    if p.returncode != 0:
        raise CpuKernelUnavailable(f"the C++ compiler {command[0]} ({origin}) failed on --version "
                                   f"(exit {p.returncode}): {(p.stderr or p.stdout)[-1000:]}")
    return Compiler(tuple(command), os.path.realpath(command[0]) + "\n" + p.stdout + p.stderr)


def find_compiler() -> Compiler:
    """The compiler named by ``$CXX`` (a program and optional arguments, e.g. ``"ccache g++"``),
    else the first of ``c++``, ``g++``, ``clang++`` on ``PATH``.

    Raises ``CpuKernelUnavailable`` if ``$CXX`` is set but names no executable (it is never
    silently replaced by another compiler), if no compiler is found, or if it cannot run.
    """
    env = os.environ.get("CXX", "").strip()
    if env:
        try:
            words = shlex.split(env)
        except ValueError as e:
            raise CpuKernelUnavailable(f"CXX={env!r} cannot be parsed as a command: {e}") from e
        path = shutil.which(words[0])
        if path is None:
            raise CpuKernelUnavailable(
                f"CXX={env!r}: {words[0]!r} is not an executable file or a program on PATH; "
                "point CXX at a C++ compiler, or unset it to use c++/g++/clang++")
        return _identify([path, *words[1:]], f"from CXX={env!r}")
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return _identify([path], "found on PATH")
    raise CpuKernelUnavailable("no C++ compiler found (set CXX, or install g++)")


def cpu_model() -> str:
    """The CPU's model and feature flags, as ``/proc/cpuinfo`` gives them (elsewhere
    ``platform.processor()``): code built for this machine (``-march=native``) is kept under a
    key that holds them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    first = lambda key: next((x for x in lines if x.startswith(key)), "")
    return first("model name") + "\n" + first("flags")


def cpu_key() -> str:
    """16 hex digits naming this CPU: a hash of ``cpu_model()`` and the architecture. JAX's
    compilation caches keep their programs under it (``compile_cache.compile_cache_dir``): XLA
    loads a program compiled for another CPU with only a logged error, and the program may then
    use instructions this CPU lacks (SIGILL), as where one home directory serves several machines."""
    return hashlib.sha256(b"\0".join([cpu_model().encode(), platform.machine().encode()])).hexdigest()[:16]


def library_path(source: Path, flags: list[str], compiler: Compiler, extra: tuple[str, ...] = ()) -> Path:
    """Where the library built from ``source`` with ``compiler`` and ``flags`` is cached (it
    need not exist yet). ``extra``: further strings that must change the key (versions)."""
    key = hashlib.sha256(b"\0".join([
        Path(source).read_bytes(), compiler.identity.encode(), " ".join(compiler.command + tuple(flags)).encode(),
        cpu_model().encode(), platform.machine().encode(), *(x.encode() for x in extra)])).hexdigest()[:16]
    return cache_dir() / f"{_PREFIX}{key}.so"


def sidecar_path(lib: Path) -> Path:
    """The sidecar recording ``lib``'s size and SHA-256 (``<name>.json`` next to it)."""
    return lib.with_suffix(".json")


def _atomic_write(path: Path, data: bytes):
    """Write ``data`` to ``path`` through a temporary file in the same directory and
    ``os.replace``: readers see the old file or the complete new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644) if hasattr(os, "fchmod") else None  # mkstemp makes it 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def verified_bytes(lib: Path) -> bytes | None:
    """``lib``'s contents if they match its sidecar (size and SHA-256), else ``None``; warns
    when a cached library exists but does not match (it will be rebuilt)."""
    if not lib.exists():
        return None
    try:
        meta = json.loads(sidecar_path(lib).read_text())
        size, digest = int(meta["size"]), str(meta["sha256"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        why = f"its record {sidecar_path(lib).name} is missing or unreadable ({type(e).__name__})"
    else:
        try:
            data = lib.read_bytes()
        except OSError as e:
            why = f"it cannot be read ({e})"
        else:
            if len(data) == size and hashlib.sha256(data).hexdigest() == digest:
                return data
            why = (f"its size is {len(data)} bytes, {size} were recorded" if len(data) != size
                   else "its SHA-256 differs from the recorded one")
    warnings.warn(f"implicit_attn: the cached CPU kernel {lib} failed verification ({why}); rebuilding it",
                  stacklevel=4)
    return None


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Holds an exclusive ``flock`` on ``lock`` (created if needed) inside the block: processes
    that need the same library wait for one build instead of each compiling it. A no-op where
    ``fcntl`` is missing (Windows)."""
    if fcntl is None:
        yield
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _compile(cmds: list[list[str]]) -> None:
    """Run the compiler commands side by side, at most ``usable_cores()`` at once; raises
    ``CpuKernelUnavailable`` with the first failure's command and message."""
    pending, running, failed = list(cmds), [], None
    try:
        while (pending and failed is None) or running:
            while pending and failed is None and len(running) < usable_cores():
                cmd = pending.pop(0)
                running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                      text=True)))
            cmd, proc = running.pop(0)
            err = proc.communicate()[1]
            if proc.returncode != 0 and failed is None:
                failed = (cmd, err)
    except BaseException:  # a compiler that cannot start, an interrupt: leave no compile running
        for _, proc in running:
            proc.kill()
            proc.wait()
        raise
    if failed is not None:
        cmd, err = failed
        raise CpuKernelUnavailable(f"compiling {Path(cmd[-3]).name} failed ({' '.join(cmd)}):\n{err[-2000:]}")


def build_library(source: Path, flags: list[str], include_dirs: list[str], extra: tuple[str, ...] = (),
                  force: bool = False, parts: list[list[str]] | None = None) -> tuple[Path, bytes, bool]:
    """Compile ``source`` into the cache unless a verified build is there already.

    Args:
      source: the C++ file; flags: compiler flags (``-shared`` and friends);
      include_dirs: ``-I`` directories; extra: further key parts (see ``library_path``);
      force: rebuild even if a verified build exists (a build found to be broken);
      parts: macro names, one list per part: with two or more, ``source`` is compiled once per
        part with ``-D<name>`` for each of its names (side by side, ``usable_cores()`` at a
        time) and the objects are linked into the library; else it is compiled whole. The
        source must give the same library either way (the key does not include ``parts``).
    Returns:
      ``(path, data, fresh)``: the cached library, its verified bytes (load these, not the
      path), and whether it was compiled by this call. Processes building the same library
      take turns (a lock file beside it): the second finds the first one's build. A compile
      says so on stderr when it starts and when it is done (it takes seconds to a minute).
    Raises:
      CpuKernelUnavailable: no compiler, or compiling failed (with its message);
      OSError: the cache cannot be written.
    """
    compiler = find_compiler()
    lib = library_path(source, flags, compiler, extra)
    if not force:
        data = verified_bytes(lib)
        if data is not None:
            return lib, data, False
    with _exclusive(lib.with_suffix(".lock")):
        if not force and lib.exists():  # built by another process while this one waited
            data = verified_bytes(lib)
            if data is not None:
                return lib, data, False
        n = len(parts) if parts and len(parts) > 1 else 1
        side_by_side = f" ({n} parts side by side)" if n > 1 else ""
        print(f"implicit_attn: compiling {Path(source).name} for this machine, once per compiler, jax version "
              f"and CPU{side_by_side}...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=lib.parent, prefix=".build.") as tmp:
            out = Path(tmp) / lib.name
            includes = [a for d in include_dirs for a in ("-I", d)]
            if parts and len(parts) > 1:
                objects = [str(Path(tmp) / f"part{i}.o") for i in range(len(parts))]
                _compile([[*compiler.command, *flags, "-c", *(f"-D{m}" for m in names), *includes, str(source),
                           "-o", obj] for names, obj in zip(parts, objects)])
                link = [*compiler.command, *flags, *objects, "-o", str(out)]
                p = subprocess.run(link, capture_output=True, text=True)
                if p.returncode != 0:
                    raise CpuKernelUnavailable(f"linking {Path(source).name} failed ({' '.join(link)}):\n"
                                               f"{p.stderr[-2000:]}")
            else:
                _compile([[*compiler.command, *flags, *includes, str(source), "-o", str(out)]])
            data = out.read_bytes()
            if not data:
                raise CpuKernelUnavailable(f"the compiler ({' '.join(compiler.command)}) wrote an empty library")
            os.replace(out, lib)  # atomic: concurrent readers never see a partial library
        record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "compiler": compiler.identity}
        _atomic_write(sidecar_path(lib), json.dumps(record, indent=1).encode())
        print(f"implicit_attn: compiled in {time.perf_counter() - start:.1f} s, cached as {lib}", file=sys.stderr,
              flush=True)
    return lib, data, True


def load_library(data: bytes, name: str) -> ctypes.CDLL:
    """``dlopen`` a library from its verified bytes ``data`` (never from a path someone else
    may change): an anonymous memory file on Linux, else a private temporary copy. ``name``
    labels the memory file. Raises ``OSError`` if the bytes are not a loadable library."""
    if hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir():
        fd = os.memfd_create(name, getattr(os, "MFD_CLOEXEC", 0))
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(data)
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except BaseException:
            os.close(fd)
            raise
        _LOADED_FDS.append(fd)
        return lib
    with tempfile.TemporaryDirectory(prefix="implicit_attn_load_") as tmp:
        copy = Path(tmp) / name
        copy.write_bytes(data)
        return ctypes.CDLL(str(copy))  # the mapping outlives the deleted copy


def missing_symbols(lib: ctypes.CDLL, symbols: tuple[str, ...]) -> list[str]:
    """The names in ``symbols`` that ``lib`` does not export."""
    return [s for s in symbols if not hasattr(lib, s)]


__all__ = ["CpuKernelUnavailable", "Compiler", "cache_dir", "cpu_key", "cpu_model", "find_compiler", "library_path",
           "sidecar_path", "verified_bytes", "build_library", "usable_cores", "load_library", "missing_symbols"]
