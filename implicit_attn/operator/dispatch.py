"""How ``materialize`` and ``reduce`` are computed: the XLA reference paths, and a registry
of kernel backends (Pallas, the fused CPU kernels) that register themselves per core type.

The operator layer never imports a kernel: ``implicit_attn.kernels`` registers its
backends here when the package is imported (``import implicit_attn`` does it), each with
the core types it takes. ``resolve_impl`` then turns ``impl="auto" | "xla" | <backend>``
into the path to run for a given core.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from ..ops import full_precision
from .base import MODES, apply_mode, applied_block, block_size


@dataclasses.dataclass
class KernelBackend:
    """A family of kernels behind ``impl=name``.

    Attributes:
      name: the ``impl`` string (``"pallas"``, ``"cpu"``).
      dense: ``(core, idx) -> (B, n, L, L)`` float32, differentiable.
      reduce: ``(core, idx, how, qw, kw) -> (B, L, L)`` float32, differentiable.
      auto: ``() -> bool``: whether ``impl="auto"`` considers this backend on the current
        JAX backend.
      require: ``() -> None``: raise (naming the problem) if ``impl=name`` cannot run here.
      ready: ``() -> bool``: whether ``impl="auto"`` may use it now (never raises; may
        warn once).
      cores: core type -> ``core -> str | None``, why that core cannot run (None: it can).
      trusted: ``core -> bool``: whether ``impl="auto"`` may pick this backend for ``core`` on
        the current platform (a kernel known to compile and run there). Explicit
        ``impl=name`` does not ask.
      pays_off: ``core -> bool``: whether ``core`` is big enough for this backend to be worth
        its start-up cost (a library to compile on first use) under ``impl="auto"``; asked
        before ``ready``, so a small operator never triggers the build. Explicit
        ``impl=name`` does not ask.
    """

    name: str
    dense: Callable
    reduce: Callable
    auto: Callable[[], bool]
    require: Callable[[], None] = lambda: None
    ready: Callable[[], bool] = lambda: True
    cores: dict = dataclasses.field(default_factory=dict)
    trusted: Callable = lambda core: True
    pays_off: Callable = lambda core: True

    def problem(self, core) -> str | None:
        """Why this backend cannot take ``core`` (None if it can)."""
        check = self.cores.get(type(core))
        if check is None:
            names = ", ".join(sorted(t.__name__ for t in self.cores))
            return f"no kernel for {type(core).__name__} (kernels exist for: {names})"
        return check(core)

    def check_core(self, core):
        """Raise ``TypeError`` naming ``core`` if this backend has no kernel for it."""
        why = self.problem(core)
        if why:
            raise TypeError(f"impl={self.name!r} cannot take this {type(core).__name__}: {why}. "
                            "Use impl='xla' (or 'auto') for this operator.")


_BACKENDS: dict[str, KernelBackend] = {}
# (backend, core type) pairs whose kernel failed under impl="auto": auto uses XLA for them.
_FAILED: set[tuple[str, type]] = set()


def register_backend(backend: KernelBackend) -> KernelBackend:
    """Make ``impl=backend.name`` available (a kernels module calls this at import)."""
    _BACKENDS[backend.name] = backend
    return backend


def register_core(name: str, core_type: type, check: Callable | None = None):
    """Declare that backend ``name`` takes cores of ``core_type`` (``check(core)`` returns
    why a particular core cannot run, or None)."""
    _BACKENDS[name].cores[core_type] = check or (lambda core: None)


def backend(name: str) -> KernelBackend:
    """The registered backend ``name`` (ValueError if none is)."""
    if name not in _BACKENDS:
        raise ValueError(f"impl={name!r} has no registered kernels (registered: {sorted(_BACKENDS)}); "
                         "import implicit_attn (or implicit_attn.kernels) to register them")
    return _BACKENDS[name]


def impls() -> tuple[str, ...]:
    """Every accepted ``impl``: ``"auto"``, ``"xla"`` and the registered backends."""
    return ("auto", "xla") + tuple(_BACKENDS)


def resolve_impl(impl: str, core=None) -> str:
    """Resolve ``impl`` for ``core``.

    ``"auto"``: the first registered backend that is active on this JAX backend, takes
    ``core``, is trusted for it on this platform, has not failed for its type, pays off at
    ``core``'s size, and is ready (a kernel that cannot be built here warns once and is
    skipped), else ``"xla"``. A
    backend named explicitly raises ``TypeError`` for a core it does not take and its own
    error where it cannot run here.
    """
    if impl not in impls():
        raise ValueError(f"impl must be one of {impls()}, got {impl!r}")
    if impl == "xla":
        return "xla"
    if impl != "auto":
        b = _BACKENDS[impl]
        b.require()
        if core is not None:
            b.check_core(core)
        return impl
    if core is None:
        return "xla"
    for b in _BACKENDS.values():
        if (b.auto() and b.problem(core) is None and (b.name, type(core)) not in _FAILED
                and b.trusted(core) and b.pays_off(core) and b.ready()):
            return b.name
    return "xla"


def failed_kernels() -> set[tuple[str, type]]:
    """The ``(backend, core type)`` pairs that failed under ``impl="auto"`` in this process."""
    return set(_FAILED)


def clear_failed_kernels():
    """Forget the recorded failures (``impl="auto"`` may try those kernels again)."""
    _FAILED.clear()


def default_platform() -> str:
    """The lowering platform of JAX's default backend: ``"cpu"``, ``"cuda"``, ``"rocm"``,
    ``"tpu"``, ... (``jax.default_backend()`` and the client say ``"gpu"`` for every GPU
    platform; ``jax.extend.backend.backends()`` names each backend by its platform)."""
    default = jax.extend.backend.get_backend()
    for name, client in jax.extend.backend.backends().items():
        if client is default:
            return name
    return jax.default_backend()


def with_fallback(requested: str, impl: str, core, kernel: Callable, xla: Callable):
    """``kernel()``, except that under ``impl="auto"`` a kernel that raises (a compile or
    run-time failure on this machine) warns once, is not picked again for this core type,
    and ``xla()`` gives the result. An explicitly requested kernel raises as it is.
    (Inside an outer ``jit`` a compile failure surfaces when the caller compiles; ``auto``
    picks only trusted kernels there.)

    ``auto`` chooses a kernel for the platform JAX runs on here, so the kernel is used
    only where the computation is lowered for that platform: lowered for another one
    (``jax.export(..., platforms=["cuda"])`` on a CPU machine) it is ``xla()``."""
    if impl == "xla" or requested != "auto":
        return kernel()
    try:
        return jax.lax.platform_dependent(**{default_platform(): kernel}, default=xla)
    except Exception as e:  # noqa: BLE001 - any kernel failure: fall back, loudly
        _FAILED.add((impl, type(core)))
        warnings.warn(f"implicit_attn: impl={impl!r} failed for {type(core).__name__} on this machine; "
                      f"using XLA instead (impl='auto' will not pick it again): "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=3)
        return xla()


def dense_fn(core, impl: str):
    """``idx -> (B, len(idx), L, L)`` for a resolved ``impl``."""
    if impl == "xla":
        return core.dense
    return functools.partial(_BACKENDS[impl].dense, core)


def materialize_blocks(core, idx, bc: int, impl: str, B: int, L: int):
    """``(B, n, L, L)`` for channels ``idx (n,)``, ``bc`` channels per step (the last block
    is shifted back to end at ``n`` so every block is full and written in place)."""
    dense = dense_fn(core, impl)
    n = idx.shape[0]
    # Kernels write their output directly. Concrete channels stay numpy: a head core then forms only
    # their heads' matrices (``channel_heads``).
    if impl != "xla" or bc >= n:
        return dense(idx)
    heads = None if isinstance(idx, jax.core.Tracer) else core.heads_to_precompute(idx)
    return over_blocks(dense_fn(core.precompute(heads), impl), jnp.asarray(idx), bc,
                       jnp.zeros((B, n, L, L), jnp.float32))


def over_blocks(block, idx, step: int, out):
    """``out (B, n, ...)`` with ``block(sel)`` written at the place of each block ``sel`` of ``step``
    consecutive channels of ``idx (n,)``, in one ``fori_loop`` (the last block shifted back to end
    at ``n``, so every block is full and written in place)."""
    n = idx.shape[0]
    nb = -(-n // step)
    starts = jnp.minimum(jnp.arange(nb) * step, n - step)

    def body(k, out):
        s = starts[k]
        return jax.lax.dynamic_update_slice_in_dim(out, block(jax.lax.dynamic_slice_in_dim(idx, s, step)), s, axis=1)

    return jax.lax.fori_loop(0, nb, body, out)


# Compiled once per (core structure, channels, block size, impl): eager calls reuse it.
materialize_jit = jax.jit(
    full_precision(lambda core, idx, bc, impl, B, L: materialize_blocks(core, np.asarray(idx), bc, impl, B, L)),
    static_argnums=(1, 2, 3, 4, 5))


# Elements of the dense operator ``apply`` holds at once (1 GiB of float32): larger selections are
# applied in blocks of channels.
APPLY_BUDGET = 1 << 28


def applied_blocks(spec: str, core, values, offset, idx, step: int, impl: str):
    """``H @ values + offset`` for the channels ``idx (n,)`` (``applied_block``), ``H`` formed by a
    resolved ``impl`` ``step`` channels at a time in one loop (the last block shifted back to end at
    ``n``): ``(B, n, L)``, or ``(B, n, L, d)`` for ``values (B, H, L, d)``."""
    n = idx.shape[0]
    if step < n and impl == "xla":
        core = core.precompute()
    dense = dense_fn(core, impl)
    block = lambda sel: applied_block(spec, dense(sel), values, offset, sel)
    if step >= n:
        return block(idx)
    out = jax.eval_shape(block, idx[:step])
    return over_blocks(block, idx, step, jnp.zeros(out.shape[:1] + (n,) + out.shape[2:], out.dtype))


# One compilation per (core structure, number of channels, block size, impl): the blocks' channels are traced.
applied_blocks_jit = jax.jit(full_precision(applied_blocks), static_argnums=(0, 5, 6))


def apply_in_blocks(spec: str, core, values, offset, idx):
    """``H @ values + offset`` for the channels ``idx (n,)`` by ``impl="auto"`` (a kernel, falling
    back to XLA as ``with_fallback`` does), the dense ``H`` held at most ``APPLY_BUDGET`` elements
    at a time, in one compiled program.

    Args:
      spec: ``applied_block``'s product; core: the operator's core; values, offset: ``(B, C, L)``
        (or ``(B, H, L, d)``); idx: ``(n,)`` int channels (or heads), concrete or traced.
    Returns:
      ``(B, n, L)`` (``(B, n, L, d)``).
    """
    B, L = values.shape[0], values.shape[2]
    step = max(1, APPLY_BUDGET // max(1, B * L * L))
    idx = jnp.asarray(idx)
    impl = resolve_impl("auto", core)
    run = lambda impl: applied_blocks_jit(spec, core, values, offset, idx, step, impl)
    return with_fallback("auto", impl, core, lambda: run(impl), lambda: run("xla"))


def sum_over_channels(x):
    """``x.sum(axis=1)`` for ``x (B, c, ...)``, as halves added pairwise (an odd last channel first
    added to channel 0): XLA:CPU reduces over a non-minor axis one strided element at a time
    (8 channels of 512 x 512: 5 ms, against 0.4 ms in halves; the XLA reduce of Mamba-1's
    benchmark layer, 64 channels a block, 1.7-2.1 s against 2.9-3.0 s)."""
    while x.shape[1] > 1:
        if x.shape[1] % 2:
            x = jnp.concatenate([x[:, :1] + x[:, -1:], x[:, 1:-1]], axis=1)
        h = x.shape[1] // 2
        x = x[:, :h] + x[:, h:]
    return x[:, 0]


def blocked_reduce(core, idx, qw, kw, how, bc: int, dense=None, heads=None):
    """``sum_c qw[b,c,i] f(H[b,c,i,j]) kw[b,c,j]`` over ``idx`` in blocks of ``bc`` channels.

    The reference reduction (and the backward pass of every fused kernel): a ``lax.scan``
    over channel blocks with rematerialisation, so memory stays ``O(B L^2 bc)`` forward
    and backward.

    Args:
      core: any ``OperatorCore``; idx: ``(n,)`` int channels; how: a key of ``MODES`` or
        its int mode (an int32 array may be traced);
      qw, kw: ``(B, n, L)`` float32 query / key weights (``1/n`` in ``qw`` for the means);
      bc: channels per block;
      dense: ``dense(core, block_idx) -> (B, bc, L, L)``, each block's matrices (a CPU
        kernel's); None: ``core.dense``;
      heads: ``core.heads_to_precompute(idx)`` (may be traced): only these heads' shared parts
        are computed before the loop; None: those of concrete ``idx``'s heads, or every head's.
    Returns:
      ``(B, L, L)`` float32.
    """
    B, n, L = qw.shape
    nb = -(-n // bc)
    pad = nb * bc - n
    # Padded channels carry zero weight, so they add nothing; they repeat the last channel, whose
    # head's parts are computed.
    idx_b = jnp.pad(jnp.asarray(idx), (0, pad), mode="edge").reshape(nb, bc)
    qw_b = jnp.moveaxis(jnp.pad(qw, ((0, 0), (0, pad), (0, 0))).reshape(B, nb, bc, L), 1, 0)
    kw_b = jnp.moveaxis(jnp.pad(kw, ((0, 0), (0, pad), (0, 0))).reshape(B, nb, bc, L), 1, 0)
    mode = MODES[how] if isinstance(how, str) else how
    if heads is None and not isinstance(idx, jax.core.Tracer):
        heads = core.heads_to_precompute(np.asarray(idx))
    core = core.precompute(heads)
    form = core.dense if dense is None else functools.partial(dense, core)

    def body(acc, xs):
        ib, qb, kb = xs
        H = apply_mode(form(ib), mode)
        # A fused multiply-and-sum: the 3-operand einsum lowers to a transposing
        # dot_general that costs ~10x more CPU here.
        return acc + sum_over_channels(H * qb[..., :, None] * kb[..., None, :]), None

    acc0 = jnp.zeros((B, L, L), jnp.float32)
    out, _ = jax.lax.scan(jax.checkpoint(body), acc0, (idx_b, qw_b, kw_b))
    return out


blocked_reduce_jit = jax.jit(full_precision(blocked_reduce), static_argnums=(4, 5))


def blocked_reduce_by(core, idx, qw, kw, how, part_dense):
    """``blocked_reduce`` of a core built from other cores (``ParallelCore``, ``BidirectionalCore``)
    with each block formed by ``core.dense_by(block_idx, part_dense)``, i.e. by its parts' kernels:
    ``(B, L, L)`` float32 for ``qw, kw (B, n, L)``; ``how`` as for ``blocked_reduce``."""
    B, n, L = qw.shape
    return blocked_reduce(core, idx, qw, kw, how, block_size(n, B, L, None),
                          dense=lambda c, i: c.dense_by(i, part_dense))


def repeated_reduce(part, qw, kw, mode, r: int, dense):
    """``sum_c qw_c f(H_c) kw_c`` over every channel of ``part``, each repeated ``r`` times in a row
    (an attention head read by each of its value features): the repeats share ``H_m``, so their
    weights sum first, ``f(H_m) * (Q_m^T K_m)`` with ``Q_m, K_m (r, L)`` the slots' weights; each
    ``H_m`` is formed once, by ``dense(part, idx)``, one rank-``r`` product per channel.

    Args:
      part: a core of ``m`` channels; qw, kw: ``(B, m r, L)``; mode: an int of ``MODES`` (may be
        traced); r: the repeats; dense: ``(core, idx) -> (B, len(idx), L, L)``.
    Returns:
      ``(B, L, L)`` float32.
    """
    B, _, L = qw.shape
    m = part.num_channels
    q = jnp.moveaxis(qw.reshape(B, m, r, L), 1, 0)
    k = jnp.moveaxis(kw.reshape(B, m, r, L), 1, 0)

    def one(acc, xs):
        c, qc, kc = xs
        H = apply_mode(dense(part, c[None])[:, 0], mode)
        return acc + H * jnp.einsum("bri,brj->bij", qc, kc), None

    out, _ = jax.lax.scan(one, jnp.zeros((B, L, L), jnp.float32), (jnp.arange(m), q, k))
    return out


# ``dense`` is static: pass a module-level function, so one compilation per shape serves every call.
repeated_reduce_jit = jax.jit(full_precision(repeated_reduce), static_argnums=(4, 5))


def parallel_reduce(core, idx, how: str, qw, kw, dense, reduce):
    """A ``ParallelCore``'s reduce as the sum of its parts' reduces, each part over its own channels
    with their weights; a part whose channels are all present, each repeated in a row, forms each
    of its matrices once (``repeated_reduce``).

    Args:
      core: a ``ParallelCore``; idx: ``(n,)`` concrete int channels; how: a key of ``MODES``;
      qw, kw: ``(B, n, L)`` float32;
      dense: ``(part, idx) -> (B, len(idx), L, L)``, a part's matrices (a module-level function);
      reduce: ``(part, local_idx, how, qw, kw) -> (B, L, L)``, a part's reduce.
    Returns:
      ``(B, L, L)`` float32.
    """
    idx = np.asarray(idx)
    part_of = np.searchsorted(core.starts, idx, side="right") - 1
    B, _, L = qw.shape
    out = jnp.zeros((B, L, L), jnp.float32)
    for k, (part, r) in enumerate(zip(core.parts, core.repeats)):
        sel = np.flatnonzero(part_of == k)
        if not sel.size:
            continue
        local = (idx[sel] - core.starts[k]) // r
        q, w = jnp.take(qw, jnp.asarray(sel), axis=1), jnp.take(kw, jnp.asarray(sel), axis=1)
        if r > 1 and np.array_equal(local, np.repeat(np.arange(part.num_channels), r)):
            out = out + repeated_reduce_jit(part, q, w, jnp.asarray(MODES[how], jnp.int32), r, dense)
        else:
            out = out + reduce(part, local, how, q, w)
    return out


def _float0(x):
    return np.zeros(np.shape(x), jax.dtypes.float0)


def channel_key(idx) -> tuple[int, ...]:
    """Concrete channels ``idx (n,)`` (numpy, a list or a concrete array) as a hashable tuple of ints."""
    return tuple(int(i) for i in np.asarray(idx).reshape(-1))


def with_xla_backward(dense_kernel: Callable, reduce_kernel: Callable):
    """Wrap a kernel's forward passes so that gradients flow through the XLA reference.

    Args:
      dense_kernel: ``(core, idx) -> (B, n, L, L)``.
      reduce_kernel: ``(core, idx, mode, qw, kw) -> (B, L, L)`` with ``mode`` an int32
        array (``MODES``; traced, so one compilation serves every reduction).
    Returns:
      ``(dense, reduce)`` with the same signatures and a ``custom_vjp`` whose backward pass
      is ``jax.vjp`` of ``core.dense`` / of ``blocked_reduce``. Both pass concrete channels to
      the kernel as a numpy array even inside ``jit`` (a static argument of the ``custom_vjp``),
      so a kernel can see which heads they touch while tracing.
    """
    @jax.custom_vjp
    def traced_dense(core, idx):
        return dense_kernel(core, idx)

    def traced_fwd(core, idx):
        return dense_kernel(core, idx), (core, idx)

    @full_precision  # traced when the gradient is, outside the caller's full_precision
    def traced_bwd(res, g):
        core, idx = res
        _, vjp = jax.vjp(lambda c: c.dense(idx), core)
        return vjp(g)[0], _float0(idx)

    traced_dense.defvjp(traced_fwd, traced_bwd)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def static_dense(core, key):
        return dense_kernel(core, np.asarray(key, np.int32))

    def static_fwd(core, key):
        return dense_kernel(core, np.asarray(key, np.int32)), core

    @full_precision
    def static_bwd(key, core, g):
        _, vjp = jax.vjp(lambda c: c.dense(np.asarray(key, np.int32)), core)
        return vjp(g)

    static_dense.defvjp(static_fwd, static_bwd)

    def dense(core, idx):
        if isinstance(idx, jax.core.Tracer):
            return traced_dense(core, idx)
        return static_dense(core, channel_key(idx))

    @jax.custom_vjp
    def traced_reduce(core, idx, mode, qw, kw):
        return reduce_kernel(core, idx, mode, qw, kw)

    def traced_reduce_fwd(core, idx, mode, qw, kw):
        return reduce_kernel(core, idx, mode, qw, kw), (core, idx, mode, qw, kw)

    @full_precision
    def reduce_vjp(core, idx, mode, qw, kw, g):
        B, n, L = qw.shape
        bc = block_size(n, B, L, None)
        _, vjp = jax.vjp(lambda c, a, b: blocked_reduce(c, idx, a, b, mode, bc), core, qw, kw)
        return vjp(g)

    def traced_reduce_bwd(res, g):
        dc, dq, dk = reduce_vjp(*res, g)
        return dc, _float0(res[1]), _float0(res[2]), dq, dk

    traced_reduce.defvjp(traced_reduce_fwd, traced_reduce_bwd)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def static_reduce(core, key, mode, qw, kw):
        return reduce_kernel(core, np.asarray(key, np.int32), mode, qw, kw)

    def static_reduce_fwd(core, key, mode, qw, kw):
        return reduce_kernel(core, np.asarray(key, np.int32), mode, qw, kw), (core, mode, qw, kw)

    def static_reduce_bwd(key, res, g):
        core, mode, qw, kw = res
        dc, dq, dk = reduce_vjp(core, np.asarray(key, np.int32), mode, qw, kw, g)
        return dc, _float0(mode), dq, dk

    static_reduce.defvjp(static_reduce_fwd, static_reduce_bwd)

    def reduce(core, idx, mode, qw, kw):
        if isinstance(idx, jax.core.Tracer):
            return traced_reduce(core, idx, mode, qw, kw)
        return static_reduce(core, channel_key(idx), mode, qw, kw)

    return dense, reduce


__all__ = ["APPLY_BUDGET", "KernelBackend", "register_backend", "register_core", "backend", "impls", "resolve_impl",
           "default_platform", "with_fallback", "failed_kernels", "clear_failed_kernels", "dense_fn",
           "materialize_blocks", "over_blocks", "materialize_jit", "applied_blocks", "applied_blocks_jit",
           "apply_in_blocks", "blocked_reduce", "blocked_reduce_jit", "sum_over_channels", "blocked_reduce_by",
           "repeated_reduce", "repeated_reduce_jit", "parallel_reduce", "with_xla_backward", "channel_key"]
