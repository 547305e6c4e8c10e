"""``explain(method="attribution")`` on the families whose recurrence has a reverse-mode kernel (the DPLR
kernel's: RWKV-5/6/7, the gated delta rule, the mLSTM; Mamba-1's selective scan: Mamba, Jamba; Mamba-2's
SSD: Mamba-2, Bamba): its
gradients' reverse mode by the recurrence's own backward kernel (the
default, with the residual stream's cotangent formed once per layer boundary:
``nn.hooks.between_layers``) against the transpose of its XLA reference with XLA's own backward
(``$IMPLICIT_ATTN_KERNEL_REVERSE=0``, the library before both), each in a fresh process.

Per family and mode: the first call (tracing and compiling included), the steady state (median of
``--repeat`` later calls) and the XLA compile seconds of the first call (JAX's
``backend_compile`` events); the model is ``benchmarks.forward``'s (the family's ``bench`` shape,
random weights written and loaded as a checkpoint), one example of ``L`` tokens. The two modes'
gradients must agree (``max_rel_diff``: the largest difference of the logit's gradients at the
layers' mixer outputs, the weights of the attribution maps, over their largest entry), and the
processes alternate (kernel, reference, kernel, ...) so a machine whose speed
drifts slows both alike.

    python -m benchmarks.gradients [--quick] [--only rwkv6,qwen3_next] [--L 512] [--repeat 3]
"""
from __future__ import annotations

import collections
import os
import subprocess
import tempfile
import time

import numpy as np

from benchmarks.common import (block, family_parser, isolated, only_families, replace_rows, rows_over_families,
                               timeit, write_results)

COLUMNS = ["family", "L", "kernel_first_s", "reference_first_s", "first_speedup", "kernel_compile_s",
           "reference_compile_s", "kernel_s", "reference_s", "speedup", "max_rel_diff", "note", "date"]
# A mode's process past this many seconds is stopped and its columns left empty (a note says so).
TIMEOUT_S = 300
DEFAULT_FAMILIES = ("rwkv5", "rwkv6", "rwkv7", "qwen3_next", "kimi_linear", "xlstm", "mamba", "jamba", "mamba2",
                    "bamba")
MODE_ENV = "IMPLICIT_ATTN_KERNEL_REVERSE"


def explain_times(family: str, quick: bool, L: int, repeat: int, grads_path: str) -> dict:
    """In this (fresh) process: the first ``explain(method="attribution")`` on ``family``'s benchmark
    model and the median of ``repeat`` more; then the logit's gradients at every layer's mixer output
    (``explain.methods.output_gradients``), flattened into ``grads_path`` (``.npy``)."""
    import jax
    import jax.monitoring

    import implicit_attn as ia
    from benchmarks.forward import random_ids, write_checkpoint
    from implicit_attn.explain.methods import explain, output_gradients

    compile_s = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compile_s.update({event: seconds}))
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(family, d, quick)
        model = ia.load(d)
    ids = random_ids(model.config.vocab_size, L)
    run = lambda: explain(model, ids, method="attribution")
    t = time.perf_counter()
    block(run())
    first_s = time.perf_counter() - t
    compiled = compile_s["/jax/core/compile/backend_compile_duration"]
    steady_s = timeit(run, repeat=repeat, warmup=0)
    grads, _, _ = output_gradients(model, ids)  # what the maps are weighted by (they are normalised)
    np.save(grads_path, np.concatenate([np.asarray(grads[l], np.float64).ravel() for l in sorted(grads)]))
    return {"first_s": first_s, "compile_s": compiled, "steady_s": steady_s}


def family_row(family: str, quick: bool, L: int, repeat: int, timeout: float = TIMEOUT_S) -> dict:
    """One family's row: both modes in fresh processes, alternating; a mode whose process runs past
    ``timeout`` seconds is stopped and left out (``note``)."""
    out, grads, notes = {}, {}, []
    with tempfile.TemporaryDirectory() as d:
        for mode, flag in (("kernel", "1"), ("reference", "0")):
            os.environ[MODE_ENV] = flag
            try:
                path = f"{d}/{mode}.npy"
                out[mode] = isolated("benchmarks.gradients:explain_times", timeout=timeout, family=family,
                                     quick=quick, L=L, repeat=repeat, grads_path=path)
                grads[mode] = np.load(path)
            except subprocess.TimeoutExpired:
                out[mode] = {"first_s": None, "compile_s": None, "steady_s": None}
                notes.append(f"{mode} mode stopped after {timeout:.0f} s")
            finally:
                os.environ.pop(MODE_ENV, None)
    k, r = out["kernel"], out["reference"]
    ratio = lambda a, b: a / b if a is not None and b is not None else None
    diff = (float(np.abs(grads["kernel"] - grads["reference"]).max() / np.abs(grads["reference"]).max())
            if len(grads) == 2 else None)
    return {"family": family, "L": L, "kernel_first_s": k["first_s"], "reference_first_s": r["first_s"],
            "first_speedup": ratio(r["first_s"], k["first_s"]), "kernel_compile_s": k["compile_s"],
            "reference_compile_s": r["compile_s"], "kernel_s": k["steady_s"], "reference_s": r["steady_s"],
            "speedup": ratio(r["steady_s"], k["steady_s"]), "max_rel_diff": diff, "note": "; ".join(notes),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def main(quick: bool = False, only=None, L: int | None = None, repeat: int = 3) -> list[dict]:
    families = only or (DEFAULT_FAMILIES[1:2] + DEFAULT_FAMILIES[3:4] if quick else DEFAULT_FAMILIES)
    L = L or (128 if quick else 512)
    rows = rows_over_families(families, lambda f: [family_row(f, quick, L, repeat)])
    if only:  # the other families' rows kept
        rows = replace_rows("gradients_quick" if quick else "gradients", rows)
    write_results("gradients_quick" if quick else "gradients", rows, columns=COLUMNS)
    return rows


if __name__ == "__main__":
    ap = family_parser(__doc__, DEFAULT_FAMILIES, "the families' quick shapes, L = 128, RWKV-6 and Qwen3-Next")
    ap.add_argument("--L", type=int, default=None, help="tokens (default 512; 128 with --quick)")
    ap.add_argument("--repeat", type=int, default=3, help="steady-state calls timed (default 3)")
    a = ap.parse_args()
    main(a.quick, only_families(a.only), a.L, a.repeat)
