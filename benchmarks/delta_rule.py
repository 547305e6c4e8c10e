"""Delta-rule operator benchmarks: the chunked UT form (``ops.delta_rule_matrix``, what
``DeltaRuleCore`` materializes and reduces with) against the straightforward per-step
recurrence that builds ``M`` row by row (the state carried with one row per source position:
``S <- Diag(a_t) S``, ``S <- S - b_t (S k_t) k_t^T``, ``S[t] += b_t k_t``, row ``t`` of ``M`` is
``S q_t``; a jitted ``lax.scan`` over positions). Random inputs of Qwen3-Next's head shape
(unit keys of width 128, queries scaled by ``128^-1/2``, write strengths in [0, 1], decays in
[e^-1, 1]), one decay per head (Gated DeltaNet) or per key dimension (Kimi Delta Attention).
Every case runs in a fresh process (time = median wall seconds after a compile call; peak =
extra resident MiB of the first call, compilation included); ``agree`` compares the two
results (max abs difference over max abs value).

* ``M``: the per-head matrices of 16 heads at L = 1024;
* ``reduce("mean")`` and ``reduce("abs_mean")`` of a layer operator with 8 value heads of 64
  channels (512 channels; left / right factors and a width-4 conv, as in a Gated DeltaNet layer)
  at L = 1024, ours (``Mamba2Operator.reduce`` over ``DeltaRuleCore``: the mean through each
  head's matrix with one rank-64 matmul per conv tap, ``abs_mean`` per channel in blocks with
  every ``M_h`` computed once) against the recurrence's ``M`` put through the same per-channel
  factors in blocks of 16 channels.

* the DPLR recurrence's ``M`` (``ops.dplr_matrix``) of 16 heads at L = 1024 in RWKV-7's form (the
  low-rank term ``-kk (kk * iclr)^T``, read after the update, with RWKV-7's decay floor: matmul
  chunk factors) and RWKV-6's (read before, a bonus on the diagonal, decays down to e^-5: per-pair
  exponents), against the same per-step recurrence generalised.

    python -m benchmarks.delta_rule [--quick]
"""
from __future__ import annotations

import argparse
import functools

from benchmarks.common import isolated, peak_mb_of, timeit, write_results

FULL = dict(heads=16, dk=128, L=1024, value_heads=8, dv=64)
QUICK = dict(heads=4, dk=32, L=128, value_heads=2, dv=16)
BLOCK = 16


def inputs(heads: int, dk: int, L: int, per_dim: bool, seed: int = 0):
    """``q, k (1, H, L, dk)``, ``log_a (1, H, L[, dk])``, ``beta (1, H, L)`` float32."""
    import jax.numpy as jnp
    import numpy as np

    g = np.random.default_rng(seed)
    unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    q = unit(g.standard_normal((1, heads, L, dk))) * dk ** -0.5
    k = unit(g.standard_normal((1, heads, L, dk)))
    log_a = -g.uniform(0.0, 1.0, (1, heads, L) + ((dk,) if per_dim else ()))
    beta = g.uniform(0.0, 1.0, (1, heads, L))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, log_a, beta))


@functools.lru_cache(maxsize=None)
def recurrence_fn():
    """The per-step recurrence building ``M (B, H, L, L)`` row by row (jitted)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(q, k, log_a, beta):
        B, H, L, dk = k.shape
        per_dim = log_a.ndim == 4

        def step(S, t):  # S (B, H, L, dk): one row per source position
            a = jnp.exp(log_a[:, :, t])
            S = S * (a[:, :, None, :] if per_dim else a[:, :, None, None])
            kt, bt = k[:, :, t], beta[:, :, t]
            S = S - bt[..., None, None] * jnp.einsum("bhsd,bhd->bhs", S, kt)[..., None] * kt[:, :, None, :]
            S = S.at[:, :, t].add(bt[..., None] * kt)
            return S, jnp.einsum("bhsd,bhd->bhs", S, q[:, :, t])

        _, rows = jax.lax.scan(step, jnp.zeros((B, H, L, dk), jnp.float32), jnp.arange(L))
        return jnp.moveaxis(rows, 0, 2)  # (B, H, L, L)

    return run


def dplr_inputs(heads: int, dk: int, L: int, after: bool, seed: int = 0):
    """RWKV-shaped ``q, k, log_w (1, H, L, dk)`` and the low-rank ``a, b`` (RWKV-7: ``-kk``, ``kk *
    iclr``, decays in [e^-0.61, 1]) or the bonus ``(1, H, L)`` (RWKV-6: decays in [e^-5, 1])."""
    import jax.numpy as jnp
    import numpy as np

    g = np.random.default_rng(seed)
    x = lambda *s: jnp.asarray(g.standard_normal(s) * dk ** -0.5, jnp.float32)
    q, k = x(1, heads, L, dk), x(1, heads, L, dk)
    if after:
        kk = g.standard_normal((1, heads, L, dk))
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        log_w = jnp.asarray(-g.uniform(0, 0.61, (1, heads, L, dk)), jnp.float32)
        return dict(q=q, k=k, log_w=log_w, a=jnp.asarray(-kk, jnp.float32),
                    b=jnp.asarray(kk * g.uniform(0, 1, kk.shape), jnp.float32))
    log_w = jnp.asarray(-g.uniform(0, 5.0, (1, heads, L, dk)), jnp.float32)
    return dict(q=q, k=k, log_w=log_w, bonus=jnp.asarray(g.standard_normal((1, heads, L)), jnp.float32))


@functools.lru_cache(maxsize=None)
def dplr_recurrence_fn(after: bool):
    """The per-step DPLR recurrence building ``M (B, H, L, L)`` row by row (jitted): one state row
    per source, ``S[j] <- S[j] Diag(w_t) + (S[j] . a_t) b_t``, ``S[t] += k_t``; row ``t`` of ``M`` is
    ``S q_t`` after the update (RWKV-7) or before it plus the bonus (RWKV-6)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(q, k, log_w, a=None, b=None, bonus=None):
        B, H, L, dk = k.shape

        def step(S, t):
            read = jnp.einsum("bhsd,bhd->bhs", S, q[:, :, t])
            decayed = S * jnp.exp(log_w[:, :, t])[:, :, None, :]
            if a is not None:  # the low-rank read uses the state before the decay
                decayed = decayed + jnp.einsum("bhsd,bhd->bhs", S, a[:, :, t])[..., None] * b[:, :, t][:, :, None, :]
            S = decayed
            S = S.at[:, :, t].add(k[:, :, t])
            if after:
                return S, jnp.einsum("bhsd,bhd->bhs", S, q[:, :, t])
            return S, read.at[:, :, t].add(bonus[:, :, t])

        _, rows = jax.lax.scan(step, jnp.zeros((B, H, L, dk), jnp.float32), jnp.arange(L))
        return jnp.moveaxis(rows, 0, 2)

    return run


def layer_operator(shape: dict, per_dim: bool):
    """A ``Mamba2Operator`` over ``DeltaRuleCore`` with random factors: ``value_heads`` heads of
    ``dv`` channels, key width ``dk``, conv width 4."""
    import jax.numpy as jnp
    import numpy as np

    from implicit_attn.operator import DeltaRuleCore, Mamba2Operator

    H, dv, L = shape["value_heads"], shape["dv"], shape["L"]
    q, k, log_a, beta = inputs(H, shape["dk"], L, per_dim, seed=1)
    g = np.random.default_rng(2)
    C = H * dv
    f = lambda *s: jnp.asarray(g.uniform(0.5, 1.5, s), jnp.float32)
    core = DeltaRuleCore(q=q, k=k, log_a=log_a, beta=beta, head=jnp.repeat(jnp.arange(H), dv), left=f(1, C, L),
                         right=f(1, C, L), conv_w=jnp.asarray(g.standard_normal((C, 4)), jnp.float32))
    v = jnp.zeros((1, C, L), jnp.float32)
    return Mamba2Operator(values=v, offset=v, output=v, core=core)


@functools.lru_cache(maxsize=None)
def block_sum_fn():
    """``sum_c diag(left_c) M_h(c) diag(right_c) Conv_c`` over a block of channels (jitted once)."""
    import jax
    import jax.numpy as jnp

    def block_sum(core, M, idx, absolute: bool):
        H = core.sandwich(jnp.take(M, core.head[idx], axis=1), idx)
        return (jnp.abs(H) if absolute else H).sum(1)

    return jax.jit(block_sum, static_argnums=3)


def recurrence_mean(op, absolute: bool = False):
    """``mean_c H_c`` (``mean_c |H_c|``) with ``M`` from the recurrence and the core's own
    per-channel factors."""
    import jax
    import jax.numpy as jnp

    core = op.core
    M = recurrence_fn()(core.q, core.k, core.log_a, core.beta)
    C = core.num_channels
    acc = sum(block_sum_fn()(core, M, jnp.arange(s, min(s + BLOCK, C)), absolute) for s in range(0, C, BLOCK))
    return jax.block_until_ready(acc / C)


def case(shape: dict, what: str, impl: str, per_dim: bool) -> dict:
    import jax
    import numpy as np

    from implicit_attn.ops import delta_rule_matrix, dplr_matrix

    if what == "M":
        args = inputs(shape["heads"], shape["dk"], shape["L"], per_dim)
        f = jax.jit(delta_rule_matrix) if impl == "ours" else recurrence_fn()
        fn = lambda: f(*args)
    elif what in ("dplr_after", "dplr_before"):
        after = what == "dplr_after"
        kw = dplr_inputs(shape["heads"], shape["dk"], shape["L"], after)
        # RWKV-7's decays are bounded (log w >= -e^-1/2), which the model passes on (factorized chunks)
        floor = -0.6065306597126334 if after else None
        f = (jax.jit(functools.partial(dplr_matrix, after=after, decay_floor=floor)) if impl == "ours"
             else dplr_recurrence_fn(after))
        fn = lambda: f(**kw)
    else:
        op = layer_operator(shape, per_dim)
        how = "abs_mean" if what == "reduce_abs" else "mean"
        reduce = jax.jit(lambda op: op.reduce(how))
        fn = (lambda: reduce(op)) if impl == "ours" else (lambda: recurrence_mean(op, how == "abs_mean"))
    peak = peak_mb_of(fn)
    t = timeit(fn, repeat=2, warmup=0)
    out = np.asarray(fn(), np.float64)
    np.save(f"/tmp/delta_bench_{what}_{impl}_{int(per_dim)}.npy", out)
    return {"seconds": t, "peak_mb": peak, "scale": float(np.abs(out).max())}


def main(quick: bool = False) -> list[dict]:
    import numpy as np

    shape = QUICK if quick else FULL
    L = shape["L"]
    rows = []
    for per_dim in (False, True):
        decay = "per key dim (KDA)" if per_dim else "per head (Gated DeltaNet)"
        for what, label in (("M", f"M of {shape['heads']} heads, d_k {shape['dk']}"),
                            ("reduce", f"reduce('mean') {shape['value_heads'] * shape['dv']} ch"),
                            ("reduce_abs", f"reduce('abs_mean') {shape['value_heads'] * shape['dv']} ch")):
            ours = isolated("benchmarks.delta_rule:case", shape=shape, what=what, impl="ours", per_dim=per_dim)
            base = isolated("benchmarks.delta_rule:case", shape=shape, what=what, impl="recurrence", per_dim=per_dim)
            a = np.load(f"/tmp/delta_bench_{what}_ours_{int(per_dim)}.npy")
            b = np.load(f"/tmp/delta_bench_{what}_recurrence_{int(per_dim)}.npy")
            rows.append({"case": f"{label}, decay {decay}, L={L}", "ours_s": ours["seconds"],
                         "ours_peak_mb": ours["peak_mb"], "baseline": "per-step recurrence, M row by row",
                         "baseline_s": base["seconds"], "baseline_peak_mb": base["peak_mb"],
                         "speedup": base["seconds"] / ours["seconds"],
                         "agree": float(np.abs(a - b).max() / np.abs(b).max())})
    for what, label in (("dplr_after", "DPLR M, RWKV-7 form (low rank, read after)"),
                        ("dplr_before", "DPLR M, RWKV-6 form (read before, bonus)")):
        ours = isolated("benchmarks.delta_rule:case", shape=shape, what=what, impl="ours", per_dim=True)
        base = isolated("benchmarks.delta_rule:case", shape=shape, what=what, impl="recurrence", per_dim=True)
        a = np.load(f"/tmp/delta_bench_{what}_ours_1.npy")
        b = np.load(f"/tmp/delta_bench_{what}_recurrence_1.npy")
        rows.append({"case": f"{label} of {shape['heads']} heads, d_k {shape['dk']}, L={L}",
                     "ours_s": ours["seconds"], "ours_peak_mb": ours["peak_mb"],
                     "baseline": "per-step recurrence, M row by row", "baseline_s": base["seconds"],
                     "baseline_peak_mb": base["peak_mb"], "speedup": base["seconds"] / ours["seconds"],
                     "agree": float(np.abs(a - b).max() / np.abs(b).max())})
    write_results("delta_rule_quick" if quick else "delta_rule", rows, meta={"shape": shape})
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, under a minute")
    main(ap.parse_args().quick)
