"""RWKV-5 (the RWKV team's HF layout), RWKV-6 and RWKV-7 (flash-linear-attention layout): our jitted
forward against BlinkDL's official ``rwkv`` package on CPU (0.8.32, strategy ``cpu fp32``, its
pure-torch paths: ``RWKV_JIT_ON=0`` for RWKV-5/6; RWKV-7 mode runs TorchScript), on the same
random weights, and one layer's operator
(``materialize`` of one head's channels, ``reduce("mean")`` over all) against the per-step recurrence that builds
each head's ``M`` row by row (``benchmarks.delta_rule.dplr_recurrence_fn``) put through the same
per-channel factors.

Shapes: ``FamilySpec.bench`` (RWKV-5, RWKV-6: 12 layers at width 512, heads of 64; RWKV-7: RWKV-7
0.1B's width and ranks, 12 layers), a vocabulary of 1024, one sequence of ``L`` tokens. The official
package is unbatched and runs its sequence mode (``forward(tokens, None, full_output=True)``).
Every case runs in a fresh process (time = the best of 3 after a warm-up call); ``agree`` is the
max abs logits difference over the max abs logit (RWKV-6 uses the official group-norm eps,
``g_norm_eps = 64e-5``, so the two compute the same function).

    python -m benchmarks.rwkv_official [--quick]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.common import isolated, peak_mb_of, timeit, write_results

MODEL_TYPES = ("rwkv5", "rwkv6", "rwkv7")


def shape(model_type: str, quick: bool) -> dict:
    """HF config kwargs of the benchmark model (``FamilySpec.bench``, official constants)."""
    from implicit_attn.registry import family

    kw = dict(family(model_type).bench["quick" if quick else "full"])
    if model_type == "rwkv6":
        kw["g_norm_eps"] = 64e-5
    return kw


def write_models(model_type: str, d: str, quick: bool) -> dict:
    """The torch reference model of the benchmark shape (random, perturbed), saved in fla's
    layout (``d/hf``) and as the official checkpoint (``d/official.pth``)."""
    import torch

    from implicit_attn.testing import build_hf_model, fla_rwkv, rwkv5_reference

    model = build_hf_model(model_type, shape(model_type, quick), seed=0, path=Path(d) / "hf")
    reference = rwkv5_reference if model_type == "rwkv5" else fla_rwkv
    torch.save(reference.official_state_dict(model), Path(d) / "official.pth")
    return {"params": sum(p.numel() for p in model.parameters())}


def ids_of(vocab: int, L: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, (1, L))


def case_ours(d: str, L: int) -> dict:
    import numpy as np

    import implicit_attn as ia

    model = ia.load(Path(d) / "hf")
    ids = ids_of(model.config.vocab_size, L)
    peak = peak_mb_of(lambda: model(ids))
    t = timeit(lambda: model(ids), repeat=3)
    np.save(Path(d) / "ours.npy", np.asarray(model(ids))[0])
    return {"seconds": t, "peak_mb": peak}


def case_official(d: str, L: int, version: int) -> dict:
    import os

    os.environ.update(RWKV_JIT_ON="0", RWKV_CUDA_ON="0", RWKV_RESCALE_LAYER="0")
    if version == 7:
        os.environ["RWKV_V7_ON"] = "1"
    import numpy as np
    import torch
    from rwkv.model import RWKV

    path = Path(d) / "official.pth"
    model = RWKV(str(path)[:-4] if version == 7 else str(path), "cpu fp32")  # v7 appends ".pth" itself
    vocab = torch.load(path, map_location="cpu")["emb.weight"].shape[0]
    tokens = ids_of(vocab, L)[0].tolist()
    run = lambda: model.forward(tokens, None, full_output=True)[0]
    peak = peak_mb_of(run)
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        out = run()
        ts.append(time.perf_counter() - t)
    np.save(Path(d) / "official.npy", out.float().numpy())
    return {"seconds": min(ts), "peak_mb": peak, "threads": torch.get_num_threads()}


def case_operator(d: str, L: int, what: str, impl: str) -> dict:
    """Layer 1's operator of the saved model: ``materialize()`` or ``reduce("mean")``, ours or the
    per-step recurrence's ``M`` through the core's own per-channel factors."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import implicit_attn as ia
    from benchmarks.delta_rule import dplr_recurrence_fn

    model = ia.load(Path(d) / "hf")
    ids = ids_of(model.config.vocab_size, L)
    op = model.operators(ids, layers=[1])[0]
    core = op.core
    C = core.num_channels
    # materialize: the first head's channels ((1, 64, L, L) at the full shapes); reduce: all
    idx = jnp.arange(min(C, core.num_channels // core.num_heads) if what == "materialize" else C)
    if impl == "ours":
        f = jax.jit(lambda o: o.materialize(channels=idx) if what == "materialize" else o.reduce("mean"))
        fn = lambda: f(op)
    else:
        rec = dplr_recurrence_fn(core.after)
        sandwich = jax.jit(lambda c, M: c.sandwich(jnp.take(M, c.head[idx], axis=1), idx))

        def fn():
            M = rec(core.q, core.k, core.log_w, a=core.a, b=core.b, bonus=core.bonus)
            H = sandwich(core, M)
            return H if what == "materialize" else H.mean(1)
    peak = peak_mb_of(fn)
    t = timeit(fn, repeat=2, warmup=0)
    np.save(Path(d) / f"op_{what}_{impl}.npy", np.asarray(fn(), np.float64))
    return {"seconds": t, "peak_mb": peak, "channels": int(idx.shape[0])}


def main(quick: bool = False) -> list[dict]:
    import numpy as np

    L = 128 if quick else 512
    Lop = 128 if quick else 1024
    rows = []
    for mt in MODEL_TYPES:
        version = int(mt[-1])
        with tempfile.TemporaryDirectory() as d:
            info = isolated("benchmarks.rwkv_official:write_models", model_type=mt, d=d, quick=quick)
            ours = isolated("benchmarks.rwkv_official:case_ours", d=d, L=L)
            off = isolated("benchmarks.rwkv_official:case_official", d=d, L=L, version=version, timeout=3600)
            a, b = np.load(Path(d) / "ours.npy"), np.load(Path(d) / "official.npy")
            layers = shape(mt, quick)["num_hidden_layers"]
            rows.append({"case": f"{mt} forward, {layers} layers, {info['params'] / 1e6:.3g}M params, L={L}",
                         "ours_s": ours["seconds"], "ours_peak_mb": ours["peak_mb"],
                         "baseline": f"official rwkv 0.8.32 (cpu fp32, {off['threads']} threads)",
                         "baseline_s": off["seconds"], "baseline_peak_mb": off["peak_mb"],
                         "speedup": off["seconds"] / ours["seconds"],
                         "agree": float(np.abs(a - b).max() / np.abs(b).max())})
            for what in ("materialize", "reduce"):
                o = isolated("benchmarks.rwkv_official:case_operator", d=d, L=Lop, what=what, impl="ours")
                r = isolated("benchmarks.rwkv_official:case_operator", d=d, L=Lop, what=what, impl="recurrence")
                a, b = np.load(Path(d) / f"op_{what}_ours.npy"), np.load(Path(d) / f"op_{what}_recurrence.npy")
                label = "materialize()" if what == "materialize" else "reduce('mean')"
                rows.append({"case": f"{mt} layer 1 {label}, {o['channels']} ch, L={Lop}",
                             "ours_s": o["seconds"], "ours_peak_mb": o["peak_mb"],
                             "baseline": "per-step recurrence, M row by row", "baseline_s": r["seconds"],
                             "baseline_peak_mb": r["peak_mb"], "speedup": r["seconds"] / o["seconds"],
                             "agree": float(np.abs(a - b).max() / np.abs(b).max())})
    write_results("rwkv_official_quick" if quick else "rwkv_official", rows, meta={"L": L, "L_operator": Lop})
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, about a minute")
    main(ap.parse_args().quick)
