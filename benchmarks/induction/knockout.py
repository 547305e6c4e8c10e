"""Attention knockout on the shipped induction model: is the answer read through one key column?

    python -m benchmarks.induction.knockout [--ckpt implicit_attn/demo/assets/induction] [--n 200]

For ``--n`` fresh induction sequences, the probability of the correct answer at the last
position and the accuracy, for the clean model and with one key column of the last
layer's implicit attention set to zero (all channels; ``model.knockout``, exact: the
mixer output changes by ``-H[c, i, j] v[c, j]``):

* ``answer column``: ``j`` = the position of the answer token (right after the earlier
  occurrence of the query token), which the induction mechanism reads;
* ``earlier occurrence``: ``j`` = the earlier occurrence itself;
* ``random column``: ``j`` uniform among the other positions before the last one.

Writes ``benchmarks/results/induction_knockout.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

import implicit_attn as ia
from implicit_attn.demo import induction

SEED = 4242
RESULTS = Path(__file__).resolve().parents[1] / "results"


def answer_prob(logits, answer: int) -> float:
    """Softmax probability of ``answer`` at the last position of ``logits (1, L, V)``."""
    return float(jax.nn.softmax(np.asarray(logits, np.float64)[0, -1])[answer])


def run(ckpt, n: int) -> dict:
    """Per-condition mean answer probability and accuracy over ``n`` sequences."""
    model = ia.load(ckpt)
    task = json.loads((Path(ckpt) / "induction.json").read_text())["task"]
    ev = induction.eval_set(n, SEED, task["length"], task["key"])
    rng = np.random.default_rng(SEED)
    last = len(model.layers) - 1
    rows = {k: {"prob": [], "correct": []} for k in ("clean", "answer column", "earlier occurrence", "random column")}
    for b in tqdm(range(n), desc="knockout", unit="seq"):
        ids = ev.ids[b:b + 1]
        a, t = int(ev.answer[b]), int(ev.target_pos[b])
        others = [j for j in range(ids.shape[1] - 1) if j not in (t, t - 1)]
        cols = {"answer column": t, "earlier occurrence": int(ev.earlier_pos[b]),
                "random column": int(rng.choice(others))}
        outs = {"clean": model(ids)} | {k: model.knockout(ids, last, keys=j) for k, j in cols.items()}
        for k, lg in outs.items():
            rows[k]["prob"].append(answer_prob(lg, a))
            rows[k]["correct"].append(int(np.asarray(lg)[0, -1].argmax() == a))
    return {k: {"mean_answer_prob": float(np.mean(v["prob"])), "accuracy": float(np.mean(v["correct"]))}
            for k, v in rows.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ckpt", default=str(induction.ASSET_DIR), help="induction checkpoint directory")
    ap.add_argument("--n", type=int, default=200, help="number of fresh evaluation sequences")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(args.ckpt, args.n)
    out = {"n": args.n, "seed": SEED, "layer": "last", "channels": "all", "results": res,
           "seconds": round(time.perf_counter() - t0, 1)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "induction_knockout.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# Attention knockout on the shipped induction model ({args.n} sequences, last layer, all channels)",
             "", "| condition | mean p(answer) | accuracy |", "|---|---|---|"]
    lines += [f"| {k} | {v['mean_answer_prob']:.3f} | {v['accuracy']:.3f} |" for k, v in res.items()]
    (RESULTS / "induction_knockout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
