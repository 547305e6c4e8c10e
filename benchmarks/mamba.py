"""Mamba benchmarks on a random model of mamba-130m's shape (d_model 768, d_inner 1536,
N 16, 24 layers; small vocabulary), every case in a fresh process:

* full-model forward tokens/s at L = 512: ours (jit) vs the HF torch model on the same weights;
* ``materialize`` of all 1536 channels of one layer at L = 512 vs a dense baseline that
  builds the ``(c, N, L, L)`` tensor for blocks of c channels and contracts over N;
* ``reduce("mean")`` of one layer at L = 4096: time and peak memory.

    python -m benchmarks.mamba [--quick]
"""
from __future__ import annotations

import argparse

from benchmarks.common import isolated, peak_mb_of, timeit, write_results
from benchmarks.forward import forward_row

SHAPE = dict(vocab_size=1024, hidden_size=768, state_size=16, num_hidden_layers=24, conv_kernel=4)
QUICK = dict(vocab_size=256, hidden_size=128, state_size=16, num_hidden_layers=2, conv_kernel=4)


def random_model(shape: dict, layers: int | None = None, seed: int = 0):
    """A random Mamba ``LM`` of HF config kwargs ``shape`` (the registry's ``mamba`` family)."""
    import jax

    from implicit_attn.registry import FAMILIES

    spec = FAMILIES["mamba"]
    shape = dict(shape, num_hidden_layers=layers or shape["num_hidden_layers"])
    cfg = spec.config(**shape)
    return spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(seed)))


def layer_operator(shape: dict, L: int):
    """The operator of the first layer of a one-layer random model on random ids."""
    import numpy as np

    model = random_model(shape, layers=1)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, L))
    x = model.mixer_inputs(ids, [0])[0]
    return model.layers[0].mixer.as_operator(x)


def dense_materialize(core, block: int = 32):
    """The straightforward dense computation: per block of c channels build
    ``E[c, n, i, j] = exp(A[c, n] * T_c[i, j])`` (c, N, L, L) and contract over n."""
    import jax
    import jax.numpy as jnp

    from implicit_attn.ops import conv_right, segment_sum

    @jax.jit
    def one(A, dt, left, right, diag, w):
        T = segment_sum(dt)  # (B, c, L, L)
        low = jnp.isfinite(T)
        E = jnp.where(low[:, :, None], jnp.exp(A[None, :, :, None, None] * jnp.where(low, T, 0)[:, :, None]), 0)
        K = jnp.einsum("bin,bcnij,bjn->bcij", core.q, E, core.k)
        H = left[..., :, None] * K * right[..., None, :] + diag[..., :, None] * jnp.eye(T.shape[-1])
        return conv_right(H, w)

    C = core.num_channels
    outs = [one(core.A[s:s + block], core.dt[:, s:s + block], core.left[:, s:s + block],
                core.right[:, s:s + block], core.diag[:, s:s + block], core.conv_w[s:s + block])
            for s in range(0, C, block)]
    return jnp.concatenate(outs, axis=1)


def case_materialize(shape: dict, L: int, impl: str) -> dict:
    import numpy as np

    op = layer_operator(shape, L)
    if impl in ("ours", "xla"):  # ours: the default impl (the fused CPU kernel on CPU)
        kw = {"impl": "xla"} if impl == "xla" else {}
        fn = lambda: op.materialize(**kw)
    else:
        fn = lambda: dense_materialize(op.core)
    peak = peak_mb_of(fn)
    t = timeit(fn, repeat=2, warmup=0)
    out = np.asarray(fn()[0, :4])
    return {"seconds": t, "peak_mb": peak, "out_mb": op.shape[1] * L * L * 4 / 2**20,
            "checksum": float(np.abs(out).sum())}


def case_reduce(shape: dict, L: int) -> dict:
    op = layer_operator(shape, L)
    fn = lambda: op.reduce("mean")
    peak = peak_mb_of(fn)
    t = timeit(fn, repeat=1, warmup=0)
    return {"seconds": t, "peak_mb": peak}


def main(quick: bool = False) -> list[dict]:
    shape = QUICK if quick else SHAPE
    L_fwd, L_mat, L_red = (128, 128, 512) if quick else (512, 512, 4096)
    rows = []
    fwd = forward_row("mamba", L_fwd, quick)  # the same row as benchmarks.forward
    rows.append(dict(fwd, target=">= 3x"))
    ours = isolated("benchmarks.mamba:case_materialize", shape=shape, L=L_mat, impl="ours")
    dense = isolated("benchmarks.mamba:case_materialize", shape=shape, L=L_mat, impl="dense")
    xla = isolated("benchmarks.mamba:case_materialize", shape=shape, L=L_mat, impl="xla")
    agree = abs(ours["checksum"] - dense["checksum"]) <= 1e-4 * abs(dense["checksum"])
    rows.append({"case": f"materialize {2 * shape['hidden_size']} ch, L={L_mat}", "ours_s": ours["seconds"],
                 "ours_peak_mb": ours["peak_mb"], "baseline": "dense (c,N,L,L) blocks of 32",
                 "baseline_s": dense["seconds"], "baseline_peak_mb": dense["peak_mb"],
                 "speedup": dense["seconds"] / ours["seconds"], "target": ">= 5x",
                 "note": f"output {ours['out_mb']:.0f} MiB; results agree: {agree}; impl='xla' "
                         f"{xla['seconds']:.3g} s ({dense['seconds'] / xla['seconds']:.1f}x)"})
    red = isolated("benchmarks.mamba:case_reduce", shape=shape, L=L_red)
    rows.append({"case": f"reduce('mean') {2 * shape['hidden_size']} ch, L={L_red}", "ours_s": red["seconds"],
                 "ours_peak_mb": red["peak_mb"], "target": "peak < 2048 MiB",
                 "note": f"(B,C,L,L) would be {2 * shape['hidden_size'] * L_red ** 2 * 4 / 2**30:.0f} GiB"})
    write_results("mamba_quick" if quick else "mamba", rows,
                  columns=["case", "ours_s", "ours_peak_mb", "baseline", "baseline_s", "baseline_peak_mb",
                           "speedup", "target", "note"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small shapes, under a minute")
    main(ap.parse_args().quick)
