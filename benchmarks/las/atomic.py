"""The LaS paper's failure cases (Zimerman & Wolf, Sec. 5.4, Table 7): vanilla vs LaS attention
on three atomic tasks of Gupta et al. 2022b (Select, CumSum, CumMax), R^2 over seeds.

    python -m benchmarks.las.atomic [--quick] [--seeds N] [--tasks select cumsum cummax]
    python -m benchmarks.las.atomic --models l_attention s_attention --name las_atomic_ablations

**Inputs.** Real-valued sequences, not tokens: per position ``i`` three features
``(x_i, marker_i, start_i)`` with ``x_i ~ N(0, 1)`` i.i.d., ``marker_i`` the Select marker (0 in
the other tasks) and ``start_i = 1`` at ``i = 0`` only (the LaS model has no positional
embeddings; the start flag lets a causal head recover the position, ``1/(i+1)`` by averaging).
A linear projection (with bias) maps the features to the model width, ``las.stack_forward`` runs
the layers, ``las.head`` (one label, ``classifier_pooling="last"``: the final LayerNorm and a
linear read-out at every position) gives one real prediction per position.

**Targets** (causal: ``y_i`` depends on positions ``<= i`` only), ``L`` the length:

- ``cumsum``: ``y_i = (1 / sqrt(i)) * sum_{j < i} x_j`` for ``i >= 1``, ``y_0 = 0`` (the paper's
  ``sum_{j<i} x_j``, normalised to unit variance at every position).
- ``cummax``: ``y_i = max_{j <= i} x_j`` (inclusive; our choice, the paper does not say).
- ``select``: one marked position ``p`` uniform in ``[0, L/2)`` (``marker_p = 1``);
  ``y_i = x_p`` for ``i >= p`` and 0 before. Loss and R^2 count the positions ``i >= L/2``
  only (where the marked element is always in the past): the model must copy the value at the
  marked position, a non-local, non-smooth selection. (Gupta et al.'s Select outputs the
  marked elements; this is its one-element, per-position form.)

**Training** (every model identical but for the attention flags): AdamW with the induction
benchmark's ``optimizer`` (linear warm-up over 5% of the steps, cosine decay to 1/100,
clipping at 1, weight decay on matrices), masked MSE, batch ``t`` a pure function of
``(seed, task, t)``, parameters from ``seed``; R^2 on a held-out set from a separate stream.
Table 9's Image row for the LaS hyper-parameters (``B = 1e-3``, ``P = 3``, lr 1e-3, WD 0.01,
batch 50); 8 heads as the paper's Appendix A; a small width and depth so a run takes well
under a minute on one core.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from implicit_attn.models import las
from implicit_attn.nn import fan_in_normal
from implicit_attn.ops import linear

from ..common import RESULTS, write_results
from ..induction.train import optimizer

TASKS = ("select", "cumsum", "cummax")
MODELS = ("vanilla", "las", "l_attention", "s_attention")   # las.VARIANTS: the paper's model and its ablations
DEFAULT_MODELS = ("vanilla", "las")                          # Table 7's pair
FEATURES = 3                      # x, marker, start flag
# Table 7 of the paper: R^2 averaged over 5 seeds (vanilla and LaS only; the ablations have none).
PAPER = {("select", "vanilla"): 0.971, ("cummax", "vanilla"): 1.0, ("cumsum", "vanilla"): 1.0,
         ("select", "las"): 0.783, ("cummax", "las"): 0.995, ("cumsum", "las"): 0.997}
TRAIN_STREAM, EVAL_STREAM = 0, 1


# ----------------------------------------------------------------------------- tasks

def targets(task: str, x: np.ndarray, marker: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(y, weight)`` float64 ``(n, L)`` of ``task`` for inputs ``x`` and markers ``(n, L)``;
    ``weight`` is 1 where the position counts in the loss and in R^2, else 0."""
    n, L = x.shape
    x = x.astype(np.float64)
    i = np.arange(L)
    if task == "cumsum":
        before = np.cumsum(x, axis=1) - x                        # sum_{j < i} x_j
        return before / np.sqrt(np.maximum(i, 1)), np.ones((n, L))
    if task == "cummax":
        return np.maximum.accumulate(x, axis=1), np.ones((n, L))
    if task == "select":
        p = np.argmax(marker, axis=1)                            # the one marked position
        chosen = x[np.arange(n), p]
        y = np.where(i[None, :] >= p[:, None], chosen[:, None], 0.0)
        return y, np.broadcast_to((i >= L // 2).astype(np.float64), (n, L)).copy()
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


@dataclasses.dataclass(frozen=True)
class Batch:
    feats: np.ndarray    # (n, L, FEATURES) float32: x, marker, start flag
    y: np.ndarray        # (n, L) float64 targets
    weight: np.ndarray   # (n, L) float64, 1 where the position is scored


def make_batch(task: str, rng: np.random.Generator, n: int, length: int) -> Batch:
    """``n`` sequences of ``task`` of length ``length`` drawn from ``rng``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if length < 2:
        raise ValueError(f"length must be at least 2, got {length}")
    x = rng.standard_normal((n, length)).astype(np.float32)   # the targets are of what the model sees
    marker = np.zeros((n, length))
    if task == "select":
        marker[np.arange(n), rng.integers(0, length // 2, size=n)] = 1.0
    start = np.zeros((n, length))
    start[:, 0] = 1.0
    y, w = targets(task, x, marker)
    return Batch(np.stack([x, marker, start], axis=-1).astype(np.float32), y, w)


def batch_at(task: str, seed: int, step: int, n: int, length: int) -> Batch:
    """Training batch ``step`` of run ``seed``: a pure function of its arguments."""
    return make_batch(task, np.random.default_rng([seed, TASKS.index(task), TRAIN_STREAM, step]), n, length)


def eval_set(task: str, seed: int, n: int, length: int) -> Batch:
    """The held-out set of run ``seed`` (another stream than every training batch)."""
    return make_batch(task, np.random.default_rng([seed, TASKS.index(task), EVAL_STREAM]), n, length)


def r2_score(y, pred, weight=None) -> float:
    """``1 - SS_res / SS_tot`` in float64 over every scored element (``weight`` 0/1 or
    non-negative weights; the mean is the weighted mean)."""
    y, pred = np.asarray(y, np.float64), np.asarray(pred, np.float64)
    w = np.ones_like(y) if weight is None else np.asarray(weight, np.float64)
    mean = (w * y).sum() / w.sum()
    return float(1.0 - (w * (y - pred) ** 2).sum() / (w * (y - mean) ** 2).sum())


# ----------------------------------------------------------------------------- model

@dataclasses.dataclass(frozen=True)
class Run:
    """One training run; the optimiser fields are those ``induction.train.optimizer`` reads."""

    task: str
    model: str
    seed: int = 0
    steps: int = 500
    batch_size: int = 50
    length: int = 64
    hidden: int = 64
    layers: int = 2
    heads: int = 8
    B: float = 1e-3
    P: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.01
    clip: float = 1.0
    warmup: int = 0               # 0: 5% of the steps

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")

    @property
    def warmup_steps(self) -> int:
        return self.warmup or max(1, self.steps // 20)

    @property
    def config(self) -> las.Config:
        return las.Config.variant(self.model, pool=self.P, vocab_size=1, hidden_size=self.hidden,
                                  num_hidden_layers=self.layers, num_attention_heads=self.heads, B=self.B,
                                  num_labels=1, classifier_pooling="last")


def init_params(run: Run) -> dict:
    """The LaS stack's parameters (``las.init_params``, token embeddings dropped) and the input
    projection ``in_proj`` (``N(0, 1/fan_in)``, zero bias), all from ``run.seed``."""
    params = las.init_params(run.config, run.seed)
    params.pop("embeddings")
    g = np.random.default_rng([run.seed, 1])
    params["in_proj.weight"] = jnp.asarray(fan_in_normal((run.hidden, FEATURES), g), jnp.float32)
    params["in_proj.bias"] = jnp.zeros((run.hidden,), jnp.float32)
    return params


def forward(params: dict, feats, cfg: las.Config):
    """``feats (n, L, FEATURES) -> (n, L)`` predictions."""
    h = linear(feats, params["in_proj.weight"], params["in_proj.bias"])
    return las.head(params, las.stack_forward(params["layers"], h, cfg), cfg)[..., 0]


def mse(params, feats, y, weight, cfg):
    """Weighted mean squared error over the scored positions."""
    err = forward(params, feats, cfg) - y
    return (weight * err ** 2).sum() / weight.sum()


@functools.lru_cache(maxsize=8)
def make_step(run: Run):
    """``step(state, feats, y, weight) -> (state, loss)``, jit-compiled."""
    cfg, opt = run.config, optimizer(run)

    @jax.jit
    def step(state, feats, y, weight):
        loss, g = jax.value_and_grad(mse)(state["params"], feats, y, weight, cfg)
        upd, opt_state = opt.update(g, state["opt"], state["params"])
        return {"params": jax.tree.map(jnp.add, state["params"], upd), "opt": opt_state}, loss

    return step


def device_batch(b: Batch):
    return jnp.asarray(b.feats), jnp.asarray(b.y, jnp.float32), jnp.asarray(b.weight, jnp.float32)


def train(run: Run, log_every: int = 100) -> dict:
    """Train ``run`` from scratch: ``{"params", "losses" [(step, loss)], "seconds"}``."""
    params = init_params(run)
    state = {"params": params, "opt": optimizer(run).init(params)}
    step = make_step(run)
    losses, t0 = [], time.perf_counter()
    for t in range(run.steps):
        state, loss = step(state, *device_batch(batch_at(run.task, run.seed, t, run.batch_size, run.length)))
        if (t + 1) % log_every == 0 or t + 1 == run.steps:
            losses.append((t + 1, float(loss)))
    jax.block_until_ready(state)
    return {"params": state["params"], "losses": losses, "seconds": time.perf_counter() - t0}


def evaluate(run: Run, params, n: int = 500, chunk: int = 100) -> float:
    """Held-out R^2 (float64) of ``params`` on ``n`` fresh sequences."""
    b = eval_set(run.task, run.seed, n, run.length)
    fwd = jax.jit(forward, static_argnames=("cfg",))
    pred = np.concatenate([np.asarray(fwd(params, jnp.asarray(b.feats[k:k + chunk]), run.config))
                           for k in range(0, n, chunk)])
    return r2_score(b.y, pred, b.weight)


# ----------------------------------------------------------------------------- report

def summarize(runs: list[dict], tasks, models) -> list[dict]:
    """One row per (task, model): R^2 mean ± std (population std over the seeds run)."""
    rows = []
    for task in tasks:
        for model in models:
            r = [x["r2"] for x in runs if x["task"] == task and x["model"] == model]
            if not r:
                continue
            rows.append({"task": task, "model": model, "seeds": len(r), "r2_mean": float(np.mean(r)),
                         "r2_std": float(np.std(r)), "r2_min": float(np.min(r)), "paper": PAPER.get((task, model)),
                         "r2_per_seed": " ".join(f"{v:.3f}" for v in r)})
    return rows


def previous_runs(path, settings: dict) -> dict:
    """``{(task, model, seed): run}`` of an earlier results file written with the same
    ``settings`` (the seed count aside); ``ValueError`` if they differ. None there: ``{}``."""
    if not path.is_file():
        return {}
    meta = json.loads(path.read_text())["meta"]
    old, new = ({k: v for k, v in d.items() if k != "seeds"} for d in (meta["settings"], settings))
    if old != new:
        raise ValueError(f"{path} was written with other settings: {old} (now {new})")
    return {(r["task"], r["model"], r["seed"]): r for r in meta["runs"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps (200) and 3 seeds unless given")
    ap.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 5, --quick 3)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=MODELS,
                    help="vanilla, las and the ablations l_attention (ELD only), s_attention (AP only)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 500, --quick 200)")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--eval", type=int, default=500, help="held-out sequences per run")
    ap.add_argument("--B", type=float, default=1e-3, help="LaS's B (the ELD rates; Tab. 9: 1e-3, 1e-4)")
    ap.add_argument("--P", type=int, default=3, help="LaS's pooling window (Tab. 9: 3, 5)")
    ap.add_argument("--name", default=None, help="results name (default las_atomic[_quick])")
    ap.add_argument("--seed-list", type=int, nargs="+", default=None,
                    help="run these seeds only (e.g. one seed per process)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in results/NAME.json (same settings but the seed count)")
    a = ap.parse_args(argv)
    seeds = a.seeds or (3 if a.quick else 5)
    steps = a.steps or (200 if a.quick else 500)
    name = a.name or ("las_atomic_quick" if a.quick else "las_atomic")
    base = Run(task=a.tasks[0], model=a.models[0], steps=steps, length=a.length, B=a.B, P=a.P)
    settings = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("task", "model", "seed")}
    settings.update(eval_sequences=a.eval, seeds=seeds)
    done = previous_runs(RESULTS / f"{name}.json", settings) if a.resume else {}
    runs = []
    total = len(a.tasks) * len(a.models) * (len(a.seed_list) if a.seed_list is not None else seeds)
    seed_list = a.seed_list if a.seed_list is not None else list(range(seeds))
    for task in a.tasks:
        for seed in seed_list:
            for model in a.models:
                if (task, model, seed) in done:
                    runs.append(done[task, model, seed])
                    continue
                run = dataclasses.replace(base, task=task, model=model, seed=seed)
                res = train(run)
                r2 = evaluate(run, res["params"], a.eval)
                runs.append({"task": task, "model": model, "seed": seed, "r2": r2, "seconds": res["seconds"],
                             "final_loss": res["losses"][-1][1], "losses": res["losses"]})
                print(f"{task} {model} seed {seed}: R^2 {r2:.4f}, loss {res['losses'][-1][1]:.4g}, "
                      f"{res['seconds']:.0f} s", file=sys.stderr, flush=True)
                meta = {"settings": settings, "complete": len(runs) == total, "runs": runs,
                        "paper": "Zimerman & Wolf, Table 7 (R^2, mean over 5 seeds)"}
                write_results(name, summarize(runs, a.tasks, a.models), meta,
                              columns=["task", "model", "seeds", "r2_mean", "r2_std", "r2_min", "paper",
                                       "r2_per_seed"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
