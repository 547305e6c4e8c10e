"""Table 2 of Yamamoto & Matsuzaki on this machine: train the five configurations with and
without the key token (one after the other, in this process), then write
``benchmarks/results/induction_table2.{json,md}`` next to the paper's accuracies.

    python -m benchmarks.induction.table2 --runs runs/induction            # train all + report
    python -m benchmarks.induction.table2 --runs runs/induction --only mamba1_key
    python -m benchmarks.induction.table2 --runs runs/induction --report   # table from finished runs

Every run is ``python -m benchmarks.induction.train`` with the arguments in ``PLAN`` (its
directory is ``RUNS/<name>``; an interrupted run resumes from its last checkpoint when the
command is repeated). Step counts were chosen to fit the CPU budget of one session (see
README); the paper trains up to 204,800 steps of batch 8 at length 255.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import models, train

# name -> (model, key, steps, warm_steps at length 64). Batch 32, lr 3e-3 everywhere.
PLAN = {
    "mamba1_key": ("mamba1", True, 700, 400),
    "conv_ssm_key": ("conv_ssm", True, 2000, 1400),
    "mamba2_key": ("mamba2", True, 600, 350),
    "conv_key": ("conv", True, 4000, 3000),
    "ssm_key": ("ssm", True, 2000, 1400),
    "conv_nokey": ("conv", False, 4000, 3000),
    "ssm_nokey": ("ssm", False, 2500, 1800),
    "conv_ssm_nokey": ("conv_ssm", False, 4000, 3000),
    "mamba1_nokey": ("mamba1", False, 3000, 2200),
    "mamba2_nokey": ("mamba2", False, 3000, 2200),
}
BATCH, LR, WARM_LENGTH, EVAL_N = 32, 3e-3, 64, 1000


def argv_of(name: str, runs: Path, deadline: str | None = None) -> list[str]:
    """The ``train`` command line of run ``name``."""
    model, key, steps, warm = PLAN[name]
    a = ["--model", model, "--steps", str(steps), "--batch-size", str(BATCH), "--lr", str(LR),
         "--warm-length", str(WARM_LENGTH), "--warm-steps", str(warm), "--out", str(runs / name),
         "--ckpt-every", "200", "--eval", str(EVAL_N)]
    a += ["--deadline", deadline] if deadline else []
    return a + (["--key"] if key else [])


def report(runs: Path) -> Path:
    """Collect ``RUNS/*/result.json`` into the results table."""
    from benchmarks.common import write_results

    rows = []
    for name, (model, key, steps, warm) in PLAN.items():
        f = runs / name / "result.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        spec = models.get_spec(model)
        paper = spec.paper_key if key else spec.paper_nokey
        acc = 100 * r["accuracy"]
        rows.append({"completed": r.get("completed", True), "model": spec.name, "key token": "with" if key else "without",
                     "D": spec.d, "N": spec.n if "ssm" in spec.parts or spec.kind == "mamba" else None,
                     "W": spec.w if "conv" in spec.parts or spec.kind == "mamba" else None,
                     "steps": r["steps"], "of which at L=64": warm, "batch": r["config"]["batch_size"],
                     "train_s": round(r["seconds"], 1), "s_per_step": round(r["seconds"] / r["steps"], 4),
                     "accuracy_%": round(acc, 1), "eval_n": r["eval_n"], "paper_%": paper,
                     "final_loss": round(r["losses"][-1][1], 4) if r["losses"] else None,
                     "run": name})
    meta = {"task": "induction heads, 16 symbols (+ key), length 255, loss on the last position",
            "optimizer": f"AdamW lr {LR} warmup 5% + cosine, wd 0.1, clip 1.0",
            "curriculum": f"first steps at length {WARM_LENGTH}, the rest at 255; evaluated at 255",
            "eval": f"{EVAL_N} fresh sequences (evaluation stream, seed 1234)",
            "paper": "Yamamoto & Matsuzaki, Table 2 (batch 8, up to 204,800 steps)"}
    return write_results("induction_table2", rows, meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="runs/induction", help="directory of the run directories")
    ap.add_argument("--only", nargs="*", choices=sorted(PLAN), help="train only these runs")
    ap.add_argument("--report", action="store_true", help="only write the table from finished runs")
    ap.add_argument("--deadline", default=None, help="HH:MM UTC: runs stop there (see train --deadline)")
    a = ap.parse_args(argv)
    runs = Path(a.runs)
    if not a.report:
        for name in a.only or PLAN:
            done = runs / name / "result.json"
            if done.exists() and json.loads(done.read_text())["steps"] == PLAN[name][2]:
                print(f"{name}: already finished")
                continue
            train.main(argv_of(name, runs, a.deadline))
    report(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
