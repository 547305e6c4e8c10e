"""Train one Table-2 configuration on the induction-head task.

    python -m benchmarks.induction.train --model mamba2 --key --steps 3000 --out runs/mamba2_key

AdamW (weight decay on matrices except A_log), linear warmup + cosine decay, gradient
clipping, a jit-compiled step, the loss (cross-entropy) on the last position only.
Batch ``t`` is ``induction.batch_at(seed, t, ...)`` (optionally shorter for the first
``--warm-steps`` steps: a length curriculum) and the parameters are initialised
from ``seed``, so a run is a pure function of its arguments. Orbax checkpoints are
written every ``--ckpt-every`` steps into ``OUT/ckpt``; rerunning the same command
resumes from the latest one and ends with exactly the parameters of an uninterrupted run
(the arguments are stored in ``OUT/run.json`` and must match).
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
import optax

from implicit_attn.demo import induction
from . import models


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: str
    key: bool
    steps: int
    batch_size: int = 32
    length: int = induction.LENGTH
    lr: float = 2e-3
    warmup: int = 0               # 0: 5% of the steps
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    warm_length: int = 0          # length curriculum: steps < warm_steps use warm_length
    warm_steps: int = 0

    def __post_init__(self):
        models.get_spec(self.model)
        for name in ("steps", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.warm_steps and not 4 <= self.warm_length <= self.length:
            raise ValueError(f"warm_length must be in [4, length={self.length}] when warm_steps > 0, "
                             f"got {self.warm_length}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")

    def length_at(self, step: int) -> int:
        """Sequence length of batch ``step`` (the curriculum)."""
        return self.warm_length if step < self.warm_steps else self.length

    def batch(self, step: int) -> induction.Batch:
        """Training batch ``step``: a pure function of (seed, step) and the task settings."""
        return induction.batch_at(self.seed, step, self.batch_size, self.length_at(step), self.key)

    @property
    def warmup_steps(self) -> int:
        return self.warmup or max(1, self.steps // 20)


def schedule(rc: RunConfig):
    """Linear warmup to ``lr`` then cosine decay to ``lr / 100`` at ``steps``."""
    return optax.warmup_cosine_decay_schedule(0.0, rc.lr, rc.warmup_steps, max(rc.steps, rc.warmup_steps + 1),
                                              end_value=rc.lr / 100)


def _decay_mask(params):
    def keep(path, x):
        name = jax.tree_util.keystr(path)
        return x.ndim >= 2 and "A_log" not in name and "embeddings" not in name
    return jax.tree_util.tree_map_with_path(keep, params)


def optimizer(rc: RunConfig):
    return optax.chain(optax.clip_by_global_norm(rc.clip),
                       optax.adamw(schedule(rc), weight_decay=rc.weight_decay, mask=_decay_mask))


def last_position_loss(params, ids, answer, spec):
    """Mean cross-entropy of the last position: ``ids (B, L)``, ``answer (B,)`` -> scalar."""
    logits = models.forward(params, ids, spec)[:, -1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, answer).mean()


@functools.lru_cache(maxsize=8)
def make_step(rc: RunConfig):
    """``step(state, ids, answer) -> (state, loss)``, jit-compiled; state = params, opt, step.
    Cached per configuration, so resuming in the same process does not recompile."""
    spec = models.get_spec(rc.model)
    opt = optimizer(rc)

    @jax.jit
    def step(state, ids, answer):
        loss, g = jax.value_and_grad(last_position_loss)(state["params"], ids, answer, spec)
        upd, opt_state = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], upd), "opt": opt_state,
                "step": state["step"] + 1}, loss

    return step


def init_state(rc: RunConfig) -> dict:
    params = models.init(models.get_spec(rc.model), jax.random.PRNGKey(rc.seed))
    return {"params": params, "opt": optimizer(rc).init(params), "step": jnp.asarray(0, jnp.int32)}


def _manager(out: Path, every: int):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every, create=True)
    return ocp.CheckpointManager((out / "ckpt").resolve(), options=opts)


def _check_run_file(out: Path, rc: RunConfig):
    f = out / "run.json"
    d = dataclasses.asdict(rc)
    if f.exists():
        old = dataclasses.asdict(RunConfig(**json.loads(f.read_text())["config"]))
        if old != d:
            diff = {k: (old.get(k), d[k]) for k in d if old.get(k) != d[k]}
            raise ValueError(f"{out} holds a run with other arguments {diff} (old, new); "
                             f"use another --out or the same arguments to resume")
    else:
        out.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"config": d}, indent=2))


def train(rc: RunConfig, out, ckpt_every: int = 500, stop_at: int | None = None, progress: bool = True,
          log_every: int = 50, deadline: float | None = None) -> dict:
    """Train (or resume) to ``rc.steps`` (or stop after step ``stop_at``, as an interruption
    would, or at the first step ending after the wall-clock time ``deadline`` (Unix seconds);
    a checkpoint is written where it stops). Returns ``{"params", "step", "losses" (this invocation's (step, loss) pairs),
    "seconds" (this invocation's training wall time), "resumed_from"}``."""
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    out = Path(out)
    if not isinstance(ckpt_every, int) or ckpt_every < 1:
        raise ValueError(f"ckpt_every must be a positive integer, got {ckpt_every!r}")
    _check_run_file(out, rc)
    mgr = _manager(out, ckpt_every)
    state = init_state(rc)
    resumed = mgr.latest_step()
    if resumed is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = mgr.restore(resumed, args=ocp.args.StandardRestore(abstract))
    start = int(state["step"])
    end = rc.steps if stop_at is None else min(rc.steps, stop_at)
    step = make_step(rc)
    losses = []
    t0 = time.perf_counter()
    bar = tqdm(range(start, end), desc=f"{rc.model}{' key' if rc.key else ''}", disable=not progress,
               initial=start, total=rc.steps, mininterval=2.0, file=sys.stderr)
    run_loss = None
    for t in bar:
        b = rc.batch(t)
        state, loss = step(state, b.ids, b.answer)
        if (t + 1) % log_every == 0 or t + 1 == end:
            lv = float(loss)
            losses.append((t + 1, lv))
            run_loss = lv if run_loss is None else 0.7 * run_loss + 0.3 * lv
            bar.set_postfix(loss=f"{run_loss:.3f}")
        if (t + 1) % ckpt_every == 0:
            mgr.save(t + 1, args=ocp.args.StandardSave(state))
        if deadline is not None and time.time() > deadline:
            end = t + 1
            break
    if end > start and mgr.latest_step() != end:
        mgr.save(end, args=ocp.args.StandardSave(state), force=True)
    mgr.wait_until_finished()
    mgr.close()
    jax.block_until_ready(state)
    return {"params": state["params"], "step": int(state["step"]), "losses": losses,
            "seconds": time.perf_counter() - t0, "resumed_from": resumed}


def load_run(out) -> tuple[RunConfig, dict]:
    """The run configuration and the latest checkpointed parameters of run directory ``out``."""
    out = Path(out)
    f = out / "run.json"
    if not f.is_file():
        raise FileNotFoundError(f"{out} is not a training run (no run.json)")
    rc = RunConfig(**json.loads(f.read_text())["config"])
    if _manager(out, 1).latest_step() is None:
        raise FileNotFoundError(f"{out} has no checkpoint yet")
    return rc, train(rc, out, stop_at=0, progress=False)["params"]


def accuracy(rc: RunConfig, params, n: int = 1000, eval_seed: int = 1234, batch_size: int = 100) -> float:
    """Accuracy on ``n`` fresh sequences of the evaluation stream."""
    spec = models.get_spec(rc.model)
    fwd = jax.jit(lambda p, ids: models.forward(p, ids, spec))
    return induction.evaluate(lambda ids: fwd(params, ids),
                              induction.eval_set(n, eval_seed, rc.length, rc.key), batch_size)


def _deadline(text):
    """``HH:MM`` (UTC, today) -> Unix seconds, or None."""
    if text is None:
        return None
    import datetime as dt

    try:
        h, m = (int(x) for x in text.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        return now.replace(hour=h, minute=m, second=0, microsecond=0).timestamp()
    except ValueError:
        raise SystemExit(f"--deadline must be HH:MM (UTC), got {text!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, choices=sorted(models.SPECS))
    ap.add_argument("--key", action="store_true", help="the task with the special key token")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--length", type=int, default=induction.LENGTH)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-length", type=int, default=0, help="curriculum: length of the first steps")
    ap.add_argument("--warm-steps", type=int, default=0, help="curriculum: how many steps at --warm-length")
    ap.add_argument("--out", required=True, help="run directory (checkpoints, run.json, result.json)")
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--eval", type=int, default=1000, help="fresh evaluation sequences")
    ap.add_argument("--deadline", default=None,
                    help="stop (with a checkpoint) after this UTC time, e.g. 16:05; rerun to continue")
    a = ap.parse_args(argv)
    rc = RunConfig(model=a.model, key=a.key, steps=a.steps, batch_size=a.batch_size, length=a.length,
                   lr=a.lr, seed=a.seed, warm_length=a.warm_length, warm_steps=a.warm_steps)
    out = Path(a.out)
    res = train(rc, out, a.ckpt_every, deadline=_deadline(a.deadline))
    acc = accuracy(rc, res["params"], a.eval)
    rf = out / "result.json"
    prev = json.loads(rf.read_text()) if rf.exists() else {"seconds": 0.0, "losses": []}
    result = {"config": dataclasses.asdict(rc), "accuracy": acc, "eval_n": a.eval,
              "seconds": prev["seconds"] + res["seconds"], "losses": prev["losses"] + res["losses"],
              "steps": res["step"], "completed": res["step"] == rc.steps}
    rf.write_text(json.dumps(result, indent=1))
    print(f"{rc.model} key={rc.key}: {res['step']} steps, {result['seconds']:.0f} s, "
          f"accuracy {acc:.3f} on {a.eval} fresh sequences")
    return 0


if __name__ == "__main__":
    sys.exit(main())
