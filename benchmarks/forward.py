"""Full-model forward of every family, ours (jit) vs the Hugging Face torch model on the
same random weights, each side in a fresh process; logits parity is checked on the way.

Shapes are the published small checkpoints' widths and depths with a small vocabulary
(the embedding and head are not what is measured): mamba-130m, mamba2-130m, rwkv-430m,
and for RecurrentGemma a 768-wide, 12-layer model (recurrentgemma-2b's 2.7 B parameters
in float32, twice, do not fit a 2-core benchmark run alongside anything else).

Families, HF classes and shapes come from the registry (``FamilySpec.bench``,
``FamilySpec.hf_class``); ``--only`` takes ``model_type``s and replaces their rows in
the existing results, keeping the other families' rows (each row's two timings come from
one run; the row's ``date`` says when).

Columns besides the steady-state times (``ours_s``, ``baseline_s``: on every side the median
of 5 calls after at least a second of warm-up calls that follow the first):

- ``ours_first_s``: our first call in a fresh process (tracing and XLA compiling included,
  JAX's persistent compilation cache off, as in a Python session that never calls
  ``enable_compile_cache``); ``compile_s = ours_first_s - ours_s``. ``baseline_first_s``
  is HF's first call (nothing to compile; allocator and kernel warm-up).
- The matmul floor: ``hf_gflop`` is the HF model's forward work as
  ``torch.utils.flop_counter.FlopCounterMode`` counts it: matrix products only (``mm``,
  ``bmm``, ``addmm``, ``baddbmm``, convolutions, attention as the whole ``L x L`` score
  matrix even when causal), with formulas added here for two operators it has none for and
  HF runs on CPU (``_grouped_mm``, transformers' mixture-of-experts kernel, and
  ``_scaled_dot_product_flash_attention_for_cpu``); product-like operators still without a
  formula are listed in the JSON (``hf_uncounted_ops``). It leaves out elementwise work,
  normalisations, softmax, exponentials, gathers and scatters, and a scan written as a
  Python loop counts only through the products inside it. HF's mixture-of-experts layers
  run each expert on its routed tokens only, so the count is the routed work.
  ``matmul_gflops`` is the machine's float32 matmul rate measured in the same run (the
  best of a 2048-square product and a 768-wide model's projection shapes at L = 512,
  jitted ``jnp.dot`` and ``torch.mm``, each with its library's default thread count as in
  the forward cases). ``floor_s = hf_gflop / matmul_gflops`` is the time HF's matrix
  products alone take at that rate; ``max_speedup = baseline_s / floor_s`` is the most an
  implementation doing HF's products could gain over HF; ``ours_floor_frac = floor_s /
  ours_s`` is how close we are to that floor (1 = at it; above 1 where our formulation
  needs fewer products than HF's, or where small products outrun the measured rate).
- For ``mamba2`` a second row: the JAX peer ``mamba2-jax`` on the same weights
  (``benchmarks.mamba2_peer``), when it is installed (``pip install .[bench]``).

    python -m benchmarks.forward [--quick] [--only mamba,rwkv]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import re
import tempfile
import time
from pathlib import Path

from benchmarks.common import block, isolated, replace_rows, timeit, write_results

COLUMNS = ["case", "ours_s", "ours_first_s", "compile_s", "baseline", "baseline_s", "baseline_first_s",
           "speedup", "hf_gflop", "floor_s", "max_speedup", "ours_floor_frac", "note", "date"]
# a large square product and the shapes of a 768-wide model's projections at L = 512
MATMUL_SHAPES = ((2048, 2048, 2048), (512, 768, 3072), (512, 3072, 768))


def families() -> list[str]:
    """The benchmarked ``model_type``s: every family in the registry whose reference is a
    transformers class (RWKV-6/7's reference is our plain-torch rebuild of fla's model, a
    per-step loop: ``benchmarks.rwkv_official`` times those against the official package)."""
    import transformers

    from implicit_attn.registry import FAMILIES

    return [t for t, spec in FAMILIES.items() if hasattr(transformers, spec.hf_class)]


def bench_shape(model_type: str, quick: bool) -> dict:
    """The HF config kwargs of ``model_type``'s benchmark model (``FamilySpec.bench``)."""
    from implicit_attn.registry import family

    return dict(family(model_type).bench["quick" if quick else "full"])


def random_ids(vocab: int, L: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, (1, L))


def write_checkpoint(family: str, path: str, quick: bool) -> dict:
    """A random model of the family's benchmark shape, saved in HF layout with our writer."""
    import jax

    import implicit_attn as ia
    from implicit_attn.registry import family as spec_of

    spec = spec_of(family)
    cfg = spec.config.from_hf(bench_shape(family, quick))  # HF kwargs, read as config.json
    model = spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(0)))
    ia.save(model, path)
    n = sum(x.size for x in jax.tree.leaves(model.params()))
    return {"path": path, "params": int(n)}


def no_persistent_cache() -> None:
    """Turn JAX's persistent compilation cache off in this process (whatever
    ``JAX_COMPILATION_CACHE_DIR`` says), so a first call compiles everything."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


# Every side (ours, HF's, the JAX peer) is timed by the same rule: the first call, then calls
# for at least WARM_S seconds (at least one), then the median of STEADY_CALLS calls. Until
# 2026-11-29 ours was the median of 3 after one warm-up call and HF's the faster of 2 right
# after the first: the first calls after the first one run slow in a fresh process.
WARM_S = 1.0
STEADY_CALLS = 5


def first_and_steady(fn, wait=block) -> tuple[float, float]:
    """Seconds of the first ``fn()`` call and the steady median (``WARM_S`` of warm-up calls,
    then the median of ``STEADY_CALLS``); ``wait(result)`` blocks on a call's result."""
    t = time.perf_counter()
    wait(fn())
    first = time.perf_counter() - t
    return first, timeit(fn, repeat=STEADY_CALLS, warm_s=WARM_S, wait=wait)


def case_jax(ckpt: str, L: int, out: str) -> dict:
    import numpy as np

    import implicit_attn as ia

    no_persistent_cache()
    model = ia.load(ckpt)
    ids = random_ids(model.config.vocab_size, L)
    first, t = first_and_steady(lambda: model(ids))
    np.save(out, np.asarray(model(ids))[0, -8:])  # the last rows, for the parity check
    return {"seconds": t, "first_s": first}


# matrix-product-like aten ops: any of these that FlopCounterMode has no formula for is
# reported with the count (``hf_uncounted_ops``), so a gap in the count cannot pass unseen
PRODUCT_OP = re.compile(r"mm|mv|dot|bmm|conv|attention|einsum|matmul|linear|tensordot")


def grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``aten._grouped_mm`` (transformers' default mixture-of-experts kernel): a
    ``(T, K)`` token block against per-group ``(G, K, N)`` weights, each row multiplied by
    its own group's matrix, is ``2 T K N``; 2-D by 2-D with the groups splitting the
    contraction is ``2 M N K`` for the whole ``K``; batched 3-D operands ``2 G M N K``."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_shape[-2] * out_shape[-1] * a_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def cpu_sdpa_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu`` as torch counts its GPU
    attention kernels (the whole ``L x L`` score matrix, causal or not)."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q_shape, k_shape, v_shape)


def hf_flops(model, ids) -> dict:
    """The matrix-product FLOPs of one no-grad forward of the torch ``model`` on ``ids``
    (``FlopCounterMode`` with formulas added for ``_grouped_mm`` and CPU attention; see the
    module docstring for what it leaves out): the total, the per-operator split and the
    names of product-like operators that ran without a formula."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    aten = torch.ops.aten
    extra = {aten._grouped_mm: grouped_mm_flop, aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa_flop}
    counter, log = FlopCounterMode(display=False, custom_mapping=extra), OpLog()
    # The counter's module tracker hooks every module input that requires grad; a view of a
    # parameter made under no_grad (transformers 5.25 passes Mamba's conv weight so) has neither a
    # grad_fn nor an accumulator, and the hook fails. Counting needs no gradients.
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        with torch.no_grad(), log, counter:
            model(ids)
    finally:
        for p in trainable:
            p.requires_grad_(True)
    by_op = {getattr(op, "__name__", str(op)): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    uncounted = sorted(op.__name__ for op in log.ops
                       if PRODUCT_OP.search(op.__name__) and op not in counter.flop_registry)
    return {"flops": int(counter.get_total_flops()), "flops_by_op": by_op, "uncounted_ops": uncounted}


def case_torch(family: str, ckpt: str, L: int, out: str) -> dict:
    import numpy as np
    import torch

    from implicit_attn.registry import family as spec_of
    from implicit_attn.testing import reference_class

    cls = reference_class(spec_of(family).hf_class)
    model = cls.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    ids = torch.tensor(random_ids(model.config.vocab_size, L))

    def run():
        with torch.no_grad():
            return model(ids).logits

    # the first call is also RWKV's rescaling of its weights in eval mode; torch runs synchronously
    first, t = first_and_steady(run, wait=lambda r: r)
    np.save(out, run()[0, -8:].float().numpy())
    # counted after the timings: the counter's dispatch hooks slow the forward down
    return {"seconds": t, "first_s": first, "threads": torch.get_num_threads(), **hf_flops(model, ids)}


def case_matmul_rate(shapes=MATMUL_SHAPES, repeat: int = 5) -> dict:
    """The machine's float32 matmul rate (GFLOP/s): for each ``(m, k, n)`` in ``shapes``, a
    jitted ``jnp.dot`` and ``torch.mm`` of ``(m, k) @ (k, n)``, each with its library's
    default threads (as the forward cases run), timed by the fastest of ``repeat`` calls
    after a warm-up; ``gflops`` is the best of them all (the floor is a bound, so it takes
    the best rate seen)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    dot = jax.jit(jnp.dot)
    rates = {}
    for m, k, n in shapes:
        a = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
        b = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
        ja, jb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
        for lib, fn in (("jax", lambda: dot(ja, jb)), ("torch", lambda: torch.mm(ta, tb))):
            rates[f"{lib} {m}x{k}x{n}"] = 2 * m * k * n / timeit(fn, repeat=repeat, best=True) / 1e9
    best = max(rates, key=rates.get)
    return {"gflops": rates[best], "best": best, "rates": rates, "torch_threads": torch.get_num_threads()}


def forward_rows(family: str, L: int, quick: bool = False, rate: dict | None = None,
                 peers: bool = True) -> list[dict]:
    """Table rows for ``family`` at length ``L`` (fresh processes): ours vs HF torch, with
    first-call times and the matmul floor at ``rate`` (``case_matmul_rate``'s dict; measured
    here if ``None``); for ``mamba2`` with ``peers``, also ours vs ``mamba2-jax`` when it is
    installed."""
    import numpy as np

    from implicit_attn.registry import family as spec_of

    rate = rate or isolated("benchmarks.forward:case_matmul_rate")
    with tempfile.TemporaryDirectory() as d:
        ck = isolated("benchmarks.forward:write_checkpoint", family=family, path=str(Path(d) / "m"), quick=quick)
        jx = isolated("benchmarks.forward:case_jax", ckpt=ck["path"], L=L, out=str(Path(d) / "j.npy"))
        th = isolated("benchmarks.forward:case_torch", family=family, ckpt=ck["path"], L=L,
                      out=str(Path(d) / "t.npy"), timeout=3600)
        a, b = np.load(Path(d) / "j.npy"), np.load(Path(d) / "t.npy")
        peer = None
        if peers and family == "mamba2" and importlib.util.find_spec("mamba2_jax") is not None:
            peer = isolated("benchmarks.mamba2_peer:case_peer", ckpt=ck["path"], L=L, out=str(Path(d) / "p.npy"))
            c = np.load(Path(d) / "p.npy")
    err = float(np.max(np.abs(a - b)))
    spec = spec_of(family)
    hf = spec.hf_class
    layers = spec.config.from_hf(bench_shape(family, quick)).num_hidden_layers  # ours (Nemotron-H: token mixers)
    floor = th["flops"] / (rate["gflops"] * 1e9)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    case = f"{family} forward, {layers} layers, {ck['params'] / 1e6:.3g}M params, L={L}"
    rows = [{"case": case, "ours_s": jx["seconds"], "ours_first_s": jx["first_s"],
             "compile_s": jx["first_s"] - jx["seconds"],
             "baseline": f"HF {hf} (torch CPU, {th['threads']} threads)", "baseline_s": th["seconds"],
             "baseline_first_s": th["first_s"], "speedup": th["seconds"] / jx["seconds"],
             "hf_gflop": th["flops"] / 1e9, "floor_s": floor, "max_speedup": th["seconds"] / floor,
             "ours_floor_frac": floor / jx["seconds"], "matmul_gflops": rate["gflops"],
             "hf_flops_by_op": th["flops_by_op"], "hf_uncounted_ops": th["uncounted_ops"],
             "note": f"{L / jx['seconds']:.0f} vs {L / th['seconds']:.0f} tokens/s; max abs logits diff {err:.1e}; "
                     f"matmul {rate['gflops']:.0f} GFLOP/s",
             "family": family, "date": date}]
    if peer is not None:
        rows.append({"case": case.replace("forward", "forward vs the JAX peer", 1), "ours_s": jx["seconds"],
                     "ours_first_s": jx["first_s"], "compile_s": jx["first_s"] - jx["seconds"],
                     "baseline": f"mamba2-jax {peer['version']} (jit, XLA CPU)", "baseline_s": peer["seconds"],
                     "baseline_first_s": peer["first_s"], "speedup": peer["seconds"] / jx["seconds"],
                     "note": f"max abs logits diff {float(np.max(np.abs(c - a))):.1e} vs ours, "
                             f"{float(np.max(np.abs(c - b))):.1e} vs HF; same weights, HF key names mapped "
                             "to state-spaces'",
                     "family": "mamba2-jax", "date": date})
    return rows


def forward_row(family: str, L: int, quick: bool = False, rate: dict | None = None) -> dict:
    """One table row: ours vs torch for ``family`` at length ``L`` (fresh processes)."""
    return forward_rows(family, L, quick, rate, peers=False)[0]


def main(quick: bool = False, only=None) -> list[dict]:
    from implicit_attn.registry import family as spec_of

    for f in only or ():
        spec_of(f)  # ValueError naming the supported model_types
    L = 128 if quick else 512
    name = "forward_quick" if quick else "forward"
    rate = isolated("benchmarks.forward:case_matmul_rate")
    rows = [r for f in (only or families()) for r in forward_rows(f, L, quick, rate)]
    if only:
        rows = replace_rows(name, rows, key=lambda r: r.get("family", r["case"].split()[0]))
    write_results(name, rows, meta={"matmul": rate}, columns=COLUMNS)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated model_types (default: all of "
                    "implicit_attn.registry.FAMILIES: mamba, mamba2, recurrent_gemma, rwkv)")
    a = ap.parse_args()
    main(a.quick, [s for s in a.only.split(",") if s] or None)
