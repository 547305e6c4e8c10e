"""A tiny Vision Mamba trained on scikit-learn's 8x8 digits, and the papers' vision
experiments on it: the perturbation test (Zimerman et al. Table 1; Ali et al. Table 1) and the
CLS-position effect (Ali et al. Fig. 3).

    python -m benchmarks.vim.digits [--quick] [--seeds N] [--steps S]

Needs scikit-learn (the ``papers`` extra) for the data set.

**Data.** ``sklearn.datasets.load_digits``: 1,797 grey 8x8 images (values 0..16), 10 classes;
a fixed split (seed 0) of 1,348 training and 449 test images; pixels divided by 16, then
standardised with the training mean and std (one number each).

**Model** (``models.vim``): patch 2 (a 4x4 grid, 16 patches + CLS = 17 tokens), width 32,
2 layers, state 8, conv 4, expand 2, ``divide_out`` (the released models'); the CLS token in the
middle (index 8, the released ``midclstok`` models), at the start (index 0, the official
alternative) or at the end (index 16). AdamW (lr 3e-3, linear warm-up 100 steps, cosine
decay, weight decay 0.05 on matrices, clipping at 1), batch 64, cross-entropy, 1,000 steps.

**Perturbation test** (Chefer et al. 2021, as both papers use it): for each test image the
relevance of its 16 patches for the CLS token (``explain.vision``, target = the predicted class;
channel summary ``how``), then the ``k(f) = ceil(16 f)`` most relevant (positive) or least
relevant (negative) patches are blacked out (pixel value 0 before standardisation) for
``f = 0.1, ..., 0.9``; the curve is the top-1 accuracy (percent, against the true labels) and
the AUC its trapezoid area over ``f`` (``np.trapezoid``; an accuracy of 100% everywhere gives
80). Positive: lower is better; negative: higher is better. Methods: raw attention, rollout,
attribution; operators: ``full`` (Zimerman et al.) and ``s6_only`` (Ali et al.); a random
ordering as the reference.

**CLS position** (Ali et al. Fig. 3): the mean, over the test set, of each patch's relevance
(each image's 16 relevances divided by their sum of absolute values) grouped by the patch's
distance in the sequence to the CLS token, for the middle-, start- and end-CLS models; and the
same normalised relevance averaged per patch on the 4x4 grid (``grid``: where in the image it
sits, which the distance profile mixes in: the digits' strokes fill the middle rows).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from implicit_attn.explain import vision
from implicit_attn.explain.metrics import AUC_GRID, token_counts
from implicit_attn.models import vim

from ..common import write_results

METHODS = vision.VISION_METHODS
VARIANTS = ("full", "s6_only")
HOWS = ("abs_mean", "mean")
CLS_POSITIONS = ("middle", "start", "end")
# Zimerman et al. Table 1 (ImageNet val, ViM-S; AUC in percent): (method, variant) -> (positive, negative);
# "s6_only" is Ali et al.'s column (their Table 1).
PAPER = {("raw", "s6_only"): (17.268, 34.025), ("rollout", "s6_only"): (18.806, 41.864),
         ("attribution", "s6_only"): (16.619, 39.632), ("raw", "full"): (13.264, 47.705),
         ("rollout", "full"): (12.830, 50.035), ("attribution", "full"): (11.350, 51.310)}
TEST_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run."""

    cls_position: str = "middle"
    seed: int = 0
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.05
    hidden_size: int = 32
    layers: int = 2
    state_size: int = 8

    @property
    def config(self) -> vim.Config:
        return vim.Config(image_size=8, patch_size=2, hidden_size=self.hidden_size, num_labels=10, num_channels=1,
                          num_hidden_layers=self.layers, state_size=self.state_size, conv_kernel=4, expand=2,
                          cls_position=self.cls_position)


# ----------------------------------------------------------------------------- data

def load_data():
    """``(train_x, train_y, test_x, test_y, black)``: ``x (n, 1, 8, 8)`` float32 standardised,
    ``y (n,)`` int; ``black`` the standardised value of a 0 pixel."""
    from sklearn.datasets import load_digits  # the papers extra; only this benchmark needs it

    d = load_digits()
    x = (d.images.astype(np.float64) / 16.0)[:, None]
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    n_test = int(round(TEST_FRACTION * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    mean, std = x[train].mean(), x[train].std()
    z = ((x - mean) / std).astype(np.float32)
    return z[train], y[train], z[test], y[test], np.float32((0.0 - mean) / std)


# ----------------------------------------------------------------------------- training

def decay_mask(params):
    """Weight decay on matrices (ndim >= 2) only; not on the CLS token and position embeddings."""
    mask = jax.tree.map(lambda a: a.ndim >= 2, params)
    mask["cls_token"] = mask["pos_embed"] = False
    return mask


def optimizer(run: Run):
    warmup = min(run.warmup, run.steps // 2)  # short smoke runs
    sched = optax.warmup_cosine_decay_schedule(0.0, run.lr, warmup, max(run.steps, warmup + 1),
                                               end_value=run.lr / 100)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, weight_decay=run.weight_decay, mask=decay_mask))


def loss_fn(params, x, y, cfg):
    return optax.softmax_cross_entropy_with_integer_labels(vim.forward(params, x, cfg), y).mean()


def train(run: Run, data) -> dict:
    """``{"params", "losses", "seconds"}`` of ``run`` trained from its seed."""
    tx, ty = data[0], data[1]
    cfg = run.config
    params = vim.init_params(cfg, run.seed)
    opt = optimizer(run)

    @jax.jit
    def step(params, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y, cfg)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    state = opt.init(params)
    rng = np.random.default_rng(1000 + run.seed)
    losses, t0 = [], time.perf_counter()
    for t in range(run.steps):
        idx = rng.integers(0, len(ty), run.batch_size)
        params, state, loss = step(params, state, jnp.asarray(tx[idx]), jnp.asarray(ty[idx]))
        if (t + 1) % 250 == 0 or t + 1 == run.steps:
            losses.append((t + 1, float(loss)))
    jax.block_until_ready(params)
    return {"params": params, "losses": losses, "seconds": time.perf_counter() - t0}


def predict(params, x, cfg, chunk: int = 500) -> np.ndarray:
    """``(n,)`` predicted classes."""
    return np.concatenate([np.asarray(jnp.argmax(vim.forward_jit(params, jnp.asarray(x[k:k + chunk]), cfg=cfg), -1))
                           for k in range(0, len(x), chunk)])


# ----------------------------------------------------------------------------- perturbation

def blackout(x, order, k: int, black: float, cfg: vim.Config):
    """``x (n, 1, S, S)`` with the patches ``order[:, :k]`` (row-major grid indices) set to ``black``."""
    P, G = cfg.patch_size, cfg.grid
    mask = np.zeros((x.shape[0], cfg.num_patches), bool)
    np.put_along_axis(mask, order[:, :k], True, axis=1)
    pix = np.repeat(np.repeat(mask.reshape(-1, G, G), P, axis=1), P, axis=2)[:, None]
    return np.where(pix, black, x).astype(np.float32)


def perturbation(params, x, y, relevance, black, cfg, positive: bool, fractions=AUC_GRID) -> dict:
    """Accuracy curve (percent) and AUC of blacking out patches most (``positive``) or least
    relevant first."""
    order = np.argsort(-relevance if positive else relevance, axis=1, kind="stable")
    ks = token_counts(fractions, np.full(1, cfg.num_patches))[0]
    acc = [100.0 * float(np.mean(predict(params, blackout(x, order, int(k), black, cfg), cfg) == y)) for k in ks]
    return {"curve": acc, "auc": float(np.trapezoid(acc, np.asarray(fractions)))}


def relevances(params, x, cfg, variant: str, how: str, chunk: int = 150) -> dict:
    """``{method: (n, N)}`` CLS relevance of every test image (target: the predicted class)."""
    out = {m: [] for m in METHODS}
    for k in range(0, len(x), chunk):
        xb = jnp.asarray(x[k:k + chunk])
        r = vision.cls_relevances_jit(params, xb, cfg=cfg, methods=METHODS, variant=variant, how=how)
        for m in METHODS:
            out[m].append(np.asarray(r[m]))
    return {m: np.concatenate(v) for m, v in out.items()}


def normalised(rel: np.ndarray) -> np.ndarray:
    """Each image's relevances divided by their sum of absolute values."""
    return rel / np.maximum(np.abs(rel).sum(1, keepdims=True), 1e-30)


def distance_rows(rel: np.ndarray, cfg: vim.Config) -> dict:
    """Mean normalised relevance by distance to the CLS token: ``{distance: mean}``."""
    ds, m = vision.distance_profile(normalised(rel), cfg)
    return {int(d): float(v) for d, v in zip(ds, m)}


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="300 steps, 1 seed, middle CLS only")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 per CLS position (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 1000, --quick 300)")
    ap.add_argument("--name", default=None, help="results name (default vim_digits[_quick])")
    ap.add_argument("--save", default=None, help="directory to save the seed-0 models in (vim.save)")
    a = ap.parse_args(argv)
    seeds = a.seeds or (1 if a.quick else 3)
    steps = a.steps or (300 if a.quick else 1000)
    positions = ("middle",) if a.quick else CLS_POSITIONS
    name = a.name or ("vim_digits_quick" if a.quick else "vim_digits")
    data = load_data()
    _, _, test_x, test_y, black = data
    runs, rows, dist = [], [], []
    for pos in positions:
        for seed in range(seeds):
            run = Run(cls_position=pos, seed=seed, steps=steps)
            cfg = run.config
            res = train(run, data)
            params = res["params"]
            acc = 100.0 * float(np.mean(predict(params, test_x, cfg) == test_y))
            print(f"cls {pos} seed {seed}: test accuracy {acc:.2f}%, loss {res['losses'][-1][1]:.4f}, "
                  f"{res['seconds']:.0f} s", file=sys.stderr, flush=True)
            if a.save and seed == 0:
                vim.save(Path(a.save) / f"vim_digits_{pos}", vim.ViM(cfg, params))
            runs.append({"cls_position": pos, "seed": seed, "test_accuracy": acc, "seconds": res["seconds"],
                         "losses": res["losses"]})
            for variant in VARIANTS:
                for how in HOWS:
                    rel = relevances(params, test_x, cfg, variant, how)
                    for m in METHODS:
                        dist.append({"cls_position": pos, "seed": seed, "variant": variant, "how": how, "method": m,
                                     "by_distance": distance_rows(rel[m], cfg),
                                     "grid": normalised(rel[m]).mean(0).reshape(cfg.grid, cfg.grid).tolist()})
                        if pos != "middle":
                            continue
                        pp = perturbation(params, test_x, test_y, rel[m], black, cfg, positive=True)
                        nn = perturbation(params, test_x, test_y, rel[m], black, cfg, positive=False)
                        rows.append({"seed": seed, "variant": variant, "how": how, "method": m,
                                     "positive_auc": pp["auc"], "negative_auc": nn["auc"],
                                     "positive_curve": pp["curve"], "negative_curve": nn["curve"]})
            if pos == "middle":
                rnd = np.random.default_rng(seed).standard_normal((len(test_y), cfg.num_patches))
                pp = perturbation(params, test_x, test_y, rnd, black, cfg, positive=True)
                nn = perturbation(params, test_x, test_y, rnd, black, cfg, positive=False)
                rows.append({"seed": seed, "variant": "-", "how": "-", "method": "random", "positive_auc": pp["auc"],
                             "negative_auc": nn["auc"], "positive_curve": pp["curve"],
                             "negative_curve": nn["curve"]})
    table = summarize(rows)
    meta = {"settings": dataclasses.asdict(Run(steps=steps)), "seeds": seeds, "cls_positions": list(positions),
            "runs": runs, "perturbation": rows, "cls_distance": dist, "fractions": list(AUC_GRID),
            "paper": "Zimerman et al. Table 1 (ViM-S, ImageNet val; s6_only: Ali et al.'s numbers)"}
    write_results(name, table, meta, columns=["method", "variant", "how", "seeds", "positive_auc", "positive_std",
                                              "paper_positive", "negative_auc", "negative_std", "paper_negative"])
    for variant in VARIANTS:
        print(distance_table(dist, variant, "abs_mean", "raw"))
    return 0


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (method, variant, how): AUC mean and std over seeds, the paper's numbers."""
    out = []
    keys = list(dict.fromkeys((r["method"], r["variant"], r["how"]) for r in rows))
    for m, v, h in keys:
        sel = [r for r in rows if (r["method"], r["variant"], r["how"]) == (m, v, h)]
        pos, neg = [r["positive_auc"] for r in sel], [r["negative_auc"] for r in sel]
        paper = PAPER.get((m, v), (None, None))
        out.append({"method": m, "variant": v, "how": h, "seeds": len(sel), "positive_auc": float(np.mean(pos)),
                    "positive_std": float(np.std(pos)), "paper_positive": paper[0],
                    "negative_auc": float(np.mean(neg)), "negative_std": float(np.std(neg)),
                    "paper_negative": paper[1]})
    return out


def distance_table(dist: list[dict], variant: str, how: str, method: str) -> str:
    """Markdown: mean normalised relevance by distance to CLS, one row per CLS position."""
    sel = [d for d in dist if (d["variant"], d["how"], d["method"]) == (variant, how, method)]
    positions = list(dict.fromkeys(d["cls_position"] for d in sel))
    ds = sorted({int(k) for d in sel for k in d["by_distance"]})  # JSON keys are strings
    lines = [f"{method}, {variant}, {how}: mean relevance (normalised per image) by distance to CLS",
             "| CLS | " + " | ".join(str(k) for k in ds) + " |", "|---|" + "---|" * len(ds)]
    for p in positions:
        per = [d["by_distance"] for d in sel if d["cls_position"] == p]
        per = [{int(k): v for k, v in q.items()} for q in per]
        vals = [np.mean([q[k] for q in per if k in q]) if any(k in q for q in per) else None for k in ds]
        lines.append(f"| {p} | " + " | ".join("" if v is None else f"{v:.4f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
