"""The fused CPU kernel's build cache: a cached library is verified (size and SHA-256
recorded at build time) before it is loaded and rebuilt on any mismatch; a library without
the kernel's symbols is a bad build (XLA under ``impl="auto"``, a clear error under
``impl="cpu"``); the compiler's identity is part of the cache key and a ``$CXX`` that does
not exist is never replaced by another compiler; an unusable cache dir falls back to a
private temp dir; a bad ``$IMPLICIT_ATTN_CPU_THREADS`` is named.

The real kernel is compiled once per session (or found in the package's cache). Rebuilds
use a stand-in compiler that copies that library to its ``-o`` argument and logs each
build, so no test waits for a second compile. Cases that load a damaged library run in a
fresh interpreter, so a crash there fails the test instead of killing pytest.
"""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from implicit_attn.families import mamba
from implicit_attn.kernels import cpu
from implicit_attn.kernels.cpu import cache
from implicit_attn.operator import StateDecayCore
from implicit_attn.operator.dispatch import clear_failed_kernels, failed_kernels

HERE = Path(__file__).resolve().parent


def small_op(L):
    """A Mamba-1 mixer operator on random weights (batch 2, 4 channels, state size 4)."""
    cfg = mamba.Config(vocab_size=8, hidden_size=4, state_size=4, num_hidden_layers=1, conv_kernel=4)
    p = mamba.init_params(cfg, jax.random.PRNGKey(1))["layers"][0]["mixer"]
    h = jax.random.normal(jax.random.PRNGKey(2), (2, L, 4))
    return mamba.block.mixer_operator_jit(p, h, cfg=cfg)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def have_compiler() -> bool:
    cxx = os.environ.get("CXX", "").split()
    return any(shutil.which(c) for c in ([cxx[0]] if cxx else []) + ["c++", "g++", "clang++"])


@pytest.fixture(scope="session")
def libs(tmp_path_factory):
    """``(good, no_symbols)``: copies of the real kernel library (built here, or found in the
    package's cache) and of a valid shared library without the kernel's symbols."""
    if not have_compiler():
        pytest.skip("no C++ compiler: the fused CPU kernel cannot be built here")
    cpu.load()
    d = tmp_path_factory.mktemp("libs")
    good = d / "good.so"
    good.write_bytes(cache.verified_bytes(cpu.library_path()))
    src = d / "empty.cc"
    src.write_text("int implicit_attn_not_a_kernel;\n")
    empty = d / "no_symbols.so"
    subprocess.run([*cache.find_compiler().command, "-shared", "-fPIC", str(src), "-o", str(empty)], check=True)
    return good, empty


def fake_compiler(path: Path, payload: Path, version: str = "fakecc 1.0", seconds: float = 0.0) -> Path:
    """An executable at ``path`` that answers ``--version`` with ``version`` and otherwise
    waits ``seconds`` and copies ``payload`` to its ``-o`` argument, appending a line to
    ``$FAKECC_LOG``: ``build`` where it makes the library, ``object <-D names>`` where it
    compiles a part of it (``-c``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, shutil, sys, time
        args = sys.argv[1:]
        if args == ["--version"]:
            print({version!r})
            sys.exit(0)
        time.sleep({seconds!r})
        with open(os.environ["FAKECC_LOG"], "a") as f:
            if "-c" in args:
                f.write("object " + " ".join(a[2:] for a in args if a.startswith("-D")) + "\\n")
            else:
                f.write("build\\n")
        shutil.copyfile({str(payload)!r}, args[args.index("-o") + 1])
    """))
    path.chmod(0o755)
    return path


def run_child(tmp_path, body, env):
    """Run ``body`` in a fresh interpreter (the kernel is loaded once per process) with
    ``env`` replacing the variables it names (``None`` removes one); fails with its output
    unless it exits 0 after reaching its end."""
    full = dict(os.environ)
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = str(v)
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]
        import warnings
        import pytest
        from implicit_attn.kernels import cpu
        from implicit_attn.operator import resolve_impl
        from test_kernel_cache import rel, small_op
    """) + textwrap.dedent(body) + "\nprint('CHILD OK')\n")
    p = subprocess.run([sys.executable, str(script)], env=full, capture_output=True, text=True,
                       cwd=str(tmp_path), timeout=300)
    assert p.returncode == 0 and "CHILD OK" in p.stdout, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture
def stand_in(libs, tmp_path, monkeypatch):
    """This test's cache (``tmp_path/cache``) and a stand-in compiler that copies the real
    library (``$CXX``), logging builds to ``tmp_path/log``; returns the log's path."""
    monkeypatch.setenv("IMPLICIT_ATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path / "bin" / "fakecc", libs[0])))
    monkeypatch.setenv("FAKECC_LOG", str(tmp_path / "log"))
    return tmp_path / "log"


def builds(log: Path) -> int:
    return log.read_text().count("build") if log.exists() else 0


def objects(log: Path) -> list[set[str]]:
    """The ``-D`` names of each part the stand-in compiled (``-c``), in the order it did."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [set(line.split()[1:]) for line in lines if line.startswith("object")]


def test_a_truncated_cached_library_is_rebuilt_not_loaded(libs, stand_in, tmp_path):
    """Half of the cached library (an interrupted copy, a full disk): loading it killed the
    interpreter with SIGBUS, in every later process too. A fresh process now checks it
    against the size and SHA-256 recorded at build time, rebuilds it, and the kernel runs."""
    lib = cpu.build()
    assert builds(stand_in) == 1
    data = libs[0].read_bytes()
    lib.write_bytes(data[:len(data) // 2])
    run_child(tmp_path, """
        op = small_op(6)
        assert rel(op.materialize(impl="cpu"), op.materialize(impl="xla")) <= 1e-5
    """, {})
    assert builds(stand_in) == 2
    assert lib.read_bytes() == data and cache.verified_bytes(lib) == data
    record = json.loads(cache.sidecar_path(lib).read_text())
    assert record["size"] == len(data) and "fakecc 1.0" in record["compiler"]
    # both files were replaced atomically: no temporary files are left behind (the lock file stays)
    assert sorted(p.name for p in lib.parent.iterdir()) == sorted([lib.name, cache.sidecar_path(lib).name,
                                                                   lib.with_suffix(".lock").name])


@pytest.mark.parametrize("damage", ["garbage", "no_symbols", "no_record", "bad_record"])
def test_a_cached_library_that_fails_verification_is_rebuilt(damage, libs, stand_in):
    """A garbage file (fell back to XLA but was never rebuilt, before), a valid ELF without
    the kernel's symbols (``AttributeError`` under ``impl="auto"``, before), a library
    without its record or with an unreadable one: each is rebuilt, never loaded."""
    lib = cpu.build()
    data = libs[0].read_bytes()
    if damage == "garbage":
        lib.write_bytes(b"not a library\n")
    elif damage == "no_symbols":
        lib.write_bytes(libs[1].read_bytes())
    elif damage == "no_record":
        cache.sidecar_path(lib).unlink()
    else:
        cache.sidecar_path(lib).write_text("{")
    with pytest.warns(UserWarning, match="failed verification.*rebuilding"):
        assert cpu.build() == lib
    assert builds(stand_in) == 2 and cache.verified_bytes(lib) == data
    cpu.build()
    assert builds(stand_in) == 2  # verified: not built again


def cpu_raises_auto_falls_back(why: str) -> str:
    """A child body: ``impl="cpu"`` raises ``CpuKernelUnavailable`` matching ``why``;
    ``impl="auto"`` warns once, naming it, and gives XLA's result."""
    return f"""
        # the mixer's forward asks for the scan kernel first: the one warning comes there
        with pytest.warns(UserWarning, match="fused CPU kernel unavailable.*" + {why!r}):
            op = small_op(6)
        with pytest.raises(cpu.CpuKernelUnavailable, match={why!r}):
            op.materialize(impl="cpu")
        assert resolve_impl("auto", op.core) == "xla"
        assert rel(op.materialize(impl="auto"), op.materialize(impl="xla")) == 0
    """


def test_a_build_without_the_kernel_symbols_is_a_bad_build(libs, tmp_path):
    """A compiler that produces a library lacking the kernel's symbols: ``impl="cpu"`` raises
    ``CpuKernelUnavailable`` naming them, ``impl="auto"`` warns once and uses XLA (before:
    ``AttributeError: undefined symbol`` from both)."""
    cxx = fake_compiler(tmp_path / "bin" / "fakecc", libs[1])
    run_child(tmp_path, cpu_raises_auto_falls_back("lacks the symbol.*IaStateDecayDense"), dict(IMPLICIT_ATTN_CACHE=tmp_path / "cache", CXX=cxx, FAKECC_LOG=tmp_path / "log"))


def test_a_cxx_that_does_not_exist_is_never_replaced(libs, tmp_path, monkeypatch):
    """``CXX=/nonexistent/c++`` with another compiler's build in the cache: before, that build
    was used silently. Now ``impl="cpu"`` raises naming ``CXX`` and ``"auto"`` warns and uses
    XLA; the cache is the package's own, which holds the real build."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(cpu.CpuKernelUnavailable, match=r"CXX='/nonexistent/c\+\+'.*not an executable"):
        cpu.library_path()
    run_child(tmp_path, cpu_raises_auto_falls_back("CXX='/nonexistent/c[+][+]'"), dict(CXX="/nonexistent/c++"))


def test_the_compiler_identity_is_part_of_the_cache_key(libs, tmp_path, monkeypatch):
    """Another compiler path, or the same path answering another ``--version``, is another
    cache entry (a different or upgraded compiler never reuses an old build)."""
    monkeypatch.setenv("IMPLICIT_ATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKECC_LOG", str(tmp_path / "log"))
    a = fake_compiler(tmp_path / "a" / "c++", libs[0], "fakecc 1.0")
    b = fake_compiler(tmp_path / "b" / "c++", libs[0], "fakecc 1.0")
    paths = []
    for cxx, version in [(a, None), (b, None), (a, "fakecc 2.0")]:
        if version:
            fake_compiler(cxx, libs[0], version)
        monkeypatch.setenv("CXX", str(cxx))
        paths.append(cpu.library_path())
    assert len(set(paths)) == 3, paths
    assert cpu.build() == paths[2] and cpu.build() == paths[2]
    assert (tmp_path / "log").read_text().count("build") == 1  # the second call found it verified


def test_the_handlers_split_into_parts_that_cover_the_source_once():
    """Every handler of ``state_decay.cc`` is guarded by its own ``IA_<symbol>`` and falls in
    exactly one part, whatever the number of cores; parts stay within 1.5x of each other in
    handlers."""
    source = (Path(cpu.__file__).with_name("state_decay.cc")).read_text()
    handlers = re.findall(r"#if !IA_PARTIAL \|\| IA_(\w+)\nXLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+),", source)
    assert handlers and all(a == b for a, b in handlers)
    assert len(handlers) == source.count("XLA_FFI_DEFINE_HANDLER_SYMBOL(")
    every = {f"IA_{name}" for name, _ in handlers}
    assert cpu.build_parts(0) == cpu.build_parts(1) == []
    for n in range(2, 12):
        parts = cpu.build_parts(n)
        assert len(parts) == min(n, cpu.MAX_BUILD_PARTS)
        assert all(p[0] == "IA_PARTIAL" for p in parts)
        names = [name for p in parts for name in p[1:]]
        assert sorted(names) == sorted(every), n
        sizes = [len(p) - 1 for p in parts]
        assert max(sizes) <= 1.5 * min(sizes), sizes


def test_a_build_in_parts_compiles_them_side_by_side_then_links(libs, stand_in, monkeypatch, capsys):
    """With 3 cores the source is compiled 3 times (``-c``, one part's macros each) and the
    objects are linked into the one library; with 1 core it is compiled whole. A compile
    says so on stderr, start and end; a cached library is loaded silently."""
    monkeypatch.setattr(cache, "usable_cores", lambda: 3)
    lib = cpu.build()
    assert builds(stand_in) == 1 and cache.verified_bytes(lib) == libs[0].read_bytes()
    assert sorted(map(sorted, objects(stand_in))) == sorted(map(sorted, map(set, cpu.build_parts(3))))
    err = capsys.readouterr().err
    assert "compiling state_decay.cc" in err and "(3 parts side by side)" in err and f"cached as {lib}" in err
    assert cpu.build() == lib and capsys.readouterr().err == ""
    stand_in.unlink()
    lib.unlink()
    monkeypatch.setattr(cache, "usable_cores", lambda: 1)
    assert cpu.build() == lib and builds(stand_in) == 1 and objects(stand_in) == []
    err = capsys.readouterr().err
    assert "compiling state_decay.cc" in err and "side by side" not in err


def test_processes_needing_one_library_build_it_once(libs, stand_in, tmp_path):
    """Two processes that start together on an empty cache: one builds (a stand-in taking 1 s
    a call), the other waits on the lock beside the library and loads that build; before,
    each compiled the whole library (two test workers: 30 s of both cores)."""
    script = tmp_path / "build.py"
    script.write_text("from implicit_attn.kernels import cpu\nprint(cpu.build())\n")
    slow = fake_compiler(tmp_path / "slow" / "c++", libs[0], seconds=1.0)
    env = {**os.environ, "CXX": str(slow)}
    children = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    paths = {child.communicate(timeout=300)[0].strip() for child in children}
    assert all(child.returncode == 0 for child in children)
    assert len(paths) == 1 and builds(stand_in) == 1
    assert cache.verified_bytes(Path(paths.pop())) == libs[0].read_bytes()


def test_an_unusable_cache_dir_falls_back_to_a_private_temp_dir(libs, tmp_path, monkeypatch):
    """``$IMPLICIT_ATTN_CACHE`` under a regular file cannot be created: the documented
    fallback ``<tempdir>/implicit_attn_<uid>/kernels`` is created (before: never created, so
    the build failed with "No such file or directory") and the kernel builds there. A
    fallback dir writable by others is refused, naming it."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("IMPLICIT_ATTN_CACHE", str(blocker / "cache"))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path / "bin" / "fakecc", libs[0])))
    monkeypatch.setenv("FAKECC_LOG", str(tmp_path / "log"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    base = tmp_path / "tmp" / f"implicit_attn_{os.getuid()}"
    assert cpu.cache_dir() == base / "kernels" and (base / "kernels").is_dir()
    assert stat.S_IMODE(base.stat().st_mode) & 0o077 == 0
    lib = cpu.build()
    assert lib.parent == base / "kernels" and cache.verified_bytes(lib) == libs[0].read_bytes()
    base.chmod(0o777)
    with pytest.raises(cpu.CpuKernelUnavailable, match="writable by others"):
        cpu.cache_dir()


def test_a_bad_thread_count_is_named(libs, monkeypatch):
    """``IMPLICIT_ATTN_CPU_THREADS=abc``: ``impl="cpu"`` raises naming the variable,
    ``impl="auto"`` warns naming it and still runs the kernel on the usable cores (before:
    a bare ``int()`` error, and auto dropped the kernel)."""
    clear_failed_kernels()
    op = small_op(9)  # a length no other test compiles in this process: the call is traced here
    want = op.materialize(impl="xla")
    for bad in ("abc", "0", "-2"):
        monkeypatch.setenv("IMPLICIT_ATTN_CPU_THREADS", bad)
        with pytest.raises(ValueError, match=f"IMPLICIT_ATTN_CPU_THREADS='{bad}' is not a positive integer"):
            op.materialize(impl="cpu")
    monkeypatch.setenv("IMPLICIT_ATTN_CPU_THREADS", "four")
    with pytest.warns(UserWarning, match="IMPLICIT_ATTN_CPU_THREADS='four'.*usable cores"):
        got = op.materialize(impl="auto")
    assert rel(got, want) <= 1e-5
    assert ("cpu", StateDecayCore) not in failed_kernels()
    monkeypatch.setenv("IMPLICIT_ATTN_CPU_THREADS", " 3 ")
    assert cpu.num_threads(strict=True) == 3


def test_the_target_arch_is_part_of_the_cache_key_and_checked(monkeypatch):
    """``$IMPLICIT_ATTN_CPU_ARCH`` replaces ``-march=native`` (another build, another cache
    entry); a value that is not a target name is refused, naming the variable."""
    native = cpu.library_path()
    monkeypatch.setenv("IMPLICIT_ATTN_CPU_ARCH", "haswell")
    assert "-march=haswell" in cpu.compile_flags() and "-march=native" not in cpu.compile_flags()
    assert cpu.library_path() != native
    for bad in ("haswell -O0", "$(id)", "-mavx"):
        monkeypatch.setenv("IMPLICIT_ATTN_CPU_ARCH", bad)
        with pytest.raises(ValueError, match="IMPLICIT_ATTN_CPU_ARCH"):
            cpu.compile_flags()


@pytest.mark.deep
@pytest.mark.parametrize("arch, vector_registers, absent", [("haswell", "ymm", "zmm"), ("x86-64", "xmm", "ymm")])
def test_a_build_for_an_older_cpu_gives_the_same_numbers(tmp_path, arch, vector_registers, absent):
    """The kernel built for an AVX2 CPU without AVX-512 (``-march=haswell``) and for any x86-64
    (SSE2 only), in a fresh process with its own cache: the same operator as the XLA path, and the
    grouped products, the attention kernel, LaS attention and the Gated DeltaNet mixer the same
    numbers as float64; the attention kernels' streaming stores the same bits as plain ones."""
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        from test_kernel_cache import small_op, rel
        from implicit_attn.kernels import cpu
        assert "-march={arch}" in cpu.compile_flags()
        for L in (5, 37):
            op = small_op(L)
            err = rel(op.materialize(impl="cpu"), op.materialize(impl="xla"))
            assert err <= 1e-5, (L, err)
        import numpy as np
        from test_moe import from_tokens64, grouped_case, half_pack_case, to_tokens64
        for K, R, case in ((70, 19, grouped_case), (48, 40, grouped_case), (33, 20, half_pack_case)):
            x, h, col, weights, owner, w = case(K, R, 1)  # the grouped products' AVX2 paths, half packs
            want = from_tokens64(x, np.asarray(col), np.asarray(owner), w)
            got = np.asarray(cpu.grouped_matmul_from_tokens(x, col, owner, w))
            assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), (K, R)
            want = to_tokens64(h, np.asarray(col), weights, np.asarray(owner), w)
            got = np.asarray(cpu.grouped_matmul_to_tokens(h, col, weights, owner, w))
            assert np.abs(got - want).max() <= 4e-6 * np.abs(want).max(), (K, R)
        from test_attention_kernel import case
        from test_ops import attention64
        q, k, v, seg = case(2, 4, 2, 37, 8, 12)  # the attention kernel: a short last chunk, values off vectors
        got = np.asarray(cpu.attention_forward(q, k, v, seg, 20))
        assert np.abs(got - attention64(q, k, v, seg, 20)).max() <= 1e-5
        import jax
        from kernel_cores import delta_op, mamba2_op
        from implicit_attn.registry import family
        spec = family("recurrent_gemma")  # an RG-LRU layer without documents: the banded reduce
        cfg = spec.config.from_hf(dict(spec.tiny))
        mixer = spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(0))).layers[0].mixer
        rglru = mixer.as_operator(np.random.default_rng(1).normal(size=(1, 70, cfg.hidden_size)).astype(np.float32))
        for op in (rglru, mamba2_op(70), delta_op(70)):  # reduces: 6-, 6- and 4-row products
            err = rel(op.reduce("mean", impl="cpu"), op.reduce("mean", impl="xla"))
            assert err <= 1e-5, (type(op.core).__name__, err)
        from test_cpu_head_kernel import attention_core, softmax64
        att_core = attention_core(70, window=40)  # local attention's materialize: 6-, 6- and 4-row products
        att = np.asarray(cpu.cpu_dense(att_core, np.arange(4)))
        assert np.abs(att - softmax64(att_core)).max() <= 1e-5
        from test_las import random_core, ref_core
        core = random_core(37, alibi=True, pool=5, chunk=7, align="centered")  # LaS: vw distance terms, pooling
        got, want = np.asarray(cpu.cpu_dense(core, np.arange(3))), ref_core(core)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        cpu.STREAM_BYTES = 0  # streaming stores (rows of 37 and 70 floats: not 64-byte aligned)
        assert np.array_equal(np.asarray(cpu.cpu_dense(core, np.arange(3))), got)
        assert np.array_equal(np.asarray(cpu.cpu_dense(att_core, np.arange(4))), att)
        cpu.STREAM_BYTES = 4 << 20
        from test_delta_net_kernel import mixer64, operands
        # the DeltaNet mixer: AVX2's reciprocal, dv off vectors; dv = 40, five vectors of 8: two blocks
        for shape in ((2, 37, 2, 4, 8, 12, 4, True, True), (1, 21, 1, 2, 7, 40, 3, False, False)):
            args = operands(*shape)
            got = np.asarray(cpu.gated_delta_net(*args))
            assert np.abs(got - mixer64(*args)).max() <= 5e-5 * np.abs(got).max(), shape
        print("ok", cpu.build())
    """)
    env = dict(os.environ, IMPLICIT_ATTN_CPU_ARCH=arch, IMPLICIT_ATTN_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    objdump = shutil.which("objdump")
    if objdump:  # no wider register in the machine code than the target has (the native build has zmm)
        lib = done.stdout.split()[-1]
        asm = subprocess.run([objdump, "-d", lib], capture_output=True, text=True, check=True).stdout
        assert vector_registers in asm and absent not in asm
