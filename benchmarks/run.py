"""Run every benchmark and write one summary.

    python -m benchmarks.run [--quick] [--only mamba,griffin]

Each family's module writes ``benchmarks/results/<name>.json`` and ``.md``; this entry
point runs them in turn and concatenates the tables into ``results/SUMMARY.md``.
On a GPU/TPU machine the same command measures there (JAX picks the device).
"""
from __future__ import annotations

import argparse
import importlib
import time

from benchmarks.common import RESULTS, machine

SUITES = ["forward", "suite", "mamba", "mamba2", "griffin", "rwkv"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run, minutes)")
    ap.add_argument("--only", default=",".join(SUITES), help="comma-separated subset of " + ",".join(SUITES))
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SUITES))
    if unknown:
        ap.error(f"unknown suites {unknown}; choose from {SUITES}")
    parts = []
    for name in chosen:
        t = time.perf_counter()
        print(f"== {name} ==", flush=True)
        importlib.import_module(f"benchmarks.{name}").main(quick=args.quick)
        print(f"== {name} done in {time.perf_counter() - t:.0f} s ==", flush=True)
        stem = f"{name}_quick" if args.quick and (RESULTS / f"{name}_quick.md").exists() else name
        md = RESULTS / f"{stem}.md"
        if md.exists():
            parts.append(md.read_text())
    m = machine()
    head = f"# Benchmark summary\n\n{m['cpu']} ({m['cores']} cores), jax {m['jax']} on {m['backend']}, {m['date']} UTC\n\n"
    out = RESULTS / ("SUMMARY_quick.md" if args.quick else "SUMMARY.md")
    out.write_text(head + "\n".join(parts))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
