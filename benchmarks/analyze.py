"""Batch analysis throughput and memory (issue 22): ``implicit-attn analyze`` over a random
corpus with 1 process and with 2 ``jax.distributed`` processes on this machine, and the peak
resident memory of a corpus 10x larger (it should stay flat: the corpus is never held).

Every run is a fresh ``python -m implicit_attn.cli analyze`` process (its peak resident size
is ``ru_maxrss`` from ``wait4``); ``seconds`` is its wall time, compilation included.
``steady_ex_per_s`` is ``(N10 - N) / (t10 - t1)`` between the corpus of N and the one of 10 N
examples (same lengths drawn, same buckets), which cancels start-up, indexing and compilation.

    python -m benchmarks.analyze [--quick] [--n 64] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import write_results

ROOT = Path(__file__).resolve().parent.parent
# a small Mamba (about 1.6 M parameters) and a quick one for smoke runs
CONFIGS = {"full": dict(vocab_size=512, hidden_size=128, state_size=16, num_hidden_layers=4),
           "quick": dict(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2)}


def make_checkpoint(path: Path, cfg: dict) -> Path:
    import jax

    import implicit_attn as ia
    from implicit_attn.families import mamba

    c = mamba.Config(**cfg)
    ia.save(mamba.LM(c, mamba.init_params(c, jax.random.PRNGKey(0))), path)
    return path


def make_corpus(path: Path, n: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"ids": rng.integers(0, vocab, int(rng.integers(*lengths))).tolist()}) + "\n")
    return path


def launch(ckpt, data, out, extra=(), env_extra=None) -> subprocess.Popen:
    # every run compiles (the command line's compilation cache would make later runs cheaper)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IMPLICIT_ATTN_COMPILE_CACHE": "0", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "implicit_attn.cli", "analyze", str(ckpt), "--data", str(data),
                             "--out", str(out), "--no-progress", *map(str, extra)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait(p: subprocess.Popen) -> tuple[dict, float]:
    """``(summary, peak RSS MiB)`` of a finished run (``wait4``'s ``ru_maxrss``)."""
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    out, err = p.stdout.read(), p.stderr.read()
    if p.returncode:
        raise RuntimeError(f"analyze failed ({p.returncode}): {err[-2000:]}")
    return json.loads(out.splitlines()[-1]), usage.ru_maxrss / 1024


def run(ckpt, data, out, processes: int, opts) -> dict:
    t = time.perf_counter()
    if processes == 1:
        procs = [launch(ckpt, data, out, opts)]
    else:
        port = 20000 + os.getpid() % 20000
        procs = [launch(ckpt, data, out, [*opts, "--coordinator", f"localhost:{port}", "--num-processes",
                                          processes, "--process-id", i]) for i in range(processes)]
    res = [wait(p) for p in procs]
    secs = time.perf_counter() - t
    rows = sum(s["computed"] for s, _ in res)
    return {"processes": processes, "examples": rows, "seconds": round(secs, 3),
            "ex_per_s": round(rows / secs, 3), "peak_rss_mib": round(max(m for _, m in res), 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and corpus (a smoke run)")
    ap.add_argument("--n", type=int, default=None, help="examples of the small corpus (the large one has 10x)")
    ap.add_argument("--analyses", default="maps,relevance,stats")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--no-write", action="store_true", help="print, do not write benchmarks/results/analyze.*")
    args = ap.parse_args(argv)
    cfg = CONFIGS["quick" if args.quick else "full"]
    n = args.n or (8 if args.quick else 128)
    lengths = (4, 20) if args.quick else (16, 128)
    opts = ["--analyses", args.analyses, "--batch-size", args.batch_size]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ckpt = make_checkpoint(d / "ckpt", cfg)
        for size in (n, 10 * n):
            data = make_corpus(d / f"c{size}.jsonl", size, cfg["vocab_size"], lengths)
            for procs in (1, 2):
                r = run(ckpt, data, d / f"s{size}_{procs}", procs, opts)
                rows.append({"corpus": size, **r})
                print(rows[-1], flush=True)
    for procs in (1, 2):
        small, large = (next(r for r in rows if r["corpus"] == s and r["processes"] == procs) for s in (n, 10 * n))
        dt = large["seconds"] - small["seconds"]  # (noise can make it <= 0 on tiny corpora: no rate then)
        large["steady_ex_per_s"] = round((large["examples"] - small["examples"]) / dt, 3) if dt > 0 else None
        large["rss_vs_small"] = round(large["peak_rss_mib"] / small["peak_rss_mib"], 3)
    meta = {"config": cfg, "lengths": lengths, "analyses": args.analyses, "batch_size": args.batch_size}
    if args.no_write:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
    else:
        write_results("analyze", rows, meta)
    return rows


if __name__ == "__main__":
    main()
