"""Run every benchmark and write one summary.

    python -m benchmarks.run [--quick] [--only mamba,griffin]
    python -m benchmarks.run --device gpu [--quick]     # the GPU suite (benchmarks/gpu.py)

Each family's module writes ``benchmarks/results/<name>.json`` and ``.md``; this entry
point runs them in turn and concatenates the tables into ``results/SUMMARY.md``.
``--device gpu`` runs ``benchmarks.gpu`` (Pallas vs XLA, forward vs HF torch on the GPU)
and writes ``results/SUMMARY_gpu.md``.
"""
from __future__ import annotations

import argparse
import importlib
import time

from benchmarks.common import RESULTS, machine

SUITES = ["forward", "cli_startup", "suite", "cores", "mamba", "mamba2", "griffin", "rwkv", "delta_rule", "rwkv_official"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run, minutes)")
    ap.add_argument("--only", default=",".join(SUITES), help="comma-separated subset of " + ",".join(SUITES))
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                    help="gpu: run the GPU suite (needs JAX on a GPU) instead of the CPU suites")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    if args.device == "gpu":
        chosen = ["gpu"]
    unknown = sorted(set(chosen) - set(SUITES) - {"gpu"})
    if unknown:
        ap.error(f"unknown suites {unknown}; choose from {SUITES}")
    parts = []
    for name in chosen:
        t = time.perf_counter()
        print(f"== {name} ==", flush=True)
        importlib.import_module(f"benchmarks.{name}").main(quick=args.quick)
        print(f"== {name} done in {time.perf_counter() - t:.0f} s ==", flush=True)
        quick = args.quick and any(RESULTS.glob(f"{name}_quick*.md"))
        stem = f"{name}_quick" if quick else name
        mds = [RESULTS / f"{stem}.md"] if (RESULTS / f"{stem}.md").exists() else sorted(RESULTS.glob(f"{stem}_*.md"))
        parts += [md.read_text() for md in mds]
    m = machine()
    head = f"# Benchmark summary\n\n{m['cpu']} ({m['vector']}, {m['cores']} cores), jax {m['jax']} on {m['backend']}, {m['date']} UTC\n\n"
    out = RESULTS / ("SUMMARY" + ("_gpu" if args.device == "gpu" else "") + ("_quick" if args.quick else "") + ".md")
    out.write_text(head + "\n".join(parts))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
