"""Baselines and bounds for ``materialize`` on one mamba-130m-shaped layer (1536 channels,
N 16), every case in a fresh process:

* **loop baseline** — the papers' reference algorithm re-implemented faithfully in torch:
  Python loops over query and key positions, the decay as a cumulative product of the
  discretised A, vectorised over channels and states only (as the published code does);
* **ours** — ``materialize`` with the default ``impl`` (the fused CPU kernel on CPU, which
  asks for huge pages on its output), and ``impl="xla"`` and no huge pages for reference;
* **roofline** — how long JAX takes to produce a fresh array of the output's size (a jitted
  fill: on this machine fresh-page faults, not bandwidth, dominate) and the float32 matmul
  FLOP/s, giving the bound ``max(fill time, flops / FLOP/s)`` that ``materialize`` is
  reported against; and a tighter one with the kernel library's fill (huge pages, every
  thread, as the kernel writes its output), which the kernel cannot beat the way it beats
  XLA's fill, timed once in its own process and once in turn with ``materialize`` in one
  process (the machine's speed drifts between processes);
* **scaling** — ``reduce("mean")`` of the layer from L = 256 upward: time, peak memory, and
  the fitted exponents.

``--isa avx2`` runs every case as an AVX2 CPU without AVX-512 would (Haswell to Zen 3):
XLA's code generation capped at AVX2 (``--xla_cpu_max_isa``), the fused kernel built with
``-march=haswell`` (``$IMPLICIT_ATTN_CPU_ARCH``), torch's kernels and MKL capped at AVX2
(``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``), oneDNN too; results go to
``suite_avx2``. It changes the instructions, not the machine's memory or clock.

    python -m benchmarks.suite [--quick] [--isa avx2]
"""
from __future__ import annotations

import argparse
import math
import os

from benchmarks.common import fill_seconds, isolated, paired_seconds, peak_mb_of, timeit, write_results
from benchmarks.mamba import SHAPE, layer_operator


def loop_reference(dA, dBu_factor, Cm):
    """The papers' algorithm: for each query i and key j <= i, the decay product over
    k = j+1..i of the discretised A, contracted with C_i and B_j.

    Args (torch): dA ``(L, C, N)`` = exp(A dt); dBu_factor ``(L, C, N)`` = dt_j B_j;
      Cm ``(L, N)``. Returns ``(C, L, L)``.
    """
    import torch

    L, C, N = dA.shape
    out = torch.zeros(C, L, L)
    for i in range(L):
        for j in range(i + 1):
            decay = torch.prod(dA[j + 1:i + 1], dim=0) if i > j else torch.ones(C, N)
            out[:, i, j] = (Cm[i][None, :] * decay * dBu_factor[j]).sum(-1)
    return out


def case_loop(L: int) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(2)
    op = layer_operator(SHAPE, L)
    c = op.core
    dt = torch.tensor(np.asarray(c.dt[0]).T)  # (L, C)
    A = torch.tensor(np.asarray(c.A))
    dA = torch.exp(dt[..., None] * A)
    dB = dt[..., None] * torch.tensor(np.asarray(c.k[0]))[:, None, :]
    Cm = torch.tensor(np.asarray(c.q[0]))
    import time

    t = time.perf_counter()
    ref = loop_reference(dA, dB, Cm)
    sec = time.perf_counter() - t
    # The same quantity from what we time (the default impl), to show the baseline
    # computes what we compute. The loop's dB carries dt_j, so dt goes on the right.
    from implicit_attn.operator import ImplicitOperator, StateDecayCore

    core = StateDecayCore(q=c.q, k=c.k, A=c.A[:8], dt=c.dt[:, :8], right=c.dt[:, :8])
    z = np.zeros((1, 8, L), np.float32)
    ours = np.asarray(ImplicitOperator(z, z, z, core).materialize())[0]
    err = float(np.abs(ours - ref[:8].numpy()).max() / np.abs(ref[:8].numpy()).max())
    return {"seconds": sec, "rel_err_vs_ours": err}


def case_ours(L: int, impl: str = "auto", huge_pages: bool = True) -> dict:
    """``materialize`` of all channels, steady state (the first call, which compiles,
    is the one whose peak memory is taken)."""
    import os

    os.environ["IMPLICIT_ATTN_HUGE_PAGES"] = "1" if huge_pages else "0"
    from implicit_attn.operator import resolve_impl

    op = layer_operator(SHAPE, L)
    fn = lambda: op.materialize(impl=impl)
    peak = peak_mb_of(fn)
    return {"seconds": timeit(fn, repeat=3, warmup=0), "peak_mb": peak,
            "out_bytes": op.shape[1] * L * L * 4, "impl": resolve_impl(impl, op.core)}


def case_roofline(L: int) -> dict:
    import jax
    import jax.numpy as jnp

    C, N = 2 * SHAPE["hidden_size"], SHAPE["state_size"]
    fill = fill_seconds((1, C, L, L), lambda fn: timeit(fn, repeat=3))
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm_s = timeit(lambda: mm(a), repeat=3)
    flops_rate = 2 * n ** 3 / mm_s
    # FLOPs materialize must do: the state contraction for every causal entry.
    need = 2 * N * C * L * (L + 1) / 2
    tight = fill["xla"] if fill["kernel"] is None else min(fill["xla"], fill["kernel"])
    return {"fill_s": fill["xla"], "fill_kernel_s": fill["kernel"], "matmul_gflops": flops_rate / 1e9,
            "flops": need, "bound_s": max(fill["xla"], need / flops_rate), "tight_bound_s": max(tight, need / flops_rate)}


def case_paired_fill(L: int, pairs: int = 9) -> dict:
    """``materialize`` (the default impl) and the kernel library's fill of an output of its size,
    called in turn in one process (``paired_seconds``); None where the library is not available.
    The separate cases time the two in processes minutes apart, on a machine whose speed drifts."""
    import jax

    from implicit_attn.kernels import cpu

    if jax.default_backend() != "cpu" or not cpu.available():
        return None
    op = layer_operator(SHAPE, L)
    fill = jax.jit(lambda: cpu.fill((1, op.shape[1], L, L), 1.0))
    r = paired_seconds(lambda: op.materialize(), fill, pairs)
    return {"pairs": pairs, **{k: r[k] for k in ("fn_s", "baseline_s", "ratio")}}


def case_reduce(L: int) -> dict:
    op = layer_operator(SHAPE, L)
    fn = lambda: op.reduce("mean")
    peak = peak_mb_of(fn)
    return {"seconds": timeit(fn, repeat=1, warmup=0), "peak_mb": peak}


def _fit(xs, ys) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# Environment that caps every library in a benchmark process at an instruction set.
ISA_ENV = {"avx2": {"xla_flags": "--xla_cpu_max_isa=AVX2", "IMPLICIT_ATTN_CPU_ARCH": "haswell",
                    "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def cap_isa(isa: str) -> None:
    """Set this process's environment (inherited by every ``isolated`` case) so that XLA, the
    fused kernel, torch and MKL use at most ``isa`` (a key of ``ISA_ENV``)."""
    if isa not in ISA_ENV:
        raise ValueError(f"unknown --isa {isa!r}; choose from {sorted(ISA_ENV)}")
    for k, v in ISA_ENV[isa].items():
        if k == "xla_flags":
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + v).strip()
        else:
            os.environ[k] = v


def main(quick: bool = False, isa: str | None = None) -> list[dict]:
    if isa is not None:
        cap_isa(isa)
    rows = []
    loop_L = [32, 64] if quick else [64, 128, 256]
    for L in loop_L:
        lp = isolated("benchmarks.suite:case_loop", L=L)
        ours = isolated("benchmarks.suite:case_ours", L=L)
        xla = isolated("benchmarks.suite:case_ours", L=L, impl="xla")
        rows.append({"case": f"materialize 1536 ch, L={L}", "ours_s": ours["seconds"],
                     "impl": ours["impl"], "baseline": "papers' loop (torch)", "baseline_s": lp["seconds"],
                     "speedup": lp["seconds"] / ours["seconds"],
                     "target": ">= 200x at L=256" if L == 256 else "",
                     "note": f"impl='xla' {xla['seconds']:.3g} s ({lp['seconds'] / xla['seconds']:.0f}x); "
                             f"loop vs ours max rel diff {lp['rel_err_vs_ours']:.1e}"})
    L = 256 if quick else 512
    roof = isolated("benchmarks.suite:case_roofline", L=L)
    ours = isolated("benchmarks.suite:case_ours", L=L)
    small = isolated("benchmarks.suite:case_ours", L=L, huge_pages=False)
    xla = isolated("benchmarks.suite:case_ours", L=L, impl="xla")
    frac = lambda r: roof["bound_s"] / r["seconds"]
    rows.append({"case": f"materialize 1536 ch, L={L} vs roofline", "ours_s": ours["seconds"],
                 "ours_peak_mb": ours["peak_mb"], "impl": ours["impl"],
                 "baseline": "bound max(fill, flops/rate)",
                 "baseline_s": roof["bound_s"], "speedup": frac(ours),
                 "target": "fraction >= 0.5",
                 "note": f"fill {roof['fill_s']:.3f} s, matmul {roof['matmul_gflops']:.0f} GFLOP/s; "
                         f"fraction without huge pages {frac(small):.2f} ({small['seconds']:.3g} s), "
                         f"impl='xla' {frac(xla):.2f} ({xla['seconds']:.3g} s)"})
    if roof["fill_kernel_s"] is not None:
        tight = lambda r: roof["tight_bound_s"] / r["seconds"]
        rows.append({"case": f"materialize 1536 ch, L={L} vs the kernels' fill", "ours_s": ours["seconds"],
                     "impl": ours["impl"], "baseline": "bound max(min(fill, kernel fill), flops/rate)",
                     "baseline_s": roof["tight_bound_s"], "speedup": tight(ours),
                     "note": f"kernel fill {roof['fill_kernel_s']:.3f} s (huge pages, every thread); "
                             f"without huge pages {tight(small):.2f}, impl='xla' {tight(xla):.2f}"})
        pair = isolated("benchmarks.suite:case_paired_fill", L=L)
        need_s = roof["flops"] / (roof["matmul_gflops"] * 1e9)
        rows.append({"case": f"materialize 1536 ch, L={L} vs the kernels' fill, in turn in one process",
                     "ours_s": pair["fn_s"], "impl": ours["impl"],
                     "baseline": "bound max(kernel fill, flops/rate), both timed in one process",
                     "baseline_s": max(pair["baseline_s"], need_s),
                     "speedup": max(pair["baseline_s"], need_s) / pair["fn_s"],
                     "note": f"medians of {pair['pairs']} calls each, alternating; median of the per-pair fractions "
                             f"{pair['ratio']:.2f} (fill / materialize; flops/rate {need_s:.3f} s)"})
    dense_bytes = lambda L: 2 * SHAPE["hidden_size"] * SHAPE["state_size"] * L * L * 4
    mem = 24 * 2 ** 30  # this machine's whole memory
    fits = max(L for L in [2 ** k for k in range(6, 16)] if dense_bytes(L) < mem)
    rows.append({"case": "unblocked dense (C,N,L,L) float32", "note":
                 f"needs {dense_bytes(fits) / 2**30:.0f} GiB at L={fits}, {dense_bytes(2 * fits) / 2**30:.0f} GiB "
                 f"at L={2 * fits}: no longer fits the machine's 24 GiB from L={2 * fits}"})
    Ls = [128, 256, 512] if quick else [256, 512, 1024, 2048, 4096, 8192]
    scal = [(L, isolated("benchmarks.suite:case_reduce", L=L, timeout=7200)) for L in Ls]
    for L, r in scal:
        rows.append({"case": f"reduce('mean') 1536 ch, L={L}", "ours_s": r["seconds"],
                     "ours_peak_mb": r["peak_mb"], "target": "peak < 2048 MiB at L=8192" if L == 8192 else ""})
    big = [(L, r) for L, r in scal if L >= 512]
    big = big if len(big) >= 2 else scal  # --quick has one length >= 512
    rows.append({"case": f"reduce scaling exponents (L >= {big[0][0]})",
                 "note": f"time ~ L^{_fit([L for L, _ in big], [r['seconds'] for _, r in big]):.2f}, "
                         f"peak ~ L^{_fit([L for L, _ in big], [r['peak_mb'] for _, r in big]):.2f}"})
    name = "suite" + (f"_{isa}" if isa else "") + ("_quick" if quick else "")
    meta = {"isa_cap": ISA_ENV[isa]} if isa else None
    if isa:
        rows.append({"case": f"instruction set capped at {isa.upper()}",
                     "note": "; ".join(f"{k}={v}" for k, v in ISA_ENV[isa].items())})
    write_results(name, rows, meta=meta,
                  columns=["case", "impl", "ours_s", "ours_peak_mb", "baseline", "baseline_s", "speedup", "target", "note"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--isa", choices=sorted(ISA_ENV), help="cap every library at this instruction set")
    args = ap.parse_args()
    main(args.quick, args.isa)
