"""Wall time of the command line from a fresh process: ``implicit-attn explain`` on the
shipped model (``implicit_attn/demo/assets/induction``) with every cache empty, again
with the caches the first run filled (issue 23: "first explain on the shipped model under
5 s", "a second run of any CLI command compiles nothing"), with JAX's compilation
cache off, and with ``--compile optimized`` (XLA's default settings, where the default
``--compile auto`` compiles this small model quickly); plus ``import implicit_attn`` alone,
the floor under any command. Every case runs ``--repeat`` times (default 3) and reports the
median: the imports alternate with the first runs, which each start with fresh caches; the
second runs and the runs with the compile cache off each use the caches one first run filled.

Each run is ``python -m implicit_attn.cli ...`` in a subprocess whose ``$IMPLICIT_ATTN_CACHE``
is a fresh temporary directory (so the CPU-kernel library and the JAX cache start empty
and nothing of the user's cache is read); ``JAX_COMPILATION_CACHE_DIR`` and ``XLA_FLAGS``
are removed from its environment. The package is byte-compiled first, as ``pip install``
leaves it (an editable checkout under ``$PYTHONDONTWRITEBYTECODE`` would otherwise compile
its sources in every process: about 0.35 s of the import on a 2-core CPU).
``new_cache_files`` counts the files a run added to the JAX cache directory (0 on the
second run: it compiled nothing new), ``new_kernel_files`` those it added beside it (the
CPU-kernel library, built on first use).

``--baseline DIR`` times another checkout of the project (say ``git worktree add DIR
<commit>``) in the same run: its import and first ``explain`` (on its own copy of the model)
alternate with ours, run for run, so a machine whose speed drifts over minutes slows both
alike; the baseline rows give its medians and the ratio to ours. ``--quick`` (the smoke run of
``benchmarks.run --quick``): one run per case unless ``--repeat`` says otherwise, written as
``results/cli_startup_quick.{json,md}``.

    python -m benchmarks.cli_startup [--repeat 3] [--baseline DIR] [--quick]
"""
from __future__ import annotations

import argparse
import compileall
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_results

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "implicit_attn" / "demo" / "assets" / "induction"
EXPLAIN = ["explain", str(MODEL), "--text", "s3 s7 s1 s9 [key] s3", "--method", "attribution"]


def cache_files(d: Path) -> int:
    """How many files are under ``d`` (0 if it does not exist)."""
    return sum(1 for p in d.rglob("*") if p.is_file()) if d.exists() else 0


def timed_run(argv: list[str], cache: Path, compile_cache: str | None = None, root: Path = ROOT) -> dict:
    """Run ``python <argv>`` in a fresh process with ``$IMPLICIT_ATTN_CACHE=cache`` (and
    ``$IMPLICIT_ATTN_COMPILE_CACHE=compile_cache`` if given), importing the project at
    ``root``; wall seconds and the files it added to ``cache/jax`` and to the rest of
    ``cache``. ``RuntimeError`` with its stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "IMPLICIT_ATTN_COMPILE_CACHE", "XLA_FLAGS")}
    env.update(IMPLICIT_ATTN_CACHE=str(cache), PYTHONPATH=str(root) + os.pathsep + env.get("PYTHONPATH", ""))
    if compile_cache is not None:
        env["IMPLICIT_ATTN_COMPILE_CACHE"] = compile_cache
    jax_before, all_before = cache_files(cache / "jax"), cache_files(cache)
    with tempfile.TemporaryDirectory() as work:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=work,
                           timeout=600)
        seconds = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{argv} exited {p.returncode}:\n{p.stderr[-3000:]}")
    new_jax = cache_files(cache / "jax") - jax_before
    return {"seconds": seconds, "new_cache_files": new_jax, "new_kernel_files": cache_files(cache) - all_before - new_jax}


def median(runs: list[dict]) -> tuple[dict, str]:
    """The median of ``timed_run`` results and every run's seconds as text. A shared 2-core
    machine's timings vary by tens of percent from one run to the next."""
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2], ", ".join(f"{r['seconds']:.2f}" for r in runs)


def median_run(argv: list[str], caches: list[Path]) -> tuple[dict, str]:
    """``timed_run`` of ``argv`` once per cache directory (each fresh): ``median``."""
    return median([timed_run(argv, c) for c in caches])


def byte_compile(root: Path = ROOT) -> None:
    """Write the ``.pyc`` files of the packages under ``root`` (``compileall``), as
    ``pip install`` does."""
    for pkg in ("implicit_attn", "weights_convert"):
        if (root / pkg).is_dir() and not compileall.compile_dir(root / pkg, quiet=1):
            raise RuntimeError(f"byte-compiling {root / pkg} failed")


def explain_argv(root: Path = ROOT) -> list[str]:
    """``python`` arguments of the timed ``explain`` on the shipped model under ``root``."""
    model = root / "implicit_attn" / "demo" / "assets" / "induction"
    return ["-m", "implicit_attn.cli", *EXPLAIN[:1], str(model), *EXPLAIN[2:], "--out", "out"]


def main(quick: bool = False, repeat: int | None = None, baseline: Path | None = None) -> list[dict]:
    """The table's rows (module docstring); ``repeat`` runs per case (default 3, 1 when ``quick``)."""
    repeat = (1 if quick else 3) if repeat is None else repeat
    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeat}")
    if baseline is not None:
        baseline = Path(baseline).resolve()
        if not (baseline / "implicit_attn" / "cli.py").is_file():
            raise ValueError(f"--baseline {baseline}: not a checkout of this project (no implicit_attn/cli.py)")
        byte_compile(baseline)
    byte_compile()
    cli = ["-m", "implicit_attn.cli"]
    explain = explain_argv()
    optimized = [*cli, "--compile", "optimized", *EXPLAIN, "--out", "out"]
    shown = "implicit-attn " + " ".join(a if " " not in a else repr(a) for a in EXPLAIN).replace(str(ROOT) + "/", "")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        imports, runs, base_runs, base_imports = [], [], [], []
        for k in range(repeat):  # with a baseline: its runs alternate with ours
            imports.append(timed_run(["-c", "import implicit_attn"], Path(d) / f"imp{k}"))
            runs.append(timed_run(explain, Path(d) / f"cold{k}"))
            if baseline is not None:
                base_imports.append(timed_run(["-c", "import implicit_attn"], Path(d) / f"bimp{k}", root=baseline))
                base_runs.append(timed_run(explain_argv(baseline), Path(d) / f"base{k}", root=baseline))
        imp, imp_every = median(imports)
        rows.append({"case": f"python -c 'import implicit_attn' (median of {repeat})", "seconds": imp["seconds"],
                     "note": f"the floor under every command; runs: {imp_every} s"})
        cold, every = median(runs)
        rows.append({"case": f"{shown}: first run, empty caches (median of {repeat})", "seconds": cold["seconds"],
                     "new_cache_files": cold["new_cache_files"], "new_kernel_files": cold["new_kernel_files"],
                     "target": "< 5 s", "note": f"every XLA program compiled (--compile auto: quick for this "
                                                f"model), the CPU-kernel library built if used; runs: {every} s"})
        # second runs, each on the caches one first run filled: nothing compiles (0 new files in all)
        second_runs = [timed_run(explain, Path(d) / f"cold{k}") for k in range(repeat)]
        warm, warm_every = median(second_runs)
        rows.append({"case": f"the same: second run, caches from a first (median of {repeat})",
                     "seconds": warm["seconds"], "new_cache_files": sum(r["new_cache_files"] for r in second_runs),
                     "new_kernel_files": sum(r["new_kernel_files"] for r in second_runs),
                     "target": "0 new cache files",
                     "note": f"{warm['seconds'] / cold['seconds']:.2f}x the first run's time; new files summed "
                             f"over the runs; runs: {warm_every} s"})
        off, off_every = median([timed_run(explain, Path(d) / f"cold{k}", compile_cache="0") for k in range(repeat)])
        rows.append({"case": f"the same: IMPLICIT_ATTN_COMPILE_CACHE=0 (kernel library cached; median of {repeat})",
                     "seconds": off["seconds"], "new_cache_files": off["new_cache_files"],
                     "new_kernel_files": off["new_kernel_files"],
                     "note": f"every XLA program compiled again; runs: {off_every} s"})
        opt, opt_every = median_run(optimized, [Path(d) / f"opt{k}" for k in range(repeat)])
        rows.append({"case": f"the same with --compile optimized, empty caches (median of {repeat})",
                     "seconds": opt["seconds"], "new_cache_files": opt["new_cache_files"],
                     "new_kernel_files": opt["new_kernel_files"],
                     "note": f"XLA's default compile settings; runs: {opt_every} s"})
        if baseline is not None:
            b_cold, b_every = median(base_runs)
            b_imp, b_imp_every = median(base_imports)
            rows.append({"case": f"baseline {baseline}: python -c 'import implicit_attn' (median of {repeat})",
                         "seconds": b_imp["seconds"],
                         "note": f"{b_imp['seconds'] / imp['seconds']:.2f}x ours, its runs alternating with ours; "
                                 f"runs: {b_imp_every} s"})
            rows.append({"case": f"baseline {baseline}: the first explain, empty caches (median of {repeat})",
                         "seconds": b_cold["seconds"], "new_cache_files": b_cold["new_cache_files"],
                         "new_kernel_files": b_cold["new_kernel_files"],
                         "note": f"{b_cold['seconds'] / cold['seconds']:.2f}x ours, its runs alternating with "
                                 f"ours; runs: {b_every} s"})
    write_results("cli_startup_quick" if quick else "cli_startup", rows,
                  columns=["case", "seconds", "new_cache_files", "new_kernel_files", "target", "note"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs per case (median reported; default 3, 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one run per case, written as cli_startup_quick")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout of the project, timed in the same run (import, first explain)")
    a = ap.parse_args()
    main(quick=a.quick, repeat=a.repeat, baseline=a.baseline)
