"""RWKV-4 operator benchmarks on one random time-mix layer of rwkv-430m's width
(d_model = attention width = 1024) at L = 1024, every case in a fresh process:

* ``materialize()`` of all channels: ours (``RwkvCore`` through ``ImplicitOperator``) vs a
  straightforward dense baseline that, per block of 32 channels, builds the full
  ``l (c, L, L)``, applies ``jax.nn.softmax`` over the masked rows and the gate;
* ``reduce("mean")`` over all channels: ours vs the same dense baseline accumulated
  block by block.

    python -m benchmarks.rwkv [--quick]
"""
from __future__ import annotations

import argparse

from benchmarks.common import isolated, peak_mb_of, timeit, write_results

FULL = dict(width=1024, L=1024)
QUICK = dict(width=128, L=256)
BASE_BLOCK = 32


def _layer_operator(width: int, L: int):
    import jax

    from implicit_attn.families import rwkv
    from implicit_attn.registry import FAMILIES

    spec = FAMILIES["rwkv"]
    cfg = spec.config(vocab_size=16, hidden_size=width, num_hidden_layers=1, intermediate_size=width)
    att = spec.init_params(cfg, 0)["layers"][0]["attention"]
    x = jax.random.normal(jax.random.PRNGKey(0), (1, L, width))
    return jax.block_until_ready(rwkv.block.time_mix_operator_jit(att, x, cfg=cfg))


def _dense_block_fn():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def block(k, w, u, gate):
        """``(B, c, L)`` keys/gate, ``(c,)`` w/u -> ``(B, c, L, L)``: build l, softmax rows."""
        L = k.shape[-1]
        i = jnp.arange(L)[:, None]
        j = jnp.arange(L)[None, :]
        l = (i - 1 - j) * w[:, None, None] + k[:, :, None, :]
        l = jnp.where(i == j, u[:, None, None] + k[:, :, None, :], l)
        P = jax.nn.softmax(jnp.where(j <= i, l, -jnp.inf), axis=-1)
        return gate[..., :, None] * P

    return block


def dense_materialize(core, block: int = BASE_BLOCK):
    import jax.numpy as jnp

    fn = _dense_block_fn()
    C = core.num_channels
    return jnp.concatenate([fn(core.k[:, s:s + block], core.w[s:s + block], core.u[s:s + block],
                               core.gate[:, s:s + block]) for s in range(0, C, block)], axis=1)


def dense_reduce_mean(core, block: int = BASE_BLOCK):
    import jax
    import jax.numpy as jnp

    fn = _dense_block_fn()
    add = jax.jit(lambda acc, H: acc + jnp.sum(H, axis=1))
    C = core.num_channels
    acc = jnp.zeros(core.k.shape[:1] + core.k.shape[-1:] * 2, jnp.float32)
    for s in range(0, C, block):
        acc = add(acc, fn(core.k[:, s:s + block], core.w[s:s + block], core.u[s:s + block],
                          core.gate[:, s:s + block]))
    return acc / C


def case(width: int, L: int, what: str, impl: str) -> dict:
    """One measurement: ``what`` in (materialize, reduce), ``impl`` in (ours, dense)."""
    import jax
    import numpy as np

    op = _layer_operator(width, L)
    if what == "materialize":
        ours = jax.jit(lambda o: o.materialize())
        fn = (lambda: ours(op)) if impl == "ours" else (lambda: dense_materialize(op.core))
    else:
        ours = jax.jit(lambda o: o.reduce("mean"))
        fn = (lambda: ours(op)) if impl == "ours" else (lambda: dense_reduce_mean(op.core))
    peak = peak_mb_of(fn)  # includes compilation: the first call of a fresh process
    t = timeit(fn, repeat=2, warmup=0)
    out = fn()
    probe = np.asarray(out[0, :4] if what == "materialize" else out[0], np.float64)
    del out
    return {"seconds": t, "peak_mb": peak, "checksum": float(np.abs(probe).sum()),
            "out_mb": (width if what == "materialize" else 1) * L * L * 4 / 2**20}


def main(quick: bool = False) -> list[dict]:
    shape = QUICK if quick else FULL
    W, L = shape["width"], shape["L"]
    rows = []
    for what in ("materialize", "reduce"):
        ours = isolated("benchmarks.rwkv:case", width=W, L=L, what=what, impl="ours")
        dense = isolated("benchmarks.rwkv:case", width=W, L=L, what=what, impl="dense")
        agree = abs(ours["checksum"] - dense["checksum"]) <= 1e-4 * abs(dense["checksum"])
        label = "materialize()" if what == "materialize" else "reduce('mean')"
        rows.append({"case": f"{label} {W} ch, L={L}", "ours_s": ours["seconds"], "ours_peak_mb": ours["peak_mb"],
                     "baseline": f"dense l + jax.nn.softmax, blocks of {BASE_BLOCK}",
                     "baseline_s": dense["seconds"], "baseline_peak_mb": dense["peak_mb"],
                     "speedup": dense["seconds"] / ours["seconds"],
                     "note": f"output {ours['out_mb']:.0f} MiB; results agree: {agree}"})
    write_results("rwkv_quick" if quick else "rwkv", rows,
                  columns=["case", "ours_s", "ours_peak_mb", "baseline", "baseline_s", "baseline_peak_mb",
                           "speedup", "note"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small shapes, under a minute")
    main(ap.parse_args().quick)
