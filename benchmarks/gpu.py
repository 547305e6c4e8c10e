"""GPU benchmark: Pallas vs XLA for ``materialize`` and ``reduce`` per family, the
forward vs Hugging Face torch on the same GPU, and ``materialize`` against the GPU's
measured write bandwidth.

    python -m benchmarks.gpu [--quick]        # or: python -m benchmarks.run --device gpu

Every registered family is built at its forward-benchmark shape (``FamilySpec.bench``,
random weights). For the first layer of each core type with a Pallas kernel (Griffin: its
recurrent and its local-attention layer) it times, after a warm-up call (median of 5):

* ``materialize`` of ``n`` channels with ``impl="xla"`` and ``impl="pallas"``, and a
  jitted fill of an array of the same size (the time to only *write* the output: the
  floor any materialize has), reported as bandwidth;
* ``reduce("abs_mean")`` over all channels with both impls (Pallas never writes
  ``(B, C, L, L)``; XLA accumulates blocks of channels);
* the whole forward (ours, jitted) against the HF torch model on the GPU, in separate
  processes (HF runs its pure-torch path where no custom CUDA kernel is installed).

Each Pallas result is checked against XLA (max relative difference in the table).
Writes ``results/gpu_operators`` and ``gpu_forward`` (``.json`` / ``.md``; ``gpu_quick_*`` with
``--quick``); the operator table is rewritten after each family.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch runs beside us

from benchmarks.common import isolated, timeit, write_results  # noqa: E402
from benchmarks.forward import bench_shape, families, random_ids  # noqa: E402


def require_gpu():
    import jax

    if jax.default_backend() != "gpu":
        raise SystemExit(f"benchmarks.gpu needs a GPU; JAX's default backend here is {jax.default_backend()!r}")


def kernel_layers(model, ids):
    """``[(layer, operator)]``: the first layer of each core type with a Pallas kernel, in layer
    order, and the sorted names of the core types without one."""
    from implicit_attn.kernels import pallas

    chosen, seen, without = [], set(), set()
    for i, op in enumerate(model.operators(ids)):  # one forward for every layer's operator
        name = type(op.core).__name__
        if not pallas.has_kernel(op.core):
            without.add(name)
        elif name not in seen:
            seen.add(name)
            chosen.append((i, op))
    return chosen, sorted(without - seen)


def rel(a, b) -> float:
    import jax.numpy as jnp

    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def operator_rows(model_type: str, L: int, n: int, quick: bool) -> list[dict]:
    """The rows of ``core_rows`` for the first layer of each core type with a Pallas kernel in
    ``model_type``'s benchmark-shape model (random weights, one ``(1, L)`` input)."""
    import jax

    from implicit_attn.registry import family

    spec = family(model_type)
    cfg = spec.config(**bench_shape(model_type, quick))
    model = spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(0)))
    ids = random_ids(cfg.vocab_size, L)
    chosen, without = kernel_layers(model, ids)
    if not chosen:  # e.g. a model of short convolutions alone
        return [{"family": model_type, "case": f"no layer with a Pallas kernel ({', '.join(without)})",
                 "note": "XLA on a GPU; nothing to compare"}]
    rows = []
    for layer, op in chosen:
        rows += core_rows(model_type, layer, op, L, n)
    return rows


def core_rows(model_type: str, layer: int, op, L: int, n: int) -> list[dict]:
    """``materialize`` of ``n`` channels and ``reduce("abs_mean")`` of all of ``op``'s channels,
    Pallas against XLA (seconds, median of 5 after a warm-up; largest relative difference)."""
    import jax
    import jax.numpy as jnp

    B, C = op.shape[:2]
    n = min(n, C)
    chans = list(range(n))
    core = type(op.core).__name__
    rows = []
    mat = {impl: timeit(lambda impl=impl: op.materialize(chans, impl=impl), repeat=5) for impl in ("xla", "pallas")}
    err = rel(op.materialize(chans, impl="pallas"), op.materialize(chans, impl="xla"))
    nbytes = B * n * L * L * 4
    fill = jax.jit(lambda x: jnp.broadcast_to(x, (B, n, L, L)) * 1.0)
    one = jnp.ones((), jnp.float32)
    t_fill = timeit(lambda: fill(one), repeat=5)
    rows.append({"family": model_type, "case": f"materialize {n} ch, L={L} (layer {layer}, {core})",
                 "xla_s": mat["xla"], "pallas_s": mat["pallas"], "pallas_speedup": mat["xla"] / mat["pallas"],
                 "max_rel_diff": err,
                 "note": f"output {nbytes / 2**30:.2f} GiB: pallas {nbytes / mat['pallas'] / 1e9:.0f} GB/s, "
                         f"xla {nbytes / mat['xla'] / 1e9:.0f} GB/s, fill {nbytes / t_fill / 1e9:.0f} GB/s "
                         f"(pallas at {t_fill / mat['pallas']:.0%} of write bandwidth)"})
    red = {impl: timeit(lambda impl=impl: op.reduce("abs_mean", impl=impl), repeat=5) for impl in ("xla", "pallas")}
    err = rel(op.reduce("abs_mean", impl="pallas"), op.reduce("abs_mean", impl="xla"))
    rows.append({"family": model_type, "case": f"reduce abs_mean, all {C} ch, L={L} (layer {layer}, {core})",
                 "xla_s": red["xla"], "pallas_s": red["pallas"], "pallas_speedup": red["xla"] / red["pallas"],
                 "max_rel_diff": err, "note": f"{B * C * L * L / 2 / red['pallas'] / 1e9:.1f} G entries/s fused"})
    return rows


def case_torch_gpu(family: str, ckpt: str, L: int, out: str) -> dict:
    """HF torch forward on the GPU (fresh process): seconds, best of 3 after a warm-up."""
    import numpy as np
    import torch

    from implicit_attn.registry import family as spec_of
    from implicit_attn.testing import reference_class

    cls = reference_class(spec_of(family).hf_class)
    model = cls.from_pretrained(ckpt, torch_dtype=torch.float32).eval().to("cuda")
    ids = torch.tensor(random_ids(model.config.vocab_size, L)).to("cuda")

    def run():
        with torch.no_grad():
            out = model(ids).logits
        torch.cuda.synchronize()
        return out

    run()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        logits = run()
        ts.append(time.perf_counter() - t)
    np.save(out, logits[0, -8:].float().cpu().numpy())
    return {"seconds": min(ts), "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}


def forward_row(model_type: str, L: int, quick: bool) -> dict:
    import numpy as np

    from implicit_attn.registry import family as spec_of

    with tempfile.TemporaryDirectory() as d:
        ck = isolated("benchmarks.forward:write_checkpoint", family=model_type, path=str(Path(d) / "m"),
                      quick=quick)
        jx = isolated("benchmarks.forward:case_jax", ckpt=ck["path"], L=L, out=str(Path(d) / "j.npy"))
        th = isolated("benchmarks.gpu:case_torch_gpu", family=model_type, ckpt=ck["path"], L=L,
                      out=str(Path(d) / "t.npy"))
        a, b = np.load(Path(d) / "j.npy"), np.load(Path(d) / "t.npy")
    layers = bench_shape(model_type, quick)["num_hidden_layers"]
    return {"family": model_type,
            "case": f"forward, {layers} layers, {ck['params'] / 1e6:.3g}M params, L={L}",
            "ours_s": jx["seconds"], "hf_torch_gpu_s": th["seconds"], "speedup": th["seconds"] / jx["seconds"],
            "note": f"HF {spec_of(model_type).hf_class}, torch {th['torch']}; "
                    f"max abs logits diff {float(np.max(np.abs(a - b))):.1e}"}


PARTS = ("operators", "forward")


def main(quick: bool = False, only=None, parts=PARTS) -> list[dict]:
    require_gpu()
    L, n, Lf = (512, 8, 256) if quick else (2048, 32, 1024)
    fams = only or families()
    name = "gpu_quick" if quick else "gpu"
    rows = []
    if "operators" in parts:
        op_rows = []
        for f in fams:
            print(f"operators: {f}", flush=True)
            op_rows += operator_rows(f, L, n, quick)
            # after each family, so a run cut short keeps what it measured
            write_results(name + "_operators", op_rows,
                          columns=["family", "case", "xla_s", "pallas_s", "pallas_speedup", "max_rel_diff", "note"])
        rows += op_rows
    if "forward" in parts:
        fw_rows = []
        for f in fams:
            print(f"forward: {f}", flush=True)
            fw_rows.append(forward_row(f, Lf, quick))
        write_results(name + "_forward", fw_rows,
                      columns=["family", "case", "ours_s", "hf_torch_gpu_s", "speedup", "note"])
        rows += fw_rows
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated model_types (default: every registered family)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    a = ap.parse_args()
    parts = [p for p in a.parts.split(",") if p]
    if set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    main(a.quick, [s for s in a.only.split(",") if s] or None, parts)
