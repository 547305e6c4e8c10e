"""``apply`` (and so ``relative_error()``, the exactness self-check) and ``materialize`` of one
channel, against the same work done block by block through ``materialize``, each case in a
fresh process:

* for a layer of each kind of core (the operator of a random model of the family's benchmark
  shape on a random unit-RMS mixer input, ``cores.layer_operator``) at L = 2048 (``--quick``:
  the quick shapes at L = 256);
* **ours**: ``op.relative_error()``: ``apply`` forms ``H`` ``dispatch.APPLY_BUDGET`` elements at a
  time (the default ``impl``) in one compiled loop, a block's head matrices formed for the heads
  its channels touch. ``first_s`` is the first call in a fresh process (compiling, and touching
  fresh memory, included), ``seconds`` the steady state (``cores.steady_seconds``: the median of
  three more calls, of 15 for calls under 50 ms);
* **baseline**: the same blocks applied one ``op.materialize(block)`` at a time (concrete
  channels: one compiled program per block), then ``base.applied_block``: how ``apply`` worked
  before 2026-12-05, written with public calls. (``materialize`` itself forms only the touched
  heads now, so this baseline is faster than the code before that day was.)
* **one channel**: ``op.materialize([C // 2])``, first call and steady state, and its peak memory
  (before 2026-12-05 the CPU kernel formed every head's matrix for it);
* **one head's XLA reduce** (the cores with per-head matrices, ``HeadMatrixCore``): ``op.reduce(
  "abs_mean", channels=<head H // 2's>, impl="xla")``, what ``explain.head_maps`` runs per head
  where no kernel is trusted (a GPU), against the same ``dispatch.blocked_reduce_jit`` with every
  head's matrix computed before its loop (how it ran before 2026-12-05); steady state of each.

    python -m benchmarks.apply [--quick]
"""
from __future__ import annotations

import argparse

from benchmarks.common import isolated, peak_mb_of, write_results

# (label, model_type, layer), as benchmarks.cores names them
CASES = [
    ("StateDecayCore (Mamba-1)", "mamba", 0),
    ("Mamba2Core (Mamba-2)", "mamba2", 0),
    ("DplrCore (RWKV-6)", "rwkv6", 0),
    ("DeltaRuleCore (Qwen3-Next Gated DeltaNet)", "qwen3_next", 0),
    ("AttentionCore (RecurrentGemma local attention)", "recurrent_gemma", 2),
]


def blockwise_apply(op):
    """``H @ values + offset`` of every channel (head), ``materialize`` called once per block of
    ``dispatch.APPLY_BUDGET`` elements with concrete channels: ``(B, C, L)`` (``(B, H, L, d)``)."""
    import jax.numpy as jnp
    import numpy as np

    from implicit_attn.operator import base, dispatch

    B, C, L, _ = op.shape
    spec = "bcij,bcj->bci" if op.values.ndim == 3 else "bhij,bhjd->bhid"
    step = max(1, dispatch.APPLY_BUDGET // (B * L * L))
    idx = np.arange(C)
    return jnp.concatenate([base.applied_block(spec, op.materialize(idx[s:s + step]), op.values, op.offset,
                                               jnp.asarray(idx[s:s + step])) for s in range(0, C, step)], axis=1)


def case(model_type: str, layer: int, L: int, what: str, quick: bool = False) -> dict:
    """One case in this (fresh) process: ``what`` is ``"ours"`` (``relative_error()``),
    ``"baseline"`` (``blockwise_apply``) or ``"one_channel"`` (``materialize([C // 2])``)."""
    import time

    from benchmarks.cores import layer_operator, steady_seconds
    from implicit_attn.operator import HeadMatrixCore, resolve_impl
    from implicit_attn.operator.base import relative_error

    op = layer_operator(model_type, layer, L, quick)
    C = op.shape[1]
    if what.startswith("head_reduce"):
        if not isinstance(op.core, HeadMatrixCore):
            return {}
        fn = head_reduce(op, what == "head_reduce_baseline")
    else:
        fn = {"ours": lambda: op.relative_error(), "one_channel": lambda: op.materialize([C // 2]),
              "baseline": lambda: relative_error(blockwise_apply(op), op.output)}[what]
    t = time.perf_counter()
    peak = peak_mb_of(fn)
    first = time.perf_counter() - t
    out = fn()
    return {"first_s": first, "seconds": steady_seconds(fn, 3), "peak_mb": peak, "channels": C,
            "error": float(out) if what in ("ours", "baseline") else None, "core": type(op.core).__name__,
            "impl": resolve_impl("auto", op.core)}


def head_reduce(op, every_head: bool):
    """``() -> (B, L, L)``: the channel mean of ``|H|`` over head ``H // 2``'s channels by XLA, as
    ``op.reduce("abs_mean", channels=..., impl="xla")`` runs it, or (``every_head``) with every
    head's matrix computed before the loop (``heads=None`` for traced channels)."""
    import jax.numpy as jnp
    import numpy as np

    from implicit_attn.operator import block_size, dispatch

    B, C, L, _ = op.shape
    P = C // op.core.num_heads
    chans = np.arange(P * (op.core.num_heads // 2), P * (op.core.num_heads // 2 + 1))
    if not every_head:
        return lambda: op.reduce("abs_mean", channels=chans, impl="xla").block_until_ready()
    qw, kw = jnp.full((B, P, L), 1.0 / P, jnp.float32), jnp.ones((B, P, L), jnp.float32)
    bc = block_size(P, B, L, None)
    return lambda: dispatch.blocked_reduce_jit(op.core, jnp.asarray(chans), qw, kw, "abs_mean", bc).block_until_ready()


def main(quick: bool = False) -> list[dict]:
    L = 256 if quick else 2048
    rows = []
    for label, fam, layer in CASES:
        r = {w: isolated("benchmarks.apply:case", model_type=fam, layer=layer, L=L, what=w, quick=quick)
             for w in ("ours", "baseline", "one_channel", "head_reduce", "head_reduce_baseline")}
        ours, base, one = r["ours"], r["baseline"], r["one_channel"]
        head, head_base = r["head_reduce"], r["head_reduce_baseline"]
        rows.append({"case": label, "channels": ours["channels"], "impl": ours["impl"], "L": L,
                     "ours_first_s": ours["first_s"], "ours_s": ours["seconds"], "ours_peak_mb": ours["peak_mb"],
                     "baseline_first_s": base["first_s"], "baseline_s": base["seconds"],
                     "baseline_peak_mb": base["peak_mb"], "first_speedup": base["first_s"] / ours["first_s"],
                     "speedup": base["seconds"] / ours["seconds"], "relative_error": ours["error"],
                     "baseline_error": base["error"], "one_channel_first_s": one["first_s"],
                     "one_channel_s": one["seconds"], "one_channel_peak_mb": one["peak_mb"],
                     "head_reduce_xla_s": head.get("seconds"), "head_reduce_every_head_s": head_base.get("seconds"),
                     "head_reduce_speedup": head and head_base["seconds"] / head["seconds"] or None})
    write_results("apply_quick" if quick else "apply", rows,
                  columns=["case", "channels", "impl", "L", "ours_first_s", "ours_s", "ours_peak_mb",
                           "baseline_first_s", "baseline_s", "baseline_peak_mb", "first_speedup", "speedup",
                           "relative_error", "baseline_error", "one_channel_first_s", "one_channel_s",
                           "one_channel_peak_mb", "head_reduce_xla_s", "head_reduce_every_head_s",
                           "head_reduce_speedup"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the families' quick benchmark shapes, L = 256")
    main(ap.parse_args().quick)
