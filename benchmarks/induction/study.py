"""The mechanism check, faithfulness and the Figure-7 equivalent on the shipped model.

    python -m benchmarks.induction.study [--ckpt implicit_attn/demo/assets/induction] [--n 1000] [--faith-n 64]

Writes to ``benchmarks/results/``:

* ``induction_mechanism.{json,md}``: over ``--n`` fresh sequences, for ``variant="full"``
  and each ablation, the fraction whose strongest off-diagonal key for the last query
  (row ``L-1`` of ``op.reduce("abs_mean")``, one row per layer) is the position right
  after the earlier occurrence (``induction.mechanism_check``).
* ``induction_faithfulness.{json,md}``: rollout relevance (``explain(method="rollout")``,
  channel maps ``how="mean"`` and ``"abs_mean"``) from the ``full`` and ``s6_only`` operators, with a random ordering for reference,
  scored by the activation (AUAC, higher better) and pruning (AU-MSE, lower better)
  curves of ``implicit_attn.explain.metrics`` on ``--faith-n`` sequences; removed
  tokens are replaced by ``--baseline-id``.
* ``induction_figure7.png``: the last layer's channel-mean ``|H|`` on one induction
  sequence (the earlier occurrence and the answer position marked), with the last
  query's row.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import implicit_attn as ia
from implicit_attn.demo import induction
from implicit_attn.explain import activation, explain, pruning, random_relevance

MECH_SEED, FAITH_SEED, FIG_SEED = 2024, 3033, 7


def mechanism_rows(model, task: dict, n: int) -> tuple[list[dict], dict]:
    """One row per (layer, variant) with the mechanism-check fraction."""
    ev = induction.eval_set(n, MECH_SEED, task["length"], task["key"])
    rows, raw = [], {}
    for layer in range(len(model.layers)):
        t = time.perf_counter()
        res = induction.mechanism_check(model, ev, induction.VARIANTS, layer=layer)
        secs = time.perf_counter() - t
        raw[layer] = res
        for v, r in res.items():
            rows.append({"layer": layer, "variant": v, "fraction": round(r["fraction"], 4),
                         "hits": r["hits"], "n": r["n"], "excluded (answer = last position)": r["excluded"],
                         "most common offset from answer": r["offset_mode"],
                         "its fraction": round(r["offset_mode_fraction"], 4),
                         "layer_seconds": round(secs, 1)})
    return rows, raw


FAITH_HOWS = ("mean", "abs_mean")


def faithfulness_rows(model, task: dict, n: int, baseline_id: int) -> tuple[list[dict], dict]:
    """Mean AUAC / AU-MSE (and standard errors) of rollout relevance per variant and
    channel aggregation (``how="mean"``, the default of Eq. 20, and ``"abs_mean"``)."""
    ev = induction.eval_set(n, FAITH_SEED, task["length"], task["key"])
    ids = ev.ids
    rel = {(v, how): explain(model, ids, method="rollout", variant=v, how=how).relevance
           for how in FAITH_HOWS for v in ("full", "s6_only")}
    rel["random", None] = random_relevance(ids.shape, seed=0)
    kw = dict(baseline_id=baseline_id, target=ev.answer, batch_size=32)
    curves = {k: {"auac": activation(model, ids, r, **kw), "au_mse": pruning(model, ids, r, **kw)}
              for k, r in rel.items()}
    rows = []
    for (v, how), c in curves.items():
        a, m = c["auac"].area, c["au_mse"].area
        top = np.asarray(rel[v, how])[:, :-1].argmax(axis=1)
        rows.append({"relevance": "random" if v == "random" else f"rollout ({v}, how={how})",
                     "AUAC (higher better)": round(float(a.mean()), 4),
                     "AUAC sem": round(float(a.std(ddof=1) / np.sqrt(len(a))), 4),
                     "AU-MSE (lower better)": round(float(m.mean()), 4),
                     "AU-MSE sem": round(float(m.std(ddof=1) / np.sqrt(len(m))), 4),
                     "top-1 relevant = answer position": round(float(np.mean(top == ev.target_pos)), 4),
                     "n": int(len(a))})
    paired = {}
    for how in FAITH_HOWS:
        f, s6 = curves["full", how], curves["s6_only", how]
        paired[how] = {
            "auac_full_minus_s6": float(np.mean(f["auac"].area - s6["auac"].area)),
            "auac_full_better_fraction": float(np.mean(f["auac"].area > s6["auac"].area)),
            "au_mse_full_minus_s6": float(np.mean(f["au_mse"].area - s6["au_mse"].area)),
            "au_mse_full_better_fraction": float(np.mean(f["au_mse"].area < s6["au_mse"].area)),
        }
        paired[how]["full_more_faithful_on_both"] = bool(paired[how]["auac_full_minus_s6"] > 0
                                                         and paired[how]["au_mse_full_minus_s6"] < 0)
    curves_out = {f"{v}/{how}": {k: np.mean(c.values, axis=0).round(5).tolist() for k, c in cs.items()}
                  for (v, how), cs in curves.items()}
    return rows, {"paired": paired, "mean_curves": curves_out,
                  "fractions": curves["full", "mean"]["auac"].fractions.tolist()}


def figure7(model, task: dict, path: Path, seed: int = FIG_SEED) -> dict:
    """Last layer's channel-mean |H| on one sequence, earlier occurrence and answer marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = induction.sample(np.random.default_rng(seed), 1, task["length"], task["key"])
    layer = len(model.layers) - 1
    op = model.operators(b.ids, layers=[layer])[0]
    m = np.asarray(op.reduce("abs_mean"))[0]
    L = m.shape[0]
    e, t = int(b.earlier_pos[0]), int(b.target_pos[0])
    top = int(induction.strongest_keys(m[-1:])[0])
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 8.4), dpi=110, gridspec_kw={"height_ratios": [4, 1]})
    shown = np.where(np.tril(np.ones((L, L), bool)), m, np.nan)
    im = ax.imshow(np.log10(shown + 1e-6), cmap="viridis")
    for x, c, lab in ((e, "tab:orange", f"earlier occurrence ({e})"), (t, "tab:red", f"answer position ({t})")):
        ax.axvline(x, color=c, lw=0.8, ls="--", label=lab)
    ax.plot([t], [L - 1], marker="o", ms=7, mfc="none", mec="red")
    ax.set_title(f"layer {layer}: log10 channel-mean |H|  (last token "
                 f"{induction.decode(b.ids[0, -1:])[0]}, answer {induction.decode(b.answer)[0]})", fontsize=9)
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.legend(loc="lower left", fontsize=7)
    fig.colorbar(im, ax=ax, shrink=0.8)
    ax2.plot(np.arange(L), m[-1], lw=0.8)
    ax2.axvline(t, color="tab:red", ls="--", lw=0.8)
    ax2.axvline(e, color="tab:orange", ls="--", lw=0.8)
    ax2.set_xlim(-0.5, L - 0.5)
    ax2.set_title(f"last query's row (strongest off-diagonal key: {top})", fontsize=9)
    ax2.set_xlabel("key position j")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return {"earlier": e, "answer_position": t, "strongest_key": top, "seed": seed, "layer": layer}


def main(argv=None) -> int:
    from benchmarks.common import RESULTS, write_results

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=str(induction.ASSET_DIR))
    ap.add_argument("--n", type=int, default=1000, help="sequences for the mechanism check")
    ap.add_argument("--faith-n", type=int, default=64, help="sequences for the faithfulness curves")
    ap.add_argument("--baseline-id", type=int, default=None,
                    help="replacement token for removed positions (default: the key token for a "
                         "model trained without it, else symbol 0)")
    ap.add_argument("--tag", default="", help="suffix of the output names (e.g. _nokey)")
    ap.add_argument("--skip", nargs="*", default=(), choices=["mechanism", "faithfulness", "figure"])
    a = ap.parse_args(argv)
    ckpt = Path(a.ckpt)
    model = ia.load(ckpt)
    meta = json.loads((ckpt / "induction.json").read_text())
    task = meta["task"]
    info = {"checkpoint": str(ckpt), "model": meta["model"], "run": meta["run"], "task": task}
    RESULTS.mkdir(parents=True, exist_ok=True)
    if "figure" not in a.skip:
        png = RESULTS / f"induction_figure7{a.tag}.png"
        fig = figure7(model, task, png)
        print(f"wrote {png}: {fig}")
    if "mechanism" not in a.skip:
        rows, _ = mechanism_rows(model, task, a.n)
        write_results(f"induction_mechanism{a.tag}", rows, {**info, "n": a.n, "seed": MECH_SEED,
                                                    "map": "row L-1 of op.reduce('abs_mean'), diagonal excluded"})
    if "faithfulness" not in a.skip:
        base = a.baseline_id if a.baseline_id is not None else (0 if task["key"] else induction.KEY)
        rows, extra = faithfulness_rows(model, task, a.faith_n, base)
        write_results(f"induction_faithfulness{a.tag}", rows,
                      {**info, "n": a.faith_n, "seed": FAITH_SEED, "baseline_id": base,
                       "relevance": "rollout of channel-mean H (explain method='rollout')", **extra})
        for how, p in extra["paired"].items():
            print(f"how={how}: 'full is more faithful than s6_only' on both metrics: "
                  f"{p['full_more_faithful_on_both']} ({p})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
