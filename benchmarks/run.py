"""Run every benchmark and write one summary.

    python -m benchmarks.run [--quick] [--only mamba,griffin]
    python -m benchmarks.run --device gpu [--quick]     # the GPU suite (benchmarks/gpu.py)
    python -m benchmarks.run --summary-only             # rewrite SUMMARY.md from the tables

Each family's module writes ``benchmarks/results/<name>.json`` and ``.md``; this entry
point runs them in turn and concatenates every suite's latest tables (those it ran and,
with ``--only``, the others as they were last written; each names its machine and date) into
``results/SUMMARY.md``. ``--device gpu`` runs ``benchmarks.gpu`` (Pallas vs XLA, forward vs HF
torch on the GPU) and writes ``results/SUMMARY_gpu.md``.
"""
from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

from benchmarks.common import RESULTS, machine

SUITES = ["forward", "experts", "cli_startup", "gradients", "suite", "cores", "apply", "mamba", "mamba2", "griffin",
          "rwkv", "delta_rule", "rwkv_official"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run, minutes)")
    ap.add_argument("--only", default=",".join(SUITES), help="comma-separated subset of " + ",".join(SUITES))
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                    help="gpu: run the GPU suite (needs JAX on a GPU) instead of the CPU suites")
    ap.add_argument("--summary-only", action="store_true",
                    help="run nothing: rewrite the summary from the tables in benchmarks/results")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    if args.device == "gpu":
        chosen = ["gpu"]
    unknown = sorted(set(chosen) - set(SUITES) - {"gpu"})
    if unknown:
        ap.error(f"unknown suites {unknown}; choose from {SUITES}")
    for name in [] if args.summary_only else chosen:
        t = time.perf_counter()
        print(f"== {name} ==", flush=True)
        importlib.import_module(f"benchmarks.{name}").main(quick=args.quick)
        print(f"== {name} done in {time.perf_counter() - t:.0f} s ==", flush=True)
    out = write_summary(["gpu"] if args.device == "gpu" else SUITES, args.device == "gpu", args.quick)
    print(f"wrote {out}")
    return 0


def suite_tables(name: str, quick: bool) -> list[Path]:
    """The latest tables suite ``name`` wrote (its quick ones where ``quick`` and it wrote
    some): ``results/<name>.md``, or its ``<name>_*.md`` parts, sorted; none if it never ran."""
    stem = f"{name}_quick" if quick and any(RESULTS.glob(f"{name}_quick*.md")) else name
    if (RESULTS / f"{stem}.md").exists():
        return [RESULTS / f"{stem}.md"]
    return sorted(p for p in RESULTS.glob(f"{stem}_*.md") if quick or not p.stem.endswith("_quick"))


def write_summary(suites: list[str], gpu: bool, quick: bool) -> Path:
    """Concatenate the latest tables of ``suites`` into ``results/SUMMARY[_gpu][_quick].md``
    under a header naming this machine and the time of writing; returns its path."""
    m = machine()
    parts = [md.read_text() for name in suites for md in suite_tables(name, quick)]
    head = (f"# Benchmark summary\n\nThe latest table of each benchmark; each names the machine and the date of its "
            f"run. Written on {m['cpu']} ({m['vector']}, {m['cores']} cores), jax {m['jax']} on {m['backend']}, "
            f"{m['date']} UTC.\n\n")
    out = RESULTS / ("SUMMARY" + ("_gpu" if gpu else "") + ("_quick" if quick else "") + ".md")
    out.write_text(head + "\n".join(parts))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
