"""Griffin / RecurrentGemma benchmarks: the operator of one recurrent layer at
recurrentgemma-2b's width (d_model = lru width = 2560, 10 gate blocks, conv width 4;
random weights) for L = 1024, every case in a fresh process:

* ``materialize`` of 256 channels (1 GiB of float32 output; all 2560 would be 10 GiB)
  vs a straightforward dense baseline: per block of 32 channels, the decay matrix by a
  cumulative product down the rows, the gates as diagonals, then the conv as an explicit
  banded ``(L, L)`` matrix product;
* ``reduce("mean")`` over all 2560 channels vs the same baseline (conv applied without
  the matrix, so that it finishes) accumulated block by block.

Everything is ``jax.jit``-compiled; peak memory is taken over the first call (which
compiles), time over a second call.

    python -m benchmarks.griffin [--quick]
"""
from __future__ import annotations

import argparse

from benchmarks.common import isolated, peak_mb_of, write_results

FULL = dict(width=2560, heads=10, L=1024, mat_channels=256)
QUICK = dict(width=128, heads=4, L=128, mat_channels=32)
BLOCK = 32


def _operator(width: int, heads: int, L: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    from implicit_attn.registry import FAMILIES

    spec = FAMILIES["recurrent_gemma"]
    cfg = spec.config(vocab_size=256, hidden_size=width, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=heads, lru_width=width, block_types=("recurrent",))
    params = spec.init_params(cfg, jax.random.PRNGKey(seed))
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, L, width), jnp.float32)
    return spec.lm(cfg, params).layers[0].mixer.as_operator(x)


def _baseline_pieces(op):
    """``a (B, C, L)`` decays (``exp`` of the core's log decays), left/right diagonals, conv taps."""
    import jax.numpy as jnp

    core = op.core
    return jnp.exp(core.log_a), core.left, core.right, core.conv_w


def _baseline_block(a, left, right, w, explicit_conv: bool):
    """Dense ``H`` of a block of channels: ``P[i, j] = prod_{k=j+1..i} a_k`` by a cumulative
    product of ``X[i, j] = a_i (i > j), 1 (i <= j)`` down the rows, masked to ``i >= j``."""
    import jax.numpy as jnp

    from implicit_attn.ops import conv_matrix, conv_right

    L = a.shape[-1]
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    X = jnp.where(i > j, a[..., :, None], 1.0)
    P = jnp.where(i >= j, jnp.cumprod(X, axis=-2), 0.0)
    H = left[..., :, None] * P * right[..., None, :]
    if explicit_conv:
        return jnp.einsum("bcik,ckj->bcij", H, conv_matrix(w, L))
    return conv_right(H, w)


def case_materialize(width: int, heads: int, L: int, channels: int, impl: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    op = _operator(width, heads, L)
    idx = jnp.arange(channels)
    if impl in ("ours", "xla"):  # ours: the default impl (the fused CPU kernel on CPU)
        kw = {"impl": "xla"} if impl == "xla" else {}
        f = jax.jit(lambda o: o.materialize(idx, **kw))
        fn = lambda: f(op)
    else:
        a, left, right, w = _baseline_pieces(op)
        blk = jax.jit(lambda a, l, r, w: _baseline_block(a, l, r, w, explicit_conv=True))
        fn = lambda: jnp.concatenate([blk(a[:, s:s + BLOCK], left[:, s:s + BLOCK], right[:, s:s + BLOCK],
                                          w[s:s + BLOCK]) for s in range(0, channels, BLOCK)], axis=1)
    peak = peak_mb_of(fn)  # first call: compiles, and sets the memory high-water mark
    t, out = _timed(fn)
    out = np.asarray(out[0, :4], np.float64)
    return {"seconds": t, "peak_mb": peak, "out_mb": channels * L * L * 4 / 2**20,
            "checksum": float(np.abs(out).sum())}


def case_reduce(width: int, heads: int, L: int, impl: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    op = _operator(width, heads, L)
    if impl in ("ours", "xla"):
        kw = {"impl": "xla"} if impl == "xla" else {}
        f = jax.jit(lambda o: o.reduce("mean", **kw))
        fn = lambda: f(op)
    else:
        a, left, right, w = _baseline_pieces(op)
        blk = jax.jit(lambda a, l, r, w: _baseline_block(a, l, r, w, explicit_conv=False).sum(1))

        def fn():
            acc = jnp.zeros((1, L, L), jnp.float32)
            for s in range(0, width, BLOCK):
                acc = acc + blk(a[:, s:s + BLOCK], left[:, s:s + BLOCK], right[:, s:s + BLOCK], w[s:s + BLOCK])
            return acc / width
    peak = peak_mb_of(fn)  # first call: compiles, and sets the memory high-water mark
    t, out = _timed(fn)
    return {"seconds": t, "peak_mb": peak, "checksum": float(np.abs(np.asarray(out, np.float64)).sum())}


def _timed(fn):
    """Wall seconds of one (already compiled) ``fn()`` call, and its result."""
    import time

    import jax

    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t, out


def _agree(x: dict, y: dict) -> bool:
    return abs(x["checksum"] - y["checksum"]) <= 1e-4 * abs(y["checksum"])


def main(quick: bool = False) -> list[dict]:
    s = QUICK if quick else FULL
    W, Hd, L, Cm = s["width"], s["heads"], s["L"], s["mat_channels"]
    rows = []
    ours = isolated("benchmarks.griffin:case_materialize", width=W, heads=Hd, L=L, channels=Cm, impl="ours")
    base = isolated("benchmarks.griffin:case_materialize", width=W, heads=Hd, L=L, channels=Cm, impl="dense")
    xla = isolated("benchmarks.griffin:case_materialize", width=W, heads=Hd, L=L, channels=Cm, impl="xla")
    rows.append({"case": f"materialize {Cm} of {W} ch, L={L}", "ours_s": ours["seconds"],
                 "ours_peak_mb": ours["peak_mb"],
                 "baseline": f"cumprod decay + explicit conv matmul, blocks of {BLOCK}",
                 "baseline_s": base["seconds"], "baseline_peak_mb": base["peak_mb"],
                 "speedup": base["seconds"] / ours["seconds"],
                 "note": f"output {ours['out_mb']:.0f} MiB; results agree: {_agree(ours, base)}; "
                         f"impl='xla' {xla['seconds']:.3g} s ({base['seconds'] / xla['seconds']:.1f}x)"})
    ours = isolated("benchmarks.griffin:case_reduce", width=W, heads=Hd, L=L, impl="ours")
    base = isolated("benchmarks.griffin:case_reduce", width=W, heads=Hd, L=L, impl="dense")
    xla = isolated("benchmarks.griffin:case_reduce", width=W, heads=Hd, L=L, impl="xla")
    rows.append({"case": f"reduce('mean') {W} ch, L={L}", "ours_s": ours["seconds"],
                 "ours_peak_mb": ours["peak_mb"], "baseline": f"cumprod decay + conv_right, blocks of {BLOCK}",
                 "baseline_s": base["seconds"], "baseline_peak_mb": base["peak_mb"],
                 "speedup": base["seconds"] / ours["seconds"],
                 "note": f"(B,C,L,L) would be {W * L * L * 4 / 2**30:.1f} GiB; results agree: {_agree(ours, base)}; "
                         f"impl='xla' {xla['seconds']:.3g} s ({base['seconds'] / xla['seconds']:.1f}x)"})
    write_results("griffin_quick" if quick else "griffin", rows,
                  columns=["case", "ours_s", "ours_peak_mb", "baseline", "baseline_s", "baseline_peak_mb",
                           "speedup", "note"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small shapes, under a minute")
    main(ap.parse_args().quick)
