"""What runs on this machine's default JAX backend: forward, operators, and materialize /
reduce with every impl, for one tiny random model of every registered family; the kernels
are checked against impl="xla".

    python -m benchmarks.accelerator_probe [--only mamba,rwkv7] [--out probe.json]

Prints a JSON report (``{model_type: {check: "ok ..." | "FAIL ..." | "OFF ..."}}``; ``OFF``: an
operator's exactness or a kernel's difference from XLA above ``TOL``) at the end and, with
``--out``, rewrites that file after each family, so a run cut short keeps what it found.
Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from implicit_attn.registry import FAMILIES

TOL = 1e-5  # float32 rounding; TF32 products give 1e-4 .. 1e-3


def graded(what: str, value: float) -> str:
    return f"{'ok' if value <= TOL else 'OFF'} {what} {value:.1e}"


def failure(e: Exception) -> str:
    return f"FAIL {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def probe_family(spec, L: int) -> dict:
    """``{check: result}`` for one family's tiny random model on ``(2, L)`` random ids."""
    cfg = spec.config.from_hf(spec.tiny)
    model = spec.lm(cfg, spec.init_params(cfg, 0))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, L))
    r = {}
    t = time.perf_counter()
    jax.block_until_ready(model(ids))
    r["forward"] = f"ok {time.perf_counter() - t:.1f}s"
    for i, op in enumerate(model.operators(ids)):
        name = f"layer {i} {type(op.core).__name__}"
        r[f"{name} exactness"] = graded("rel", op.relative_error())
        for what in ("materialize", "reduce"):
            run = (lambda impl: op.materialize(impl=impl)) if what == "materialize" else (
                lambda impl: op.reduce("abs_mean", impl=impl))
            ref = run("xla")
            for impl in ("auto", "pallas"):
                try:
                    out = run(impl)
                    err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                    r[f"{name} {what} {impl}"] = graded("rel", err)
                except Exception as e:  # a report of what fails, not a fallback
                    r[f"{name} {what} {impl}"] = failure(e)
    return r


def probe(L: int = 37, only=None, out: Path | None = None) -> dict:
    """The report for ``only`` (model types; None: every registered family) on the default
    backend, one family after another."""
    res = {"jax": jax.__version__, "devices": [f"{d} ({d.device_kind})" for d in jax.devices()]}
    for mt in only or FAMILIES:
        t = time.perf_counter()
        try:
            res[mt] = probe_family(FAMILIES[mt], L)
        except Exception as e:  # the family's forward or XLA path failed: report, go on
            res[mt] = {"probe": failure(e)}
        bad = sum(str(v).startswith(("FAIL", "OFF")) for v in res[mt].values())
        print(f"{mt}: {time.perf_counter() - t:.1f}s, {bad} failed or off", file=sys.stderr, flush=True)
        if out:
            out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated model_types (default: every registered family)")
    ap.add_argument("--out", type=Path, help="also write the report here, after each family")
    a = ap.parse_args()
    only = [s for s in a.only.split(",") if s] or None
    unknown = sorted(set(only or ()) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown model types {unknown}; registered: {', '.join(FAMILIES)}")
    print(json.dumps(probe(only=only, out=a.out), indent=1))
