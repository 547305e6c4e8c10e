"""Mixture-of-experts feed-forward layers of the hybrid families: routers and the expert
computation, grouped by expert so only the chosen experts run.

Each token's output depends on that token alone (no capacity limits, no token dropping),
so the layers keep causality, NaN in one token included.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..kernels import cpu as cpu_kernels
from ..ops import batched_as_tokens, expert_columns, expert_order, most_in_batch, zero_mapped_with

f32 = jnp.float32


def topk_then_softmax(logits, k: int):
    """GraniteMoe routing: the ``k`` largest logits per token, weighted by the softmax over
    those ``k``. ``logits (T, E) -> (weights (T, k) float32, experts (T, k) int32)``."""
    top, idx = jax.lax.top_k(logits.astype(f32), k)
    return jax.nn.softmax(top, axis=-1), idx


def softmax_then_topk(logits, k: int):
    """Mixtral/Jamba routing: softmax over all experts, then the ``k`` largest probabilities,
    not renormalised. ``logits (T, E) -> (weights (T, k) float32, experts (T, k) int32)``."""
    return jax.lax.top_k(jax.nn.softmax(logits.astype(f32), axis=-1), k)


def sigmoid_group_topk(logits, bias, k: int, n_group: int, topk_group: int, normalize: bool, scale: float,
                       eps: float = 1e-20):
    """DeepSeek-V3 / Nemotron-H routing: sigmoid scores; experts are chosen on ``scores +
    bias`` among the ``topk_group`` of ``n_group`` expert groups with the largest sum of
    their two best biased scores (all experts when ``topk_group == n_group``, LFM2-MoE);
    each chosen expert is weighted by its unbiased score, divided by the chosen scores' sum
    (``+ eps``) if ``normalize``, times ``scale``.
    ``logits (T, E)``, ``bias (E,)`` -> ``(weights (T, k) float32, experts (T, k) int32)``."""
    T, E = logits.shape
    scores = jax.nn.sigmoid(logits.astype(f32))
    choice = scores + jnp.asarray(bias, f32)
    if topk_group < n_group:
        groups = choice.reshape(T, n_group, E // n_group)
        group_score = jax.lax.top_k(groups, 2)[0].sum(-1)  # (T, n_group)
        _, keep = jax.lax.top_k(group_score, topk_group)
        kept = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(kept, E // n_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if normalize:
        w = w / (w.sum(-1, keepdims=True) + eps)
    return w * jnp.asarray(scale, f32), idx


def relu2(x):
    """``relu(x) ** 2`` (HF ``"relu2"``)."""
    return jnp.square(jax.nn.relu(x))


def stack_experts(t: dict, n: int, fused: dict) -> dict:
    """Per-expert checkpoint tensors -> stacked ones (what HF holds in memory).

    Args:
      t: ``{"experts.{e}.{name}": (F, ...)}`` and other tensors (kept as they are).
      n: the number of experts.
      fused: ``{stacked name: [per-expert names concatenated along axis 0]}``, e.g.
        ``{"experts.gate_up_proj": ["gate_proj.weight", "up_proj.weight"]}``.
    Returns:
      ``{stacked name: (n, sum F, ...)}`` plus the other tensors.
    """
    per_expert = {f"experts.{e}.{name}" for e in range(n) for names in fused.values() for name in names}
    out = {k: v for k, v in t.items() if k not in per_expert}
    for stacked, names in fused.items():
        out[stacked] = jnp.stack([jnp.concatenate([jnp.asarray(t[f"experts.{e}.{name}"]) for name in names])
                                  for e in range(n)])
    return out


def split_experts(p: dict, n: int, fused: dict) -> dict:
    """The inverse of ``stack_experts`` (each stacked tensor split into equal parts)."""
    out = {k: v for k, v in p.items() if k not in fused}
    for stacked, names in fused.items():
        for e in range(n):
            for name, part in zip(names, jnp.split(jnp.asarray(p[stacked][e]), len(names))):
                out[f"experts.{e}.{name}"] = part
    return out


def gated_act(act):
    """``u (..., 2F) -> act(u[..., :F]) * u[..., F:]`` (a fused gate/up projection)."""
    def f(u):
        g, up = jnp.split(u, 2, axis=-1)
        return act(g) * up
    return f


def experts_forward(x, weights, experts, w_in, w_out, act, block: int = 256, granule: int = 32,
                    impl: str = "auto"):
    """Weighted sum of the chosen experts' MLPs, ``sum_j weights[t, j] * E_{experts[t, j]}(x[t])``
    with ``E_e(x) = w_out[e] @ act(w_in[e] @ x)``; only the chosen experts run.

    The token copies are sorted by expert. On accelerators the experts run as one grouped
    matmul (``jax.lax.ragged_dot``). On CPU, where that lowering is slow, a float32 layer with
    enough work (``kernels.cpu.grouped_pays_off``) runs on the library's grouped-product kernel:
    the copies laid out in packs of ``GROUP_TILE`` columns, each pack one expert's
    (``ops.expert_columns``), the first product gathering each copy's token
    (``kernels.cpu.grouped_matmul_from_tokens``), the second adding each copy's weighted output
    into its token's (``kernels.cpu.grouped_matmul_to_tokens``), the activation between them by
    XLA. Otherwise a loop runs each
    expert's group in chunks of at most ``block`` rows, each chunk's row count rounded up to
    a multiple of ``granule`` (one static matmul shape per multiple, picked by
    ``lax.switch``), so an expert's weights are read about once per ``block`` of its tokens
    and at most ``granule - 1`` rows per chunk are wasted. Derivatives on CPU (of the kernel's
    path and the loop's) are those of the same loop with the row counts ``granule``,
    ``2 granule``, ``4 granule``, ... up to ``block``: fewer branches to compile, differentiate
    and keep residuals for. The loop only covers as many
    chunks as the routing fills. Rows a chunk computes past its expert's group belong to
    later chunks, which run after it and overwrite them (every row depends on its own token
    only). Copies are moved by gathers (XLA:CPU scatters run element by element), and each
    token sums its ``k`` outputs itself. Under ``jax.vmap`` the mapped examples run as more
    tokens, in one call (``ops.batched_as_tokens``). Derivatives under ``vmap`` batch with jax's
    rules: the loop's switch stays one switch for the batch (``ops.most_in_batch``), and the
    accelerator path maps its unmapped operands with the others (``ops.zero_mapped_with``: the
    experts' weights copied per example), since jax batches ``ragged_dot`` only with every
    operand mapped.

    Args:
      x: ``(T, D)`` tokens; weights: ``(T, k)`` routing weights; experts: ``(T, k)`` int
        expert indices in ``[0, E)``;
      w_in: ``(E, F_in, D)``; w_out: ``(E, D, F)``; act: ``(..., F_in) -> (..., F)``;
      block: the most rows one CPU matmul takes (at most ``T k`` rounded up to the step are
        used); granule: the step of its row counts (``min(granule, block)`` is used);
      impl: the CPU path: ``"auto"`` (the kernel where it pays off), ``"cpu"`` (the kernel:
        float32 inputs, and it must build here), ``"xla"`` (the loop).
    Returns:
      ``(T, D)`` in ``x``'s dtype.
    """
    if block < 1 or granule < 1:
        raise ValueError(f"experts_forward: block and granule must be >= 1, got {block} and {granule}")
    if impl not in ("auto", "cpu", "xla"):
        raise ValueError(f"experts_forward: impl must be 'auto', 'cpu' or 'xla', got {impl!r}")
    w_in, w_out = jnp.asarray(w_in), jnp.asarray(w_out)

    # Each token's output depends on that token alone: under jax.vmap the examples run as more
    # tokens, in one call (jax batches ragged_dot only with every operand mapped).
    @partial(batched_as_tokens, n_tokens=3)
    def routed(x, weights, experts, w_in, w_out):
        T, k = experts.shape
        E = w_in.shape[0]
        n = T * k
        copies = experts.reshape(-1)  # copy t k + j: token t's j-th expert
        order, rank, sizes = expert_order(copies, E)  # token copies grouped by expert

        def combine(o, weights):  # (n, D) copies -> (T, D): each token's weighted sum
            return jnp.einsum("tkd,tk->td", o.reshape(T, k, -1), weights.astype(o.dtype))

        # The routing (order, rank, sizes, copies) is passed to each path, not closed over: a custom_jvp
        # rule may not close over values traced outside it (a router's).
        def grouped(x, weights, w_in, w_out, order, rank, sizes, copies):
            # jax batches ragged_dot only with every operand mapped: under vmap (derivatives; the
            # forward folds) the unmapped operands, and their tangents, are copied per example
            # (the experts' weights, or the tokens under a vmap over models). Alone this
            # multiplies by one (XLA drops it).
            z = zero_mapped_with(*map(jax.lax.stop_gradient, (x, w_in, w_out)), sizes)
            mapped = lambda a: a * (1 + z).astype(a.dtype)
            x, w_in, w_out, sizes = mapped(x), mapped(w_in), mapped(w_out), sizes + z.astype(sizes.dtype)
            xs = x[order // k]
            u = jax.lax.ragged_dot(xs, jnp.swapaxes(w_in, 1, 2), sizes)
            return combine(jax.lax.ragged_dot(act(u), jnp.swapaxes(w_out, 1, 2), sizes)[rank], weights)

        # No chunk holds more rows than there are copies: fewer branches to compile for short inputs.
        g = min(granule, block)
        chunk = min(block, max(g, -(-n // g) * g))  # the most rows one chunk takes

        def chunked(counts):
            """The loop with chunks of the row counts ``counts`` (ascending, the last ``chunk``)."""
            def run(x, weights, w_in, w_out, order, rank, sizes, copies):
                D = w_out.shape[1]
                starts = jnp.cumsum(sizes) - sizes
                dtype = jnp.result_type(x, w_in, w_out)
                padded = (sizes + chunk - 1) // chunk * chunk  # each group as whole chunks
                end = jnp.cumsum(padded)
                first = jnp.arange(-(-(n + E * (chunk - 1)) // chunk)) * chunk  # enough chunks for any routing
                owner = jnp.minimum(jnp.searchsorted(end, first, side="right"), E - 1)
                within = first - (end - padded)[owner]  # the chunk's first row within its group
                filled = jnp.clip(sizes[owner] - within, 0, chunk)
                at = jnp.where(filled > 0, starts[owner] + within, n)  # unused chunks write past the copies
                xs = jnp.concatenate([x[order // k], jnp.zeros((chunk, x.shape[1]), x.dtype)])

                def rows(m):
                    def f(e, a):
                        y = (act(jax.lax.dynamic_slice_in_dim(xs, a, m) @ w_in[e].T) @ w_out[e].T).astype(dtype)
                        return jnp.pad(y, ((0, chunk - m), (0, 0)))
                    return f

                branches = [lambda e, a: jnp.zeros((chunk, D), dtype)] + [rows(m) for m in counts]

                def one(out, c):  # lax.switch, not a loop of dynamic length: reverse-mode differentiable
                    e, a, f = c  # f rows run as the fewest of counts >= f
                    pick = jnp.where(f > 0, 1 + jnp.searchsorted(jnp.asarray(counts), f, method="compare_all"), 0)
                    # more rows give the same numbers: under vmap (derivatives; the forward folds) one
                    # switch for the batch, not a select that reverse mode cannot transpose
                    pick = most_in_batch(pick)
                    y = jax.lax.switch(pick, branches, e, a)
                    return jax.lax.dynamic_update_slice_in_dim(out, y, a, 0), None

                out, _ = jax.lax.scan(one, jnp.zeros((n + chunk, D), dtype), (owner, at, filled))
                return combine(out[rank], weights)
            return run

        # The forward rounds each chunk's rows up to the granule; derivatives, whose every branch is
        # differentiated and keeps residuals, round up to the granule doubled up to the chunk size: half
        # the branches or fewer (at 512 tokens, 8 experts, widths 768 and 1024: the gradient's
        # compile 5.4 -> 3.3 s, its run 0.72 -> 0.61 s; the forward's run would be 25% slower).
        counts = [*range(g, chunk, g), chunk]
        doubled = sorted({*(g << i for i in range(chunk.bit_length()) if g << i < chunk), chunk})
        loop = chunked(counts)
        loop_derivatives = loop if doubled == counts else chunked(doubled)

        def packed(x, weights, w_in, w_out, order, rank, sizes, copies):  # the kernels' layout: (packs, features, tile)
            col, owner = expert_columns(copies, rank, sizes, cpu_kernels.GROUP_TILE)
            col = col.reshape(T, k)
            u = cpu_kernels.grouped_matmul_from_tokens(x, col, owner, w_in)
            h = jnp.swapaxes(act(jnp.swapaxes(u, 1, 2)), 1, 2)
            return cpu_kernels.grouped_matmul_to_tokens(h, col, weights.astype(h.dtype), owner, w_out)

        def differentiated_by_the_loop(forward):  # forward's values, loop_derivatives' tangents
            f = jax.custom_jvp(forward)
            f.defjvp(lambda p, t: (f(*p), jax.jvp(loop_derivatives, p, t)[1]))
            return f

        f32 = all(a.dtype == jnp.float32 for a in (x, w_in, w_out))
        if impl == "cpu":
            if not f32:
                raise ValueError(f"experts_forward: impl='cpu' takes float32 tokens and weights, got {x.dtype}, "
                                 f"{w_in.dtype} and {w_out.dtype}")
            cpu_kernels.load()
        kernel = impl == "cpu" or (impl == "auto" and f32
                                   and cpu_kernels.grouped_pays_off(n, x.shape[1], w_in.shape[1]))
        # the loop alone where its derivatives would run the same counts (no second forward for residuals)
        on_cpu = differentiated_by_the_loop(packed) if kernel else (
            loop if loop_derivatives is loop else differentiated_by_the_loop(loop))
        out = jax.lax.platform_dependent(x, weights, w_in, w_out, order, rank, sizes, copies, cpu=on_cpu,
                                         default=grouped)
        return out.astype(x.dtype)

    return routed(x, weights, experts, w_in, w_out)


__all__ = ["topk_then_softmax", "softmax_then_topk", "sigmoid_group_topk", "relu2", "gated_act", "experts_forward",
           "stack_experts", "split_experts"]
