"""What runs on this machine's default JAX backend: forward, operators, and materialize /
reduce with every impl, for one tiny random model of every registered family; the kernels
are checked against impl="xla".

    python -m benchmarks.accelerator_probe      # prints a JSON report
"""
from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from implicit_attn.registry import FAMILIES


def probe(L: int = 37) -> dict:
    """``{model_type: {check: "ok ..." | "FAIL ..."}}`` on the default backend."""
    res = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
    for mt, spec in FAMILIES.items():
        cfg = spec.config.from_hf(spec.tiny)
        model = spec.lm(cfg, spec.init_params(cfg, 0))
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, L))
        r = res[mt] = {}
        t = time.perf_counter()
        jax.block_until_ready(model(ids))
        r["forward"] = f"ok {time.perf_counter() - t:.1f}s"
        for i, op in enumerate(model.operators(ids)):
            name = f"layer {i} {type(op.core).__name__}"
            r[f"{name} exactness"] = f"{op.relative_error():.1e}"
            for what in ("materialize", "reduce"):
                run = (lambda impl: op.materialize(impl=impl)) if what == "materialize" else (
                    lambda impl: op.reduce("abs_mean", impl=impl))
                ref = run("xla")
                for impl in ("auto", "pallas"):
                    try:
                        out = run(impl)
                        err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                        r[f"{name} {what} {impl}"] = f"ok rel {err:.1e}"
                    except Exception as e:  # a report of what fails, not a fallback
                        r[f"{name} {what} {impl}"] = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return res


if __name__ == "__main__":
    print(json.dumps(probe(), indent=1))
