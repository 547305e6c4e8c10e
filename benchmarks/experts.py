"""One mixture-of-experts layer's experts (the routing given), ours against Hugging Face's, at the
forward benchmark's Qwen3-Next layer and at the widths of published checkpoints.

Each case routes ``T`` tokens to ``k`` distinct random experts each, with random routing
weights and random float32 expert weights (a fused gate/up projection ``(E, 2F, D)`` and a
down projection ``(E, D, F)``, SiLU-gated, as Qwen3-MoE, OLMoE and Qwen3-Next hold them), the
same numbers on both sides (seeded). Each side runs in a fresh process:

- ``ours_s``: ``nn.moe.experts_forward(..., impl="cpu")``, jitted: the grouped-product kernels
  (``kernels.cpu.grouped_matmul_from_tokens`` and ``grouped_matmul_to_tokens``) with XLA's
  routing bookkeeping and activation between them.
- ``loop_s``: the same with ``impl="xla"`` (the loop over experts that derivatives and small
  layers run).
- ``hf_s``: transformers' ``Qwen3MoeExperts`` with the experts implementation an HF model gets
  by default (``grouped_mm``: ``torch._grouped_mm``), 2 threads.

Each time is the median of 5 calls after at least a second of warm-up calls. The floors, from the
same run: ``flop_s``, the routed products' FLOPs (``6 T k F D``) at the machine's matmul rate
(``benchmarks.forward.case_matmul_rate``), and ``memory_s``, the bytes of the experts' weights
the routing reaches, read once, at the machine's read bandwidth (``read_gbps``: torch summing a
1 GiB buffer, the fastest of 5); ``floor_frac = max(flop_s, memory_s) / ours_s``.
``max_abs_diff`` is ours against HF's output.

    python -m benchmarks.experts [--quick] [--only qwen3_next_bench,olmoe]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import block, isolated, timeit, write_results

# name: (what it is, D hidden, F expert width, E experts, k per token); T tokens
CASES = {
    "qwen3_next_bench": ("the forward benchmark's Qwen3-Next layer", 512, 128, 16, 4),
    "olmoe": ("OLMoE-1B-7B's layer widths", 2048, 1024, 64, 8),
    "qwen3_30b_a3b": ("Qwen3-30B-A3B's layer widths", 2048, 768, 128, 8),
}
QUICK_CASES = {"tiny": ("a quick smoke shape", 64, 32, 8, 2)}
TOKENS = 512
COLUMNS = ["case", "T", "D", "F", "E", "k", "ours_s", "loop_s", "hf_s", "speedup", "routed_gflop", "weights_gb",
           "flop_s", "memory_s", "floor_frac", "max_abs_diff", "note"]


def routing(E: int, k: int, T: int, seed: int = 0):
    """Each of ``T`` tokens' ``k`` distinct random experts ``(T, k)`` int32 and routing weights
    ``(T, k)`` float32 (summing to 1 per token)."""
    import numpy as np

    if not 1 <= k <= E:
        raise ValueError(f"k ({k}) must be in [1, E ({E})]")
    g = np.random.default_rng(seed)
    experts = np.argsort(g.random((T, E)), axis=1)[:, :k].astype(np.int32)
    w = g.random((T, k)).astype(np.float32)
    return experts, w / w.sum(1, keepdims=True)


def layer(D: int, F: int, E: int, k: int, T: int, seed: int = 0) -> dict:
    """The case's inputs as numpy arrays: ``x (T, D)``, ``weights (T, k)``, ``experts (T, k)``
    (``routing``), ``w_in (E, 2F, D)``, ``w_out (E, D, F)``, float32 but the experts."""
    import numpy as np

    experts, weights = routing(E, k, T, seed)
    g = np.random.default_rng(seed + 1)
    return {"x": g.standard_normal((T, D), dtype=np.float32), "weights": weights, "experts": experts,
            "w_in": 0.02 * g.standard_normal((E, 2 * F, D), dtype=np.float32),
            "w_out": 0.02 * g.standard_normal((E, D, F), dtype=np.float32)}


def case_ours(D: int, F: int, E: int, k: int, T: int, out: str, warm_s: float = 1.0) -> dict:
    """Our experts, kernel path and loop, timed in this (fresh) process after ``warm_s`` seconds of
    warm-up calls; the kernel path's output is saved to ``out`` (.npy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from implicit_attn.nn.moe import experts_forward, gated_act

    a = {n: jnp.asarray(v) for n, v in layer(D, F, E, k, T).items()}
    res = {}
    for impl, key in (("cpu", "ours_s"), ("xla", "loop_s")):
        f = jax.jit(lambda x, w, e, wi, wo, impl=impl: experts_forward(x, w, e, wi, wo, gated_act(jax.nn.silu),
                                                                        impl=impl))
        run = lambda: f(a["x"], a["weights"], a["experts"], a["w_in"], a["w_out"])
        y = block(run())
        if impl == "cpu":
            np.save(out, np.asarray(y))
        res[key] = timeit(run, repeat=5, warm_s=warm_s)
    return res


def case_hf(D: int, F: int, E: int, k: int, T: int, out: str, warm_s: float = 1.0) -> dict:
    """transformers' ``Qwen3MoeExperts`` (``grouped_mm``) on the same inputs, timed in this (fresh)
    process after ``warm_s`` seconds of warm-up calls; its output is saved to ``out`` (.npy)."""
    import numpy as np
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    a = layer(D, F, E, k, T)
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=k)
    cfg._experts_implementation = "grouped_mm"  # what an HF model of this config runs by default
    m = Qwen3MoeExperts(cfg).eval()
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.from_numpy(a["w_in"]))
        m.down_proj.copy_(torch.from_numpy(a["w_out"]))
    x, idx, w = (torch.from_numpy(a[n]) for n in ("x", "experts", "weights"))

    def run():
        with torch.no_grad():
            return m(x, idx.long(), w)

    np.save(out, run().numpy())
    return {"hf_s": timeit(run, repeat=5, warm_s=warm_s, wait=lambda y: y), "torch_threads": torch.get_num_threads()}


def case_read_bandwidth(gib: float = 1.0, repeat: int = 5) -> dict:
    """The machine's read bandwidth (GB/s): torch summing a ``gib`` GiB float32 buffer with its
    default threads, the fastest of ``repeat`` calls after a warm-up."""
    import torch

    buf = torch.ones(int(gib * 2 ** 30) // 4)
    s = timeit(lambda: buf.sum(), repeat=repeat, best=True, wait=lambda y: y)
    return {"read_gbps": buf.numel() * 4 / s / 1e9}


def case_row(name: str, spec: tuple, rate: dict, bandwidth: dict, T: int = TOKENS) -> dict:
    """The table row of one case (each side in a fresh process)."""
    import numpy as np

    what, D, F, E, k = spec
    with tempfile.TemporaryDirectory() as tmp:
        ours = isolated("benchmarks.experts:case_ours", D=D, F=F, E=E, k=k, T=T, out=str(Path(tmp) / "ours.npy"))
        hf = isolated("benchmarks.experts:case_hf", D=D, F=F, E=E, k=k, T=T, out=str(Path(tmp) / "hf.npy"))
        diff = float(np.abs(np.load(Path(tmp) / "ours.npy") - np.load(Path(tmp) / "hf.npy")).max())
    reached = len(np.unique(routing(E, k, T)[0]))  # experts whose weights are read
    flop = 6 * T * k * F * D
    weight_bytes = reached * 3 * F * D * 4
    flop_s = flop / (rate["gflops"] * 1e9)
    memory_s = weight_bytes / (bandwidth["read_gbps"] * 1e9)
    return {"case": f"{name}: {what}", "T": T, "D": D, "F": F, "E": E, "k": k, "ours_s": ours["ours_s"],
            "loop_s": ours["loop_s"], "hf_s": hf["hf_s"], "speedup": hf["hf_s"] / ours["ours_s"],
            "routed_gflop": flop / 1e9, "weights_gb": weight_bytes / 1e9, "flop_s": flop_s, "memory_s": memory_s,
            "floor_frac": max(flop_s, memory_s) / ours["ours_s"], "max_abs_diff": diff,
            "note": f"{reached} of {E} experts reached; matmul {rate['gflops']:.0f} GFLOP/s, read "
                    f"{bandwidth['read_gbps']:.1f} GB/s; HF {hf['torch_threads']} threads"}


def main(quick: bool = False, only=None) -> list[dict]:
    """Every case (``quick``: the tiny one; ``only``: these names), the matmul rate and read
    bandwidth first; writes ``results/experts[_quick].{json,md}`` and returns the rows. An unknown
    name is a ``ValueError``."""
    cases = QUICK_CASES if quick else CASES
    chosen = list(cases) if only is None else list(only)
    unknown = sorted(set(chosen) - set(cases))
    if unknown:
        raise ValueError(f"unknown cases {unknown}; choose from {sorted(cases)}")
    rate = isolated("benchmarks.forward:case_matmul_rate")
    bandwidth = isolated("benchmarks.experts:case_read_bandwidth", gib=0.0625 if quick else 1.0)
    rows = []
    for name in chosen:
        rows.append(case_row(name, cases[name], rate, bandwidth, T=32 if quick else TOKENS))
        print(rows[-1])
    write_results("experts_quick" if quick else "experts", rows,
                  {"matmul": rate, "read_bandwidth": bandwidth}, COLUMNS)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny shape (a smoke run)")
    ap.add_argument("--only", default=None, help="comma-separated case names")
    args = ap.parse_args()
    main(args.quick, None if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()])
