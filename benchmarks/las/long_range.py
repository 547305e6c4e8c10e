"""The LaS paper's Table 4 ordering (Zimerman & Wolf, Sec. 5.2) on a long-range classification
task that runs on our CPUs: pixel-sequence digits (scikit-learn's 8x8 digits read row by row).

    python -m benchmarks.las.long_range [--quick] [--seeds N] [--models vanilla l_attention ...]
    python -m benchmarks.las.long_range --seed-list 1 --name las_long_range_s1   # one seed per process
    python -m benchmarks.las.long_range --merge las_long_range_s0 las_long_range_s1 las_long_range_s2

**Task.** ``sklearn.datasets.load_digits``: 1,797 grey images of 8x8 pixels, intensities the
integers 0..16, ten classes. Each image is a sequence of its 64 pixels in row-major order (as
LRA's Image task and sMNIST flatten an image); each of the 17 intensity levels is one token
(vocabulary 17: the set holds only these integers, so the tokens lose nothing). A fixed split
(permutation from ``SPLIT_SEED``, independent of the run's seed): 1,297 training images,
``TEST = 500`` test images.

**Model** (every variant identical but for the attention flags, ``las.Config.variant``): the
causal LaS transformer of ``implicit_attn.models.las`` as a classifier (``num_labels = 10``,
``classifier_pooling = "mean"``: the class of the whole sequence is the head on the mean of
all 64 positions, ``LaSLM.classify``); no positional embeddings (the causal mask, and ELD or
ALiBi where the variant has them, carry position). 2 layers, width 64, 8 heads (the paper's
head count, Appendix A), ``P = 3`` (Table 9's Image row). ``B``: Table 9's Image row has
``B = 1e-3`` at length 1,024, where the most local head (``alpha = B``) decays to
``exp(-B * 1023) = 0.36`` at the far end; at length 64 the same ``B`` would leave every head's
factor above 0.94, so the default scales it to the length, ``B = 1e-3 * 1024 / 64 = 0.016``
(about the same far-end decay).
``--B 1e-3`` gives the unscaled value.

**Training.** AdamW with the induction benchmark's ``optimizer`` (linear warm-up over 5% of the
steps, cosine decay to 1/100, clipping at 1, weight decay on matrices), Table 9's Image row
(lr 1e-3, WD 0.01, batch 50), cross-entropy on the sequence's class, ``--epochs`` passes over
the training images in an order drawn from ``(seed, epoch)``; parameters from ``seed``. Test
accuracy after the last step (no early stopping, no model selection on the test set).

Variants (``las.VARIANTS``): ``vanilla``, ``l_attention`` (ELD only), ``s_attention`` (average
pooling only), ``las`` (both), ``alibi``. The paper's Table 4 rows are LaS-chunk models (chunk
128) on LRA; at length 64 a chunk of 128 is the full sequence, so our rows are the unchunked
variants.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from implicit_attn.models import las

from ..common import RESULTS, write_results
from ..induction.train import optimizer

MODELS = ("vanilla", "l_attention", "s_attention", "las", "alibi")
LEVELS = 17                 # intensities 0..16
CLASSES = 10
TEST = 500
SPLIT_SEED = 0
# Table 4 (LaS-chunk baseline cT, LRA accuracy %) and, for vanilla (absent from Table 4), the
# full-attention Transformer of Table 2 (numbers the paper copies from earlier work).
PAPER = {
    "alibi": dict(listops=39.94, text=66.10, retrieval=77.61, image=42.24, avg=56.47, row="cT+ALIBI"),
    "l_attention": dict(listops=41.08, text=70.65, retrieval=81.42, image=59.48, avg=63.16, row="cT+ELD"),
    "s_attention": dict(listops=46.13, text=75.86, retrieval=80.64, image=61.38, avg=66.00, row="cT+SMOOTH"),
    "las": dict(listops=46.21, text=79.11, retrieval=83.84, image=64.90, avg=68.52, row="cT+SMOOTH+ELD"),
    "vanilla": dict(listops=36.37, text=64.27, retrieval=57.46, image=42.44, avg=50.135,
                    row="Transformer (Table 2; avg of these 4 tasks)"),
}


# ----------------------------------------------------------------------------- data

@dataclasses.dataclass(frozen=True)
class Split:
    train_ids: np.ndarray     # (n_train, 64) int32 tokens 0..16
    train_y: np.ndarray       # (n_train,) int32 classes
    test_ids: np.ndarray      # (TEST, 64)
    test_y: np.ndarray        # (TEST,)


@functools.lru_cache(maxsize=2)
def load_split(test: int = TEST, split_seed: int = SPLIT_SEED) -> Split:
    """The digits as 64-token sequences (row-major pixels), split by a fixed permutation:
    the last ``test`` images of ``permutation(split_seed)`` are the test set."""
    from sklearn.datasets import load_digits   # the papers extra; only this benchmark needs it

    d = load_digits()
    x, y = np.asarray(d.data), np.asarray(d.target)
    if not (np.array_equal(x, np.round(x)) and x.min() >= 0 and x.max() < LEVELS):
        raise ValueError(f"expected integer intensities in [0, {LEVELS - 1}], got range [{x.min()}, {x.max()}]")
    if not 0 < test < len(y):
        raise ValueError(f"test must be in (0, {len(y)}), got {test}")
    perm = np.random.default_rng(split_seed).permutation(len(y))
    tr, te = perm[:-test], perm[-test:]
    ids = x.astype(np.int32)
    return Split(ids[tr], y[tr].astype(np.int32), ids[te], y[te].astype(np.int32))


# ----------------------------------------------------------------------------- model

@dataclasses.dataclass(frozen=True)
class Run:
    """One training run; ``steps``, ``lr``, ``warmup_steps``, ``weight_decay``, ``clip`` are what
    ``induction.train.optimizer`` reads."""

    model: str
    seed: int = 0
    epochs: int = 20
    batch_size: int = 50
    hidden: int = 64
    layers: int = 2
    heads: int = 8
    B: float = 0.016
    P: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.01
    clip: float = 1.0
    warmup: int = 0               # 0: 5% of the steps
    n_train: int = 1297

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        for name in ("epochs", "batch_size", "n_train"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.batch_size > self.n_train:
            raise ValueError(f"batch_size ({self.batch_size}) exceeds the training images ({self.n_train})")

    @property
    def steps_per_epoch(self) -> int:
        return self.n_train // self.batch_size       # the last partial batch is dropped

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def warmup_steps(self) -> int:
        return self.warmup or max(1, self.steps // 20)

    @property
    def config(self) -> las.Config:
        return las.Config.variant(self.model, pool=self.P, vocab_size=LEVELS, hidden_size=self.hidden,
                                  num_hidden_layers=self.layers, num_attention_heads=self.heads, B=self.B,
                                  num_labels=CLASSES, classifier_pooling="mean")


def class_logits(params: dict, ids, cfg: las.Config):
    """``ids (n, L) -> (n, CLASSES)``: the classifier at the last position (mean of all)."""
    return las.lm_forward(params, ids, cfg)[0][:, -1]


def loss_fn(params, ids, y, cfg):
    """Mean cross-entropy of the sequences' classes ``y (n,)``."""
    return optax.softmax_cross_entropy_with_integer_labels(class_logits(params, ids, cfg), y).mean()


class_logits_jit = jax.jit(class_logits, static_argnames=("cfg",))


@functools.lru_cache(maxsize=8)
def make_step(run: Run):
    """``step(state, ids, y) -> (state, loss)``, jit-compiled."""
    cfg, opt = run.config, optimizer(run)

    @jax.jit
    def step(state, ids, y):
        loss, g = jax.value_and_grad(loss_fn)(state["params"], ids, y, cfg)
        upd, opt_state = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], upd), "opt": opt_state}, loss

    return step


def batch_order(run: Run, epoch: int) -> np.ndarray:
    """The training indices of ``epoch``, ``(steps_per_epoch, batch_size)``: a pure function of
    ``(seed, epoch)``."""
    perm = np.random.default_rng([run.seed, epoch]).permutation(run.n_train)
    return perm[:run.steps_per_epoch * run.batch_size].reshape(run.steps_per_epoch, run.batch_size)


def train(run: Run, split: Split, log_every: int = 100) -> dict:
    """Train ``run`` from scratch on ``split``: ``{"params", "losses" [(step, loss)], "seconds"}``."""
    if len(split.train_y) != run.n_train:
        raise ValueError(f"run.n_train ({run.n_train}) != the split's training images ({len(split.train_y)})")
    params = las.init_params(run.config, run.seed)
    state = {"params": params, "opt": optimizer(run).init(params)}
    step = make_step(run)
    losses, t, t0 = [], 0, time.perf_counter()
    for epoch in range(run.epochs):
        for idx in batch_order(run, epoch):
            state, loss = step(state, jnp.asarray(split.train_ids[idx]), jnp.asarray(split.train_y[idx]))
            t += 1
            if t % log_every == 0 or t == run.steps:
                losses.append((t, float(loss)))
    jax.block_until_ready(state)
    return {"params": state["params"], "losses": losses, "seconds": time.perf_counter() - t0}


def accuracy(run: Run, params, ids, y, chunk: int = 250) -> float:
    """Fraction of ``ids (n, L)`` whose argmax class equals ``y``."""
    pred = np.concatenate([np.argmax(np.asarray(class_logits_jit(params, jnp.asarray(ids[k:k + chunk]), run.config)), -1)
                           for k in range(0, len(y), chunk)])
    return float(np.mean(pred == np.asarray(y)))


# ----------------------------------------------------------------------------- report

COLUMNS = ["model", "seeds", "test_acc_mean", "test_acc_std", "train_acc_mean", "paper_image", "paper_avg",
           "paper_row", "test_acc_per_seed"]

def summarize(runs: list[dict], models) -> list[dict]:
    """One row per model: test accuracy (%) mean ± std (population std over the seeds run),
    with the paper's Image and four-task average numbers beside it."""
    rows = []
    for model in models:
        acc = [100 * x["test_acc"] for x in runs if x["model"] == model]
        if not acc:
            continue
        tr = [100 * x["train_acc"] for x in runs if x["model"] == model]
        rows.append({"model": model, "seeds": len(acc), "test_acc_mean": float(np.mean(acc)),
                     "test_acc_std": float(np.std(acc)), "train_acc_mean": float(np.mean(tr)),
                     "paper_image": PAPER[model]["image"], "paper_avg": PAPER[model]["avg"],
                     "paper_row": PAPER[model]["row"], "test_acc_per_seed": " ".join(f"{v:.1f}" for v in acc)})
    return rows


def merge(names, name: str, models=MODELS, results=None) -> Path:
    """Combine the runs of the results ``names`` (written with the same settings but the seed
    count, e.g. one seed per process) into ``results/<name>.{json,md}``."""
    results = RESULTS if results is None else Path(results)
    metas = [json.loads((results / f"{n}.json").read_text())["meta"] for n in names]
    strip = lambda st: {k: v for k, v in st.items() if k != "seeds"}
    if any(strip(m["settings"]) != strip(metas[0]["settings"]) for m in metas):
        raise ValueError(f"the results {names} were written with different settings")
    runs = sorted((r for m in metas for r in m["runs"] if r["model"] in models),
                  key=lambda r: (r["seed"], MODELS.index(r["model"])))
    pairs = [(r["model"], r["seed"]) for r in runs]
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"the results {names} hold a (model, seed) run twice")
    n_seeds = len({r["seed"] for r in runs})
    settings = {**metas[0]["settings"], "seeds": n_seeds, "merged_from": list(names)}
    meta = {"settings": settings, "complete": len(runs) == len(models) * n_seeds, "runs": runs,
            "paper": metas[0]["paper"]}
    return write_results(name, summarize(runs, models), meta, columns=COLUMNS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 epochs and 2 seeds unless given")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3, --quick 2)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--epochs", type=int, default=None, help="passes over the training set (default 20)")
    ap.add_argument("--B", type=float, default=0.016, help="LaS's B (default: Table 9's 1e-3 scaled by 1024/64)")
    ap.add_argument("--P", type=int, default=3, help="LaS's pooling window (Table 9, Image: 3)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--name", default=None, help="results name (default las_long_range[_quick])")
    ap.add_argument("--seed-list", type=int, nargs="+", default=None,
                    help="run these seeds only (e.g. one seed per process; then --merge)")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="only combine the runs of these results names (same settings) into --name")
    a = ap.parse_args(argv)
    seeds = a.seeds or (2 if a.quick else 3)
    epochs = a.epochs or (5 if a.quick else 20)
    name = a.name or ("las_long_range_quick" if a.quick else "las_long_range")
    if a.merge:
        merge(a.merge, name, a.models)
        return 0
    split = load_split()
    base = Run(model=a.models[0], epochs=epochs, B=a.B, P=a.P, hidden=a.hidden, layers=a.layers,
               n_train=len(split.train_y))
    settings = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("model", "seed")}
    settings.update(steps=base.steps, test_images=len(split.test_y), length=int(split.train_ids.shape[1]),
                    seeds=seeds, split_seed=SPLIT_SEED, tokens="17 intensity levels 0..16, one token each")
    seed_list = a.seed_list if a.seed_list is not None else list(range(seeds))
    settings["seeds"] = len(seed_list)
    runs, total = [], len(a.models) * len(seed_list)
    for seed in seed_list:
        for model in a.models:
            run = dataclasses.replace(base, model=model, seed=seed)
            res = train(run, split)
            test_acc = accuracy(run, res["params"], split.test_ids, split.test_y)
            train_acc = accuracy(run, res["params"], split.train_ids, split.train_y)
            runs.append({"model": model, "seed": seed, "test_acc": test_acc, "train_acc": train_acc,
                         "seconds": res["seconds"], "final_loss": res["losses"][-1][1], "losses": res["losses"]})
            print(f"{model} seed {seed}: test {100 * test_acc:.1f}%, train {100 * train_acc:.1f}%, "
                  f"loss {res['losses'][-1][1]:.3g}, {res['seconds']:.0f} s", file=sys.stderr, flush=True)
            meta = {"settings": settings, "complete": len(runs) == total, "runs": runs,
                    "paper": "Zimerman & Wolf, Table 4 (LRA, LaS-chunk baseline) and Table 2 (Transformer)"}
            write_results(name, summarize(runs, a.models), meta, columns=COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
