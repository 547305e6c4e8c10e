"""Every core's ``materialize`` and ``reduce("mean")`` against the roofline bound, measured as
``benchmarks.suite`` measures Mamba-1's, every case in a fresh process:

* for each core type a registry family uses, the operator of one layer of a random model of
  the family's benchmark shape (``FamilySpec.bench``: mamba-130m-like widths) on a random
  unit-RMS mixer input, at L = 512, with the default ``impl`` (the fused CPU kernel where the
  core has one, XLA otherwise); LaS attention (``models.las``, our own model) at 12 heads
  of 64; and a ``ScalarDecayCore`` with ``q k^T`` groups, which no family builds (random factors at
  Mamba-2-130m's widths, each head a group with its own ``q, k``);
* **bound** ``max(fill, flops / rate)``: ``fill`` the time JAX takes to produce a fresh array
  of the output's size, ``rate`` the measured float32 matmul FLOP/s, ``flops`` the core's
  necessary work (``necessary_flops``: the contractions every causal entry needs; a head's
  matrix is counted once for its channels, pure gathers and softmaxes count 0, so the bound is
  the fill there; ``reduce`` adds each channel's conv taps and weighting, ``reduce_flops``);
* **fraction** ``bound / time`` and its ratio to the Mamba-1 kernel's fraction in the same run
  (target: ratio >= 0.5, within 2x of Mamba-1);
* **fraction_tight**, **vs_mamba1_tight**: the same with the faster of that fill and the kernel
  library's (huge pages, every thread, as the kernels write): XLA's fill is slow enough that
  Mamba-1's kernel, whose output is fill-bound, runs at 1.3-2.4 of the first bound, which a
  product-bound core (local attention) cannot match;
* **scaling**: ``reduce("mean")`` of Mamba-1 and Mamba-2 up to L = 8192 (time, peak memory,
  fitted exponents over L >= 1024).

Pin it for timings: ``taskset -c 1`` (the kernel's threads and XLA follow the affinity).

    python -m benchmarks.cores [--quick]
"""
from __future__ import annotations

import argparse

from benchmarks.common import fill_seconds, isolated, peak_mb_of, timeit, write_results

# (label, model_type, layer): the first layer of that kind in the family's benchmark shape.
CASES = [
    ("StateDecayCore (Mamba-1)", "mamba", 0),
    ("Mamba2Core (Mamba-2)", "mamba2", 0),
    ("ScalarDecayCore (RecurrentGemma RG-LRU)", "recurrent_gemma", 0),
    ("AttentionCore (RecurrentGemma local attention)", "recurrent_gemma", 2),
    ("RwkvCore (RWKV-4)", "rwkv", 0),
    ("DeltaRuleCore (Qwen3-Next Gated DeltaNet)", "qwen3_next", 0),
    ("DplrCore (RWKV-6)", "rwkv6", 0),
    ("DplrCore (RWKV-7)", "rwkv7", 0),
    ("MlstmCore (xLSTM)", "xlstm", 0),
    ("ShortConvCore (LFM2)", "lfm2", 0),
    ("ParallelCore (Falcon-H1 Mamba-2 + attention)", "falcon_h1", 0),
    ("LaSCore (LaS attention, ELD and pooling P = 3)", "las_transformer", 0),
    ("ScalarDecayCore with q k^T groups (random, 24 groups of 64 channels)", "scalar_decay_low_rank", 0),
]
# LaS attention is our own model, not a registry family: a GPT-2-small-wide layer (12 heads of 64)
LAS_SHAPES = {"full": dict(hidden_size=768, num_attention_heads=12), "quick": dict(hidden_size=64,
                                                                                    num_attention_heads=4)}
# The low-rank ScalarDecayCore: Mamba-2-130m's 24 heads of 64 channels and state 128, a group per head
LOW_RANK = "scalar_decay_low_rank"
LOW_RANK_SHAPES = {"full": dict(groups=24, channels=1536, state=128), "quick": dict(groups=4, channels=64, state=16)}


def low_rank_operator(L: int, groups: int, channels: int, state: int, conv: int = 4):
    """An operator of random factors with a ``ScalarDecayCore`` of ``groups`` groups of ``channels //
    groups`` channels, each group's ``q, k (1, G, L, state)``, the decays' logs in ``[-0.1, 0)``, both
    scalings, a diagonal and a conv of ``conv`` taps."""
    import jax.numpy as jnp
    import numpy as np

    from implicit_attn.operator import ImplicitOperator, ScalarDecayCore

    r = np.random.default_rng(1)
    f = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.float32)
    C, G = channels, groups
    core = ScalarDecayCore(log_a=-0.1 * jnp.asarray(r.random((1, G, L)), jnp.float32), group=jnp.arange(C) // (C // G),
                           q=f(1, G, L, state) * state ** -0.5, k=f(1, G, L, state), left=f(1, C, L),
                           right=f(1, C, L), diag=f(1, C, L), conv_w=f(C, conv))
    v = f(1, C, L)
    return ImplicitOperator(values=v, offset=jnp.zeros_like(v), output=v, core=core)


def fit_exponent(xs, ys) -> float:
    """Slope of ``log y`` against ``log x`` (least squares)."""
    import numpy as np

    return float(np.polyfit(np.log(xs), np.log(np.maximum(ys, 1e-9)), 1)[0])


def layer_operator(model_type: str, layer: int, L: int, quick: bool = False):
    """Layer ``layer``'s operator of a random model of ``model_type``'s benchmark shape
    (``--quick``: its quick one) for a random unit-RMS mixer input ``(1, L, d_model)``
    (what the block's pre-norm hands the mixer), so no full-model forward is compiled (except
    for a mixer whose input is not that: the model's own forward on random ids)."""
    import jax
    import numpy as np

    from implicit_attn.models import las
    from implicit_attn.registry import family

    x = np.random.default_rng(1).normal
    if model_type == LOW_RANK:
        return jax.block_until_ready(low_rank_operator(L, **LOW_RANK_SHAPES["quick" if quick else "full"]))
    if model_type == las.MODEL_TYPE:
        cfg = las.Config(vocab_size=2, num_hidden_layers=1, **LAS_SHAPES["quick" if quick else "full"])
        mixer = las.LaSMixer(cfg, las.init_params(cfg, 0)["layers"][layer]["mixer"])
        return jax.block_until_ready(mixer.as_operator(x(size=(1, L, cfg.hidden_size)).astype(np.float32)))
    spec = family(model_type)
    cfg = spec.config.from_hf(dict(spec.bench["quick" if quick else "full"]))
    model = spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(0)))
    mixer = model.layers[layer].mixer
    try:
        return jax.block_until_ready(mixer.as_operator(x(size=(1, L, cfg.hidden_size)).astype(np.float32)))
    except ValueError:  # a mixer that reads more than the residual (RWKV-7's value residual)
        ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, L))
        return jax.block_until_ready(model.operators(ids, [layer])[0])


def window_entries(L: int, window: int) -> int:
    """Causal entries ``j <= i`` with ``i - j < window`` of an ``L x L`` matrix: row ``i`` has
    ``min(i + 1, window)`` (``L (L + 1) / 2`` for ``window >= L``)."""
    w = min(L, window)
    return w * (w + 1) // 2 + (L - w) * w


def block_entries(L: int, chunk: int | None) -> int:
    """Causal entries ``j <= i`` with ``i`` and ``j`` in one block of ``chunk`` positions (LaS-chunk;
    None: one block, ``L (L + 1) / 2``)."""
    c = L if chunk is None else min(chunk, L)
    whole, rest = divmod(L, c)
    return whole * c * (c + 1) // 2 + rest * (rest + 1) // 2


def necessary_flops(core, L: int) -> float:
    """FLOPs ``materialize`` of ``core`` cannot avoid at length ``L``: the contraction behind
    every causal entry, a head's matrix once for all its channels (sandwiches, convs, gathers
    and softmax normalisation are elementwise: counted 0)."""
    from implicit_attn.operator import (AttentionCore, BidirectionalCore, DeltaRuleCore, DocumentMaskedCore,
                                        DplrCore, LaSCore, Mamba2Core, MlstmCore, ParallelCore,
                                        ScalarDecayCore, StateDecayCore)

    tri = L * (L + 1) / 2
    if isinstance(core, DocumentMaskedCore):
        return necessary_flops(core.inner, L)
    if isinstance(core, BidirectionalCore):
        return necessary_flops(core.forward, L) + necessary_flops(core.backward, L)
    if isinstance(core, ParallelCore):
        return sum(necessary_flops(p, L) for p in core.parts)  # a repeated channel is a copy
    if isinstance(core, StateDecayCore):
        return 2 * core.q.shape[-1] * core.num_channels * tri
    if isinstance(core, ScalarDecayCore):
        return 0.0 if core.q is None else 2 * core.q.shape[-1] * core.log_a.shape[1] * tri
    if isinstance(core, Mamba2Core):  # q k^T per group of B/C
        return 2 * core.q.shape[-1] * core.q.shape[1] * tri
    if isinstance(core, DplrCore):  # per head: q (k, a, b terms) with per-dimension decay
        terms = 1 if core.a is None else 3
        return 2 * core.q.shape[-1] * core.num_heads * tri * terms
    if isinstance(core, (DeltaRuleCore, MlstmCore)):  # per head (delta rule: plus the chunk solves)
        return 2 * core.q.shape[-1] * core.num_heads * tri
    if isinstance(core, AttentionCore):  # the causal entries the window reaches
        return 2 * core.q.shape[-1] * core.q.shape[1] * window_entries(L, core.window)
    if isinstance(core, LaSCore):  # the causal entries of each block (pooling is elementwise)
        return 2 * core.q.shape[-1] * core.q.shape[1] * block_entries(L, core.chunk)
    return 0.0  # RwkvCore, ShortConvCore: no contraction


def reduce_flops(core, L: int) -> float:
    """What ``reduce`` adds to ``necessary_flops``: every channel's causal entries combined over
    its conv taps and weighted into the sum, ``(2 K + 2) C L (L + 1) / 2`` (``K`` 1 without a conv;
    attention: the entries its window reaches, ``window_entries``; LaS: its blocks', ``block_entries``);
    a ``ParallelCore`` sums its parts' (each slot of a repeated channel weighted once)."""
    from implicit_attn.operator import AttentionCore, LaSCore, ParallelCore

    if isinstance(core, ParallelCore):  # each part with its own conv taps
        return sum(r * reduce_flops(p, L) for p, r in zip(core.parts, core.repeats))
    w = getattr(core, "conv_w", None)
    K = 1 if w is None else w.shape[-1]
    if isinstance(core, AttentionCore):
        entries = window_entries(L, core.window)
    else:
        entries = block_entries(L, core.chunk if isinstance(core, LaSCore) else None)
    return (2 * K + 2) * core.num_channels * entries


def steady_seconds(fn, repeat: int) -> float:
    """Median wall seconds of ``repeat`` calls of ``fn`` (compiled already), or, where one call
    takes under 50 ms, of 15 calls after a quarter second of further calls: the median of 3 calls
    of a few ms varied by a third between idle runs, and a fresh process's first calls after the
    compiling one run slow (local attention's ``materialize``: 2.0-4.5 ms in the first five, then
    1.6-1.7 ms)."""
    one = timeit(fn, repeat=1, warmup=0)
    if one >= 0.05:
        return timeit(fn, repeat=repeat, warmup=0)
    return timeit(fn, repeat=15, warm_s=0.25)


def case_rate() -> dict:
    """Float32 matmul FLOP/s (2048^3, as ``benchmarks.suite``)."""
    import jax
    import jax.numpy as jnp

    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    return {"flops_per_s": 2 * n ** 3 / timeit(lambda: mm(a), repeat=3)}


def case(model_type: str, layer: int, L: int, what: str, quick: bool = False, impl: str = "auto") -> dict:
    """One timed ``materialize()`` / ``reduce("mean")`` (steady state; the first call, which
    compiles, gives the peak memory), with the fill time of an array of its output's size."""
    from implicit_attn.operator import resolve_impl

    op = layer_operator(model_type, layer, L, quick)
    B, C, L, _ = op.shape
    out_shape = (B, C, L, L) if what == "materialize" else (B, L, L)
    fill = fill_seconds(out_shape, lambda f: steady_seconds(f, 3))
    fn = (lambda: op.materialize(impl=impl)) if what == "materialize" else (lambda: op.reduce("mean", impl=impl))
    peak = peak_mb_of(fn)
    sec = steady_seconds(fn, 3 if L <= 1024 else 1)
    flops = necessary_flops(op.core, L) + (reduce_flops(op.core, L) if what == "reduce" else 0.0)
    return {"seconds": sec, "peak_mb": peak, "fill_s": fill["xla"], "fill_kernel_s": fill["kernel"], "flops": flops,
            "channels": C,
            "core": type(op.core).__name__, "impl": resolve_impl(impl, op.core)}


def main(quick: bool = False) -> list[dict]:
    L = 128 if quick else 512
    rate = isolated("benchmarks.cores:case_rate")["flops_per_s"]
    rows, frac = [], {}
    for what in ("materialize", "reduce"):
        for label, fam, layer in CASES:
            r = isolated("benchmarks.cores:case", model_type=fam, layer=layer, L=L, what=what, quick=quick)
            f = max(r["fill_s"], r["flops"] / rate) / r["seconds"]
            fills = [r["fill_s"]] + ([] if r["fill_kernel_s"] is None else [r["fill_kernel_s"]])
            ft = max(min(fills), r["flops"] / rate) / r["seconds"]
            frac.setdefault(what, (f, ft))  # the first case is Mamba-1's kernel
            rows.append({"case": f"{what} {label}", "channels": r["channels"], "impl": r["impl"],
                         "L": L, "seconds": r["seconds"], "peak_mb": r["peak_mb"], "fill_s": r["fill_s"],
                         "fill_kernel_s": r["fill_kernel_s"], "flops_bound_s": r["flops"] / rate, "fraction": f,
                         "vs_mamba1": f / frac[what][0], "fraction_tight": ft, "vs_mamba1_tight": ft / frac[what][1],
                         "target": "vs_mamba1 >= 0.5"})
    Ls = [128, 256, 512] if quick else [512, 1024, 2048, 4096, 8192]
    for label, fam in (("Mamba-1", "mamba"), ("Mamba-2", "mamba2")):
        scal = [(n, isolated("benchmarks.cores:case", timeout=7200, model_type=fam, layer=0, L=n, what="reduce",
                             quick=quick)) for n in Ls]
        for n, r in scal:
            rows.append({"case": f"reduce {label} scaling", "channels": r["channels"], "impl": r["impl"], "L": n,
                         "seconds": r["seconds"], "peak_mb": r["peak_mb"],
                         "fraction": max(r["fill_s"], r["flops"] / rate) / r["seconds"]})
        big = [(n, r) for n, r in scal if n >= (256 if quick else 1024)]
        rows.append({"case": f"reduce {label} exponents (L >= {big[0][0]})",
                     "note": f"time ~ L^{fit_exponent([n for n, _ in big], [r['seconds'] for _, r in big]):.2f}, "
                             f"peak ~ L^{fit_exponent([n for n, _ in big], [r['peak_mb'] for _, r in big]):.2f}"})
    write_results("cores_quick" if quick else "cores", rows,
                  meta={"matmul_gflops": rate / 1e9},
                  columns=["case", "channels", "impl", "L", "seconds", "peak_mb", "fill_s", "fill_kernel_s",
                           "flops_bound_s", "fraction", "vs_mamba1", "fraction_tight", "vs_mamba1_tight", "target",
                           "note"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the families' quick benchmark shapes, L = 128")
    main(ap.parse_args().quick)
