"""Mamba-2 operator benchmarks on one random layer of mamba2-130m's shape (d_model 768,
24 heads of 64, N 128, 1 group, conv 4) at L = 1024, every case in a fresh process
(time = median wall seconds after a warm-up/compile call; peak = extra resident MiB of the
first call, compilation included):

* ``materialize`` of ``channels`` channels (all 1536 need 6 GiB for the output alone;
  the default is 384 = 6 heads) vs a straightforward dense baseline that evaluates
  ``diag(l) (C B^T * exp(A_h segsum(dt_h)) diag(dt_h) + D_h I) diag(r)`` per channel (q k^T and the
  decay recomputed for every channel, segment sums as an L x L cumsum) and the conv with ``conv_right``;
* ``reduce("mean")`` over all 1536 channels vs the same dense baseline accumulated in blocks,
  and the same mean from ``head_matrices("mean")`` (one rank-64 product per conv tap per head);
* per-head matrices: ``head_matrices("alpha")`` vs the direct per-head formula, and
  ``head_matrices("mean")`` vs materializing each head's 64 channels and averaging.

    python -m benchmarks.mamba2 [--quick]
"""
from __future__ import annotations

import argparse
import functools

from benchmarks.common import isolated, peak_mb_of, timeit, write_results

SHAPE = dict(vocab_size=1024, hidden_size=768, num_heads=24, head_dim=64, state_size=128, n_groups=1,
             num_hidden_layers=1, conv_kernel=4, expand=2, chunk_size=256)
QUICK = dict(vocab_size=256, hidden_size=64, num_heads=4, head_dim=32, state_size=32, n_groups=1,
             num_hidden_layers=1, conv_kernel=4, expand=2, chunk_size=64)
BLOCK = 16  # channels per dense-baseline block


def random_mixer(cfg, seed: int = 0) -> dict:
    """Random mixer weights in numpy (HF-like scales; no JAX compilation)."""
    import numpy as np

    from implicit_attn.registry import FAMILIES

    expected_shapes = FAMILIES["mamba2"].expected_shapes
    rng = np.random.default_rng(seed)
    prefix = "backbone.layers.0.mixer."
    shapes = {k[len(prefix):]: v for k, v in expected_shapes(cfg)[0].items() if k.startswith(prefix)}
    p = {k: (rng.normal(size=s) / np.sqrt(s[-1])).astype(np.float32) for k, s in shapes.items()}
    H = cfg.num_heads
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), H))
    p.update({"dt_bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),
              "A_log": np.log(rng.uniform(1, 16, H)).astype(np.float32),
              "D": (1 + 0.1 * rng.normal(size=H)).astype(np.float32),
              "norm.weight": (1 + 0.1 * rng.normal(size=cfg.d_ssm)).astype(np.float32)})
    if "conv1d.bias" in p:
        p["conv1d.bias"] = (0.1 * rng.normal(size=cfg.conv_dim)).astype(np.float32)
    return p


def _operator(shape: dict, L: int):
    """Operator of one random layer for a random unit-RMS mixer input (what the block's
    pre-norm hands the mixer), so no full-model forward is compiled."""
    import jax
    import numpy as np

    from implicit_attn.families import mamba2
    from implicit_attn.registry import FAMILIES

    cfg = FAMILIES["mamba2"].config(**shape)
    x = np.random.default_rng(1).normal(size=(1, L, cfg.hidden_size)).astype(np.float32)
    return jax.block_until_ready(mamba2.Mamba2Mixer(cfg, random_mixer(cfg)).as_operator(x))


@functools.lru_cache(maxsize=None)
def _dense_block_fn():
    """Dense H for a block of channels, straight from the formula (compiled once)."""
    import jax
    import jax.numpy as jnp

    from implicit_attn.ops import conv_right, segment_sum

    @jax.jit
    def block(core, idx):
        h = core.head[idx]
        g = h // core.heads_per_group
        la = jnp.take(core.log_a, h, axis=1)
        dec = jnp.exp(segment_sum(la))  # (B, c, L, L)
        qk = jnp.einsum("bcin,bcjn->bcij", jnp.take(core.q, g, 1), jnp.take(core.k, g, 1))
        dt = jnp.take(core.dt, h, axis=1)
        L = la.shape[-1]
        alpha = qk * dec * dt[..., None, :] + core.D[h][:, None, None] * jnp.eye(L)
        H = jnp.take(core.left, idx, 1)[..., :, None] * alpha * jnp.take(core.right, idx, 1)[..., None, :]
        return conv_right(H, jnp.take(core.conv_w, idx, 0))

    return block


def dense_materialize(core, channels):
    import jax.numpy as jnp

    block = _dense_block_fn()
    outs = [block(core, jnp.arange(s, min(s + BLOCK, channels))) for s in range(0, channels, BLOCK)]
    return jnp.concatenate(outs, axis=1)


def dense_mean(core):
    import jax
    import jax.numpy as jnp

    block = _dense_block_fn()
    C = core.num_channels
    acc = 0.0
    for s in range(0, C, BLOCK):
        acc = acc + jnp.sum(block(core, jnp.arange(s, min(s + BLOCK, C))), axis=1)
    return jax.block_until_ready(acc / C)


@functools.lru_cache(maxsize=None)
def _dense_alpha_fn():
    import jax
    import jax.numpy as jnp

    from implicit_attn.ops import segment_sum

    @jax.jit
    def run(core):
        H = core.num_heads
        g = jnp.arange(H) // core.heads_per_group
        qk = jnp.einsum("bhin,bhjn->bhij", jnp.take(core.q, g, 1), jnp.take(core.k, g, 1))
        L = qk.shape[-1]
        return qk * jnp.exp(segment_sum(core.log_a)) * core.dt[..., None, :] + core.D[:, None, None] * jnp.eye(L)

    return run


def dense_alpha(core):
    """Per-head alpha directly: full-L segment sums and q k^T per head."""
    return _dense_alpha_fn()(core)


def dense_head_mean(core):
    """Per-head mean of H: materialize each head's channels (in blocks) and average."""
    import jax.numpy as jnp

    block = _dense_block_fn()
    P = core.num_channels // core.num_heads
    out = []
    for h in range(core.num_heads):
        acc = 0.0
        for s in range(h * P, (h + 1) * P, BLOCK):
            acc = acc + jnp.sum(block(core, jnp.arange(s, min(s + BLOCK, (h + 1) * P))), axis=1)
        out.append(acc / P)
    return jnp.stack(out, axis=1)


def case(shape: dict, L: int, what: str, impl: str, channels: int = 0) -> dict:
    import jax
    import numpy as np

    op = _operator(shape, L)
    fns = {
        ("materialize", "ours"): lambda op: op.materialize(channels=np.arange(channels)),
        ("materialize", "dense"): lambda op: dense_materialize(op.core, channels),
        ("reduce", "ours"): lambda op: op.reduce("mean"),
        ("reduce", "heads"): lambda op: op.head_matrices("mean").mean(axis=1),
        ("reduce", "dense"): lambda op: dense_mean(op.core),
        ("alpha", "ours"): lambda op: op.head_matrices("alpha"),
        ("alpha", "dense"): lambda op: dense_alpha(op.core),
        ("head_mean", "ours"): lambda op: op.head_matrices("mean"),
        ("head_mean", "dense"): lambda op: dense_head_mean(op.core),
    }
    f = fns[(what, impl)]
    f = f if impl == "dense" else jax.jit(f)  # the operator is an argument, never a constant
    fn = lambda: f(op)
    peak = peak_mb_of(fn)
    t = timeit(fn, repeat=2, warmup=0)  # the peak call above compiled everything
    out = np.asarray(fn())
    # A fingerprint of the result, to check that ours and the baseline agree.
    probe = out[0, :2] if out.ndim == 4 else out[0]
    return {"seconds": t, "peak_mb": peak, "out_mb": out.nbytes / 2**20,
            "checksum": float(np.abs(probe).sum()), "max": float(np.abs(probe).max())}


def main(quick: bool = False, channels: int | None = None) -> list[dict]:
    shape = QUICK if quick else SHAPE
    L = 128 if quick else 1024
    C = shape["num_heads"] * shape["head_dim"]
    nch = channels or (C if quick else 384)
    rows = []

    def run(what, impl, **kw):
        return isolated("benchmarks.mamba2:case", shape=shape, L=L, what=what, impl=impl, **kw)

    def agree(a, b):
        return abs(a["checksum"] - b["checksum"]) <= 1e-4 * abs(b["checksum"]) + 1e-6

    ours, dense = run("materialize", "ours", channels=nch), run("materialize", "dense", channels=nch)
    rows.append({"case": f"materialize {nch}/{C} ch, L={L}", "ours_s": ours["seconds"], "ours_peak_mb": ours["peak_mb"],
                 "baseline": "dense per-channel formula", "baseline_s": dense["seconds"],
                 "baseline_peak_mb": dense["peak_mb"], "speedup": dense["seconds"] / ours["seconds"],
                 "note": f"output {ours['out_mb']:.0f} MiB; agree: {agree(ours, dense)}"})
    ours, heads, dense = run("reduce", "ours"), run("reduce", "heads"), run("reduce", "dense")
    for name, r in (("reduce('mean')", ours), ("mean via head_matrices('mean')", heads)):
        rows.append({"case": f"{name} {C} ch, L={L}", "ours_s": r["seconds"], "ours_peak_mb": r["peak_mb"],
                     "baseline": f"dense formula, blocks of {BLOCK}", "baseline_s": dense["seconds"],
                     "baseline_peak_mb": dense["peak_mb"], "speedup": dense["seconds"] / r["seconds"],
                     "note": f"agree: {agree(r, dense)}; (B,C,L,L) would be {C * L * L * 4 / 2**30:.1f} GiB"})
    ours, dense = run("alpha", "ours"), run("alpha", "dense")
    rows.append({"case": f"head_matrices('alpha') {shape['num_heads']} heads, L={L}", "ours_s": ours["seconds"],
                 "ours_peak_mb": ours["peak_mb"], "baseline": "per head: L x L cumsum + q k^T",
                 "baseline_s": dense["seconds"], "baseline_peak_mb": dense["peak_mb"],
                 "speedup": dense["seconds"] / ours["seconds"], "note": f"agree: {agree(ours, dense)}"})
    ours, dense = run("head_mean", "ours"), run("head_mean", "dense")
    rows.append({"case": f"head_matrices('mean') {shape['num_heads']} heads, L={L}", "ours_s": ours["seconds"],
                 "ours_peak_mb": ours["peak_mb"], "baseline": "materialize each head's channels, average",
                 "baseline_s": dense["seconds"], "baseline_peak_mb": dense["peak_mb"],
                 "speedup": dense["seconds"] / ours["seconds"], "note": f"agree: {agree(ours, dense)}"})
    write_results("mamba2_quick" if quick else "mamba2", rows,
                  meta={"shape": shape, "L": L, "materialize_channels": nch},
                  columns=["case", "ours_s", "ours_peak_mb", "baseline", "baseline_s", "baseline_peak_mb",
                           "speedup", "note"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, under a minute")
    ap.add_argument("--channels", type=int, default=None, help="channels for the materialize case")
    a = ap.parse_args()
    main(a.quick, a.channels)
