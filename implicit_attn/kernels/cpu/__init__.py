"""Fused CPU kernels (``impl="cpu"``): C++ XLA FFI handlers that write each element of
``materialize``'s output once.

On CPU the XLA path makes several passes over the ``(B, C, L, L)`` output (chunk
products, diagonal blocks, the conv, the block copy); each costs about as much as the
write itself. These kernels form one row at a time in a small scratch buffer and write
it once. The source (``*.cc`` next to this file) is compiled on first use with the
machine's C++ compiler against the XLA FFI headers that ship with ``jaxlib``, in parts side by
side (``build_parts``: one per usable core) linked into one library, and cached
in ``$IMPLICIT_ATTN_CACHE`` (default ``~/.cache/implicit_attn``), keyed by the source, the
jax version, the compiler's path and version and the CPU. A cached library is loaded only
after its size and SHA-256 match the record written when it was built, and rebuilt
otherwise (``cache.py``). It is built with ``-march=native`` unless ``$IMPLICIT_ATTN_CPU_ARCH``
names another target (``haswell``: AVX2 without AVX-512). Without a compiler (or with a
broken build, or a ``$CXX`` that does not exist) ``impl="auto"`` falls back to XLA (with
one warning); ``impl="cpu"`` raises ``CpuKernelUnavailable``.

Supported cores: ``StateDecayCore`` (Mamba-1) and rank-one ``ScalarDecayCore`` (Griffin's RG-LRU),
also inside Griffin's ``DocumentMaskedCore`` (packed documents); a ``ScalarDecayCore`` with
``q k^T`` groups (each group's matrix formed once by XLA, the head-matrix kernel its channels); a
``DocumentMaskedCore`` over any other core with a kernel (that kernel's output, masked by XLA); the
cores whose channels share a head matrix (``HEAD_CORES``: each head's matrix formed once, by this
library for the DPLR and delta-rule cores (``head_matrices``: RWKV-5/6/7, the gated delta rule) and
by XLA for Mamba-2 and the mLSTM, the kernel the channels; their linear reductions as one product
over a head's channels per conv tap); ``RwkvCore`` (RWKV-4); ``ShortConvCore`` (LFM2; its reduce is
XLA, band by band); ``AttentionCore`` (local softmax attention: materialize only, its reduce is the
XLA blocks); ``LaSCore`` (LaS attention: the attention kernel's logits with the ELD and ALiBi
distance terms, then each row pooled; its reduce is the XLA blocks; both write outputs of
``STREAM_BYTES`` or more with streaming stores); ``ParallelCore`` (its parts'
kernels); ``BidirectionalCore`` (ViM: both directions' kernels, flipped and summed by XLA; its
reduce is the XLA blocks). ``cpu_dense`` writes ``(B, n, L, L)``; ``cpu_reduce`` sums over channels
and writes only ``(B, L, L)``.
Gradients: a ``custom_vjp`` whose backward pass is the XLA path (``jax.vjp`` of
``core.dense`` / of the blocked XLA reduce).

The same library holds the forward computations: Mamba-1's selective scan (``selective_scan``,
taken by ``mamba.block.selective_scan`` where ``scan_pays_off``), Mamba-2's SSD (``ssd_scan``,
taken by ``mamba2.block.ssd`` where ``ssd_pays_off``), the DPLR recurrence (``dplr_scan``, taken by
RWKV-5/6/7's blocks, and ``delta_scan``, the gated delta rule written as one, taken by
``qwen3_next.block.delta_inner``, and ``mlstm_scan``, the mLSTM's read-out on the same recurrence,
taken by ``xlstm.block.recurrence``, where ``recurrence_pays_off``), the Gated DeltaNet mixer between its
projections (``gated_delta_net``: conv, SiLU, l2 norms, the delta rule and the gated norm in one pass,
taken by ``qwen3_next.block.delta_forward`` where ``delta_net_pays_off``), RWKV-4's WKV (``wkv_scan``), softmax
attention applied to the values (``attention_forward``, taken by ``nn.attention.attention_values`` where
``attention_pays_off``) and the mixture-of-experts products (``grouped_matmul_from_tokens`` and
``grouped_matmul_to_tokens``, taken by ``nn.moe.experts_forward`` where ``grouped_pays_off``),
differentiated in both modes through their XLA forms (a ``custom_jvp``), except the DPLR
recurrence's reverse mode (``dplr_scan`` and ``delta_scan``), which has a kernel of its own
(``with_kernel_reverse_mode``).

A call's parts run on XLA's intra-op thread pool (the FFI's ``ThreadPool``; threads of their own
where XLA gives none): its workers spin a while after the XLA operations before a call, and
threads of our own competed with them for the cores.
"""
from __future__ import annotations

import functools
import itertools
import os
import re
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ...operator import (MODES, AttentionCore, BidirectionalCore, DeltaRuleCore, DocumentMaskedCore, DplrCore,
                         HeadMatrixCore, KernelBackend, LaSCore, Mamba2Core, MlstmCore, ParallelCore, RwkvCore,
                         ScalarDecayCore, ShortConvCore, StateDecayCore, apply_mode, block_size, channel_heads,
                         register_backend, register_core, span_heads, with_xla_backward)
from ...operator.dispatch import blocked_reduce, blocked_reduce_by, blocked_reduce_jit, channel_key, parallel_reduce
from ...ops import (attention_output, delta_rule, dplr_rule, full_precision, grouped, pool_window,
                   scalar_decay_kernel, selective_scan_sequential, ssd_chunked, wkv_chunked)
from . import cache
from .cache import CpuKernelUnavailable, cache_dir

_SRC = Path(__file__).with_name("state_decay.cc")
_TARGET = "implicit_attn_state_decay_dense"
_REDUCE_TARGET = "implicit_attn_state_decay_reduce"
_HEAD_TARGET = "implicit_attn_head_matrix_dense"
_HEAD_REDUCE_TARGET = "implicit_attn_head_matrix_reduce"
_RWKV_TARGET = "implicit_attn_rwkv_dense"
_RWKV_REDUCE_TARGET = "implicit_attn_rwkv_reduce"
_CONV_TARGET = "implicit_attn_short_conv_dense"
_PLACE_TARGET = "implicit_attn_place_channels"
_ATTENTION_TARGET = "implicit_attn_attention_dense"
_LAS_TARGET = "implicit_attn_las_dense"
_SCAN_TARGET = "implicit_attn_selective_scan"
_SCAN_VJP_TARGET = "implicit_attn_selective_scan_vjp"
_SSD_TARGET = "implicit_attn_ssd_scan"
_SSD_VJP_TARGET = "implicit_attn_ssd_scan_vjp"
_DPLR_TARGET = "implicit_attn_dplr_scan"
_DPLR_VJP_TARGET = "implicit_attn_dplr_scan_vjp"
_WKV_TARGET = "implicit_attn_wkv_scan"
_DECAY_TARGET = "implicit_attn_decay_matrix"
_LOWRANK_TARGET = "implicit_attn_lowrank_matrix"
_ATTENTION_FORWARD_TARGET = "implicit_attn_attention_forward"
_FROM_TOKENS_TARGET = "implicit_attn_grouped_from_tokens"
_TO_TOKENS_TARGET = "implicit_attn_grouped_to_tokens"
_DELTA_NET_TARGET = "implicit_attn_gated_delta_net"
_COPY_TARGET = "implicit_attn_copy"
_FILL_TARGET = "implicit_attn_fill"
_TARGETS = {"IaStateDecayDense": _TARGET, "IaStateDecayReduce": _REDUCE_TARGET, "IaHeadMatrixDense": _HEAD_TARGET,
            "IaHeadMatrixReduce": _HEAD_REDUCE_TARGET, "IaRwkvDense": _RWKV_TARGET,
            "IaRwkvReduce": _RWKV_REDUCE_TARGET, "IaShortConvDense": _CONV_TARGET,
            "IaPlaceChannels": _PLACE_TARGET, "IaAttentionDense": _ATTENTION_TARGET, "IaLasDense": _LAS_TARGET,
            "IaSelectiveScan": _SCAN_TARGET, "IaSelectiveScanVjp": _SCAN_VJP_TARGET,
            "IaSsdScan": _SSD_TARGET, "IaSsdScanVjp": _SSD_VJP_TARGET,
            "IaDplrScan": _DPLR_TARGET, "IaDplrScanVjp": _DPLR_VJP_TARGET, "IaWkvScan": _WKV_TARGET,
            "IaDecayMatrix": _DECAY_TARGET,
            "IaLowRankMatrix": _LOWRANK_TARGET, "IaAttentionForward": _ATTENTION_FORWARD_TARGET,
            "IaGroupedFromTokens": _FROM_TOKENS_TARGET, "IaGroupedToTokens": _TO_TOKENS_TARGET,
            "IaGatedDeltaNet": _DELTA_NET_TARGET, "IaCopy": _COPY_TARGET,
            "IaFill": _FILL_TARGET}
_SYMBOLS = tuple(_TARGETS)
ARCH_ENV = "IMPLICIT_ATTN_CPU_ARCH"


def compile_flags() -> list[str]:
    """The compiler flags: ``-march=native`` unless ``$IMPLICIT_ATTN_CPU_ARCH`` names another
    target (e.g. ``haswell``: AVX2 and FMA without AVX-512, to measure the kernel as an older
    CPU would run it). Raises ``ValueError`` for a value that is not a plain target name."""
    arch = os.environ.get(ARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", arch):
        raise ValueError(f"${ARCH_ENV}={arch!r} is not a -march target name (e.g. native, haswell, skylake-avx512)")
    return ["-O3", f"-march={arch}", "-std=c++17", "-shared", "-fPIC", "-pthread"]
_lock = threading.Lock()
_state: dict = {}


def library_path() -> Path:
    """Where the kernel library for this source, jax version, compiler (``$CXX`` or the
    first of ``c++``/``g++``/``clang++``) and CPU is cached; it need not be built yet.
    Raises ``CpuKernelUnavailable`` if there is no usable compiler."""
    return cache.library_path(_SRC, compile_flags(), cache.find_compiler(), (jax.__version__,))


# The handlers, heaviest to compile first (seconds of g++ -O3 for each alone, on the Xeon: 4.6 for
# IaHeadMatrixReduce down to 0.9 for IaCopy, over 2.5 for the headers).
_BUILD_ORDER = ("IaHeadMatrixReduce", "IaDecayMatrix", "IaGatedDeltaNet", "IaStateDecayDense", "IaDplrScan",
                "IaStateDecayReduce", "IaDplrScanVjp", "IaSelectiveScanVjp", "IaSsdScanVjp", "IaAttentionForward",
                "IaRwkvReduce", "IaShortConvDense",
                "IaFill",
                "IaLowRankMatrix", "IaGroupedToTokens", "IaHeadMatrixDense", "IaGroupedFromTokens",
                "IaAttentionDense", "IaLasDense", "IaSsdScan", "IaSelectiveScan", "IaPlaceChannels", "IaRwkvDense",
                "IaWkvScan", "IaCopy")
MAX_BUILD_PARTS = 8  # past this, each part is mostly the headers every part parses


def build_parts(n: int) -> list[list[str]]:
    """The handlers split into ``n`` parts of about equal compile time (dealt heaviest first, in
    a snake order), as the ``-D`` macro names of ``state_decay.cc``'s build in parts; ``[]`` for
    ``n <= 1`` (one whole build)."""
    n = min(n, MAX_BUILD_PARTS, len(_BUILD_ORDER))
    if n <= 1:
        return []
    parts = [["IA_PARTIAL"] for _ in range(n)]
    for i, symbol in enumerate(_BUILD_ORDER):
        lap, at = divmod(i, n)
        parts[at if lap % 2 == 0 else n - 1 - at].append(f"IA_{symbol}")
    return parts


def _build(force: bool = False) -> tuple[Path, bytes, bool]:
    return cache.build_library(_SRC, compile_flags(), [jax.ffi.include_dir()], (jax.__version__,), force=force,
                               parts=build_parts(cache.usable_cores()))


def build() -> Path:
    """Compile the kernel library into the cache unless a verified build is there (its
    size and SHA-256 match the record written when it was built), and return its path.
    Does not load it. Raises ``CpuKernelUnavailable`` (no compiler, a failed compile) or
    ``OSError`` (the cache cannot be written)."""
    return _build()[0]


def _load_checked():
    """Build or find the verified library, load its bytes and check its symbols. A cached
    build that lacks them is rebuilt once; a fresh build that lacks them is an error."""
    lib_path, data, fresh = _build()
    while True:
        lib = cache.load_library(data, lib_path.name)
        missing = cache.missing_symbols(lib, _SYMBOLS)
        if not missing:
            return lib
        if fresh:
            raise CpuKernelUnavailable(
                f"the kernel library built at {lib_path} lacks the symbol(s) {', '.join(missing)}: "
                "the compiler produced a broken build (check $CXX)")
        warnings.warn(f"implicit_attn: the cached CPU kernel {lib_path} lacks the symbol(s) "
                      f"{', '.join(missing)}; rebuilding it", stacklevel=4)
        lib_path, data, fresh = _build(force=True)


def load():
    """Build (if needed), verify, load and register the kernels with XLA.

    Raises ``CpuKernelUnavailable`` (no compiler, a failed build, an unusable cache, a
    library without the kernels' symbols); the error is kept, so later calls in this
    process raise it again without retrying."""
    with _lock:
        if "error" in _state:
            raise _state["error"]
        if "lib" not in _state:
            try:
                try:
                    lib = _load_checked()
                except OSError as e:  # no writable cache, a compiler that cannot start, a bad .so
                    raise CpuKernelUnavailable(f"building or loading the kernel failed: {e}") from e
                for symbol, target in _TARGETS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            except CpuKernelUnavailable as e:
                _state["error"] = e
                raise
            _state["lib"] = lib
        return _state["lib"]


def available() -> bool:
    """True if the kernels build and load here (warns once if they do not)."""
    try:
        load()
        return True
    except CpuKernelUnavailable as e:
        if not _state.get("warned"):
            _state["warned"] = True
            warnings.warn(f"implicit_attn: fused CPU kernel unavailable, using XLA: {e}", stacklevel=3)
        return False


MAX_STATE = 64  # the kernel keeps one 16-float vector per state in registers/L1
MAX_CONV = 16  # conv taps: at most one chunk


def _parts(core):
    """``(inner core, document ids or None)``: unwraps a ``DocumentMaskedCore``."""
    if type(core) is DocumentMaskedCore:
        return core.inner, core.seg
    return core, None


HEAD_CORES = (Mamba2Core, DeltaRuleCore, DplrCore, MlstmCore)


def _low_rank(core) -> bool:
    """A ``ScalarDecayCore`` with ``q k^T`` groups (its channels then share its groups' matrices)."""
    return type(core) is ScalarDecayCore and (core.q is not None or core.k is not None)


def _reads_documents(core) -> bool:
    """A core whose kernel takes document ids itself (Mamba-1's and the rank-one RG-LRU's); a
    ``DocumentMaskedCore`` over another core masks its inner kernel's output."""
    return type(core) is StateDecayCore or (type(core) is ScalarDecayCore and not _low_rank(core))


def _problem(core) -> str | None:
    """Why ``impl="cpu"`` cannot take ``core`` (None if it can)."""
    if type(core) is BidirectionalCore:  # both directions by their kernels
        why = _problem(core.forward) or _problem(core.backward)
        return why and f"a direction has no kernel: {why}"
    if type(core) is DocumentMaskedCore and not _reads_documents(core.inner):
        why = _problem(core.inner)
        return why and f"its inner core has no kernel: {why}"
    inner, _ = _parts(core)
    if type(inner) in (RwkvCore, ShortConvCore, ParallelCore, AttentionCore, LaSCore):
        return None  # (a ParallelCore: its parts with kernels use them, the others XLA)
    if type(inner) in HEAD_CORES:
        pass  # any head matrix: formed once per head (head_matrices), the kernel each channel
    elif type(inner) is StateDecayCore:
        N = inner.q.shape[-1]
        if N > MAX_STATE:
            return f"state size {N} > {MAX_STATE}"
    elif type(inner) is not ScalarDecayCore:
        return (f"no kernel for {type(inner).__name__}; it covers StateDecayCore (Mamba-1), "
                "ScalarDecayCore (Griffin's RG-LRU, packed documents included; low-rank q, k), the cores "
                "whose channels share a head matrix (Mamba2Core, DeltaRuleCore, DplrCore, MlstmCore), "
                "RwkvCore (RWKV-4), ShortConvCore (LFM2), AttentionCore (local attention), LaSCore, and "
                "ParallelCore and BidirectionalCore over those")
    K = 1 if inner.conv_w is None else inner.conv_w.shape[-1]
    if K > MAX_CONV:
        return f"conv width {K} > {MAX_CONV}"
    return None


def has_kernel(core) -> bool:
    """True if ``impl="cpu"`` supports ``core``."""
    return BACKEND.problem(core) is None


def check_core(core):
    """Raise ``TypeError`` naming ``core`` if it has no fused CPU kernel."""
    BACKEND.check_core(core)


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def num_threads(strict: bool = False) -> int:
    """Worker threads per call: ``$IMPLICIT_ATTN_CPU_THREADS`` (a positive integer) or the
    usable cores.

    An invalid value raises ``ValueError`` naming the variable if ``strict`` (``impl="cpu"``
    checks it so), else warns once per value and uses the usable cores (``impl="auto"``
    never fails because of it)."""
    env = os.environ.get("IMPLICIT_ATTN_CPU_THREADS", "").strip()
    if not env:
        return _default_threads()
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n >= 1:
        return n
    msg = f"IMPLICIT_ATTN_CPU_THREADS={env!r} is not a positive integer (the fused CPU kernel's thread count)"
    if strict:
        raise ValueError(msg + "; set it to e.g. 4, or unset it to use every usable core")
    warned = _state.setdefault("bad_threads", set())
    if env not in warned:
        warned.add(env)
        warnings.warn(f"implicit_attn: {msg}; using the {_default_threads()} usable cores", stacklevel=2)
    return _default_threads()


def huge_pages() -> bool:
    """Whether the kernel asks Linux for transparent huge pages on its output
    (``madvise``; ``$IMPLICIT_ATTN_HUGE_PAGES=0`` turns it off). On a fresh output of
    hundreds of MB, 4 KiB page faults cost more than the arithmetic."""
    return os.environ.get("IMPLICIT_ATTN_HUGE_PAGES", "1") not in ("0", "false", "no", "")


# The attention kernels write an output of at least this many bytes with streaming stores, which
# skip reading each cache line before writing it. On a 2-core Zen 4 (paired medians of 60 turns):
# LaS attention's 12 heads at L = 512 (12.6 MB) took 0.84 of the plain stores' time, local
# attention's 8 heads 0.90; the reduces, which read their blocks right back, 0.95 and 1.03. A
# smaller output stays in the caches for whatever reads it next.
STREAM_BYTES = 4 << 20


def streamed(shape) -> np.int64:
    """The dense attention kernels' ``stream`` attribute for a float32 output of ``shape``: 1 from
    ``STREAM_BYTES`` on, else 0."""
    return np.int64(4 * int(np.prod(shape)) >= STREAM_BYTES)


def _rows_or_dummy(x, idx):
    if x is None:
        return jnp.zeros((1, 1, 1), jnp.float32), 0
    return jnp.take(x, idx, axis=1).astype(jnp.float32), 1


def _kernel_args(core, idx):
    """The kernels' operands and flags for ``core``'s channels ``idx``: (args, attrs, (B, L))."""
    load()
    f32 = jnp.float32
    inner, seg = _parts(core)
    n = idx.shape[0]
    if type(inner) is StateDecayCore:
        q, k = inner.q.astype(f32), inner.k.astype(f32)
        A = jnp.take(inner.A, idx, axis=0).astype(f32)
        dt = jnp.take(inner.dt, idx, axis=1).astype(f32)
    else:  # rank-one scalar decay: N = 1, q = k = 1, exp(A dt) = a with A = -1, dt = -log a
        B, _, L = inner.log_a.shape
        q = k = jnp.ones((B, L, 1), f32)
        A = -jnp.ones((n, 1), f32)
        dt = -jnp.take(inner.log_a, jnp.take(inner.group, idx), axis=1).astype(f32)
    left, hl = _rows_or_dummy(inner.left, idx)
    right, hr = _rows_or_dummy(inner.right, idx)
    diag, hd = _rows_or_dummy(inner.diag, idx)
    w = (jnp.ones((n, 1), f32) if inner.conv_w is None
         else jnp.take(inner.conv_w, idx, axis=0).astype(f32))
    segs = jnp.zeros((1, 1), jnp.int32) if seg is None else seg.astype(jnp.int32)
    attrs = dict(has_left=np.int64(hl), has_right=np.int64(hr), has_diag=np.int64(hd),
                 has_seg=np.int64(seg is not None), threads=np.int64(num_threads()))
    return (q, k, A, dt, left, right, diag, w, segs), attrs, q.shape[:2]


def _kernel_call(core, idx):
    """Run the materialize kernel on ``core``'s channels ``idx``: ``(B, n, L, L)``."""
    args, attrs, (B, L) = _kernel_args(core, idx)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((B, idx.shape[0], L, L), jnp.float32),
                            vmap_method="sequential")
    return call(*args, **attrs, huge_pages=np.int64(huge_pages()))


def _reduce_call(core, idx, mode, qw, kw):
    """Run the fused reduce kernel: ``(B, L, L)``. ``mode`` (int32, may be traced) picks the
    elementwise map; the kernel takes it as a static attribute, so each value is a branch."""
    args, attrs, (B, L) = _kernel_args(core, idx)
    call = jax.ffi.ffi_call(_REDUCE_TARGET, jax.ShapeDtypeStruct((B, L, L), jnp.float32),
                            vmap_method="sequential")
    return _by_mode(call, mode, (*args, qw.astype(jnp.float32), kw.astype(jnp.float32)), attrs)


def _by_mode(call, mode, operands, attrs):
    """``call(*operands, **attrs, mode=m)`` for the traced int32 ``mode``: the kernels take it as
    a static attribute, so each value is a branch."""
    branches = [lambda ops, m=m: call(*ops, **attrs, mode=np.int64(m)) for m in sorted(set(MODES.values()))]
    return jax.lax.switch(mode, branches, operands)


_dense, _reduce = with_xla_backward(_kernel_call, _reduce_call)


def _head_factors(core, idx, diagonal):
    """The per-channel operands of the head-matrix kernels for channels ``idx``: (left, right,
    diag, w, attrs), absent factors as dummies; ``diagonal`` the core's ``(B, C, L)`` diagonal term
    or None (``_shared_matrices``)."""
    load()
    n = idx.shape[0]
    left, hl = _rows_or_dummy(core.left, idx)
    right, hr = _rows_or_dummy(core.right, idx)
    diag, hd = _rows_or_dummy(diagonal, idx)
    w = (jnp.ones((n, 1), jnp.float32) if core.conv_w is None
         else jnp.take(core.conv_w, idx, axis=0).astype(jnp.float32))
    attrs = dict(has_left=np.int64(hl), has_right=np.int64(hr), has_diag=np.int64(hd),
                 threads=np.int64(num_threads()))
    return left, right, diag, w, attrs


def head_matrix_kernel(core) -> str | None:
    """The library kernel ``head_matrices`` forms ``core``'s head matrices with, for cores whose
    matrices are not given: ``"decay"`` for a diagonal transition (RWKV-5/6's ``DplrCore``, the delta
    rule without its erasure) with ``d_k <= MAX_STATE`` (Mamba-1's chunked product, a decay per key
    dimension), ``"lowrank"`` for the other ``DplrCore``s and ``DeltaRuleCore``s (RWKV-7, the gated
    delta rule: the recurrence run back from each row's query, 32 rows at a time), else None
    (XLA, ``core.alpha``)."""
    if type(core) not in (DplrCore, DeltaRuleCore) or core.matrices is not None:
        return None
    diagonal = core.a is None if type(core) is DplrCore else not core.delta
    return "decay" if diagonal and core.q.shape[-1] <= MAX_STATE else "lowrank"


def head_matrices(core, heads):
    """``core.alpha(heads)``: ``(B, len(heads), L, L)`` float32, by the library's kernel
    ``head_matrix_kernel(core)`` names (XLA where it names none). ``heads (k,)`` int, may be traced.
    The delta rule goes in as the DPLR recurrence it is (``S_{t-1} Diag(a_t) (I - b_t k_t k_t^T) + b_t v_t
    k_t^T`` with the keys ``b_t k_t`` and the low-rank term ``-(a_t k_t) (b_t k_t)^T``)."""
    kind = head_matrix_kernel(core)
    if kind is None:
        return core.alpha(heads)
    load()
    take = lambda x, idx: jnp.take(x, idx, axis=1).astype(jnp.float32)
    if type(core) is DeltaRuleCore:
        groups = heads // core.heads_per_group
        q, k, _, log_w, a, b, _ = _delta_as_dplr(take(core.q, groups), take(core.k, groups), None,
                                                 take(core.log_a, heads), take(core.beta, heads), core.delta)
        a, b = (a, b) if core.delta else (None, None)
        bonus, after = None, True
    else:
        q, k, log_w = take(core.q, heads), take(core.k, heads), take(core.log_w, heads)
        a, b = (None, None) if core.a is None else (take(core.a, heads), take(core.b, heads))
        bonus, after = None if core.bonus is None else take(core.bonus, heads), core.after
    dummy = jnp.zeros((1, 1, 1), jnp.float32)
    attrs = dict(threads=np.int64(num_threads()), has_bonus=np.int64(bonus is not None), after=np.int64(after),
                 huge_pages=np.int64(huge_pages()))
    out = jax.ShapeDtypeStruct(q.shape[:3] + (q.shape[2],), jnp.float32)
    bonus = dummy if bonus is None else bonus
    if kind == "decay":
        return jax.ffi.ffi_call(_DECAY_TARGET, out, vmap_method="sequential")(q, k, log_w, bonus, **attrs)
    call = jax.ffi.ffi_call(_LOWRANK_TARGET, out, vmap_method="sequential")
    has_ab = a is not None
    a, b = (a, b) if has_ab else (dummy, dummy)
    return call(q, k, log_w, a, b, bonus, has_ab=np.int64(has_ab), **attrs)


def _shared_matrices(core):
    """A core whose channels share matrices, as ``(matrix_of(idx) -> (n,) int: each channel's matrix,
    number of matrices, matrices(ids) -> (B, k, L, L) float32, per-channel diagonal (B, C, L) or
    None)``: a head-matrix core's heads (``head_matrices``; ``channel_heads``, numpy for concrete
    channels), or a low-rank ``ScalarDecayCore``'s groups (``K_g``, formed by XLA as in
    ``ScalarDecayCore.dense``, once per group)."""
    if type(core) is ScalarDecayCore:
        g = lambda x, ids: jnp.take(x, ids, axis=1)
        return (lambda idx: jnp.take(core.group, idx), core.log_a.shape[1],
                lambda ids: scalar_decay_kernel(g(core.log_a, ids), g(core.q, ids), g(core.k, ids)), core.diag)
    diagonal = core.diagonal() if isinstance(core, HeadMatrixCore) else None  # (Mamba2Core: none)
    return functools.partial(channel_heads, core), core.num_heads, functools.partial(head_matrices, core), diagonal


def _head_call(core, idx, total=None):
    """``(B, n, L, L)`` of the channels ``idx`` of a core whose channels share matrices
    (``_shared_matrices``: a head-matrix core, a low-rank ``ScalarDecayCore``): each distinct matrix
    once, then the kernel sandwiches and convolves every channel, writing each element once. Traced
    ``idx`` spanning a contiguous range (a block of ``apply``'s) forms the few matrices it touches
    (``span_heads``), a scattered one all of them. ``total``: an output of ``total >= n`` channels,
    the first ``n`` written (a ``ParallelCore``'s other parts go after them)."""
    matrix_of, count, matrices, diagonal = _shared_matrices(core)
    heads = matrix_of(idx)
    left, right, diag, w, attrs = _head_factors(core, idx, diagonal)
    B, L = core.q.shape[0], core.q.shape[2]
    call = jax.ffi.ffi_call(_HEAD_TARGET, jax.ShapeDtypeStruct((B, total or idx.shape[0], L, L), jnp.float32),
                            vmap_method="sequential")
    run = lambda ids, hmap: call(matrices(ids).astype(jnp.float32), hmap.astype(jnp.int32), left, right, diag, w,
                                 **attrs, huge_pages=np.int64(huge_pages()), offset=np.int64(0))
    if not isinstance(heads, jax.core.Tracer):
        uniq, inv = np.unique(np.asarray(heads), return_inverse=True)
        return run(jnp.asarray(uniq), jnp.asarray(inv.reshape(-1)))
    every = lambda: run(jnp.arange(count), heads)
    k, uniq, inv, found = span_heads(heads, max(1, core.num_channels // count), count)
    if uniq is None:  # one matrix per channel is no more than k; else every matrix is
        return every() if k >= count else run(heads, jnp.arange(heads.shape[0]))
    return jax.lax.cond(found, lambda: run(uniq, inv), every)


# Bytes of head matrices the fused reduce forms per step: a few heads at a time stay in cache
# (all of a layer's heads at once ran 1.2-1.5x slower at L = 512) and bound memory at long L.
HEAD_BLOCK_BYTES = 4 << 20


def _head_blocks(count: int, heads, B: int, L: int):
    """The matrices to form, ``(steps, per step)``: the distinct ``heads`` (all ``count`` if traced),
    as many per step as fit ``HEAD_BLOCK_BYTES`` (padded by repeating the last)."""
    uniq = (jnp.arange(count) if isinstance(heads, jax.core.Tracer)
            else jnp.asarray(np.unique(np.asarray(heads))))
    U = uniq.shape[0]
    per = max(1, min(U, HEAD_BLOCK_BYTES // (B * L * L * 4)))
    steps = -(-U // per)
    return jnp.pad(uniq, (0, steps * per - U), mode="edge").reshape(steps, per)


def _head_reduce_call(core, idx, mode, qw, kw):
    """``(B, L, L)``: a scan over blocks of heads (or groups), each block's matrices formed once
    (``_shared_matrices``), the kernel adding its channels' weighted terms into the running sum (in place)."""
    matrix_of, count, matrices, diagonal = _shared_matrices(core)
    heads = matrix_of(idx)
    left, right, diag, w, attrs = _head_factors(core, idx, diagonal)
    B, _, L = qw.shape
    call = jax.ffi.ffi_call(_HEAD_REDUCE_TARGET, jax.ShapeDtypeStruct((B, L, L), jnp.float32),
                            vmap_method="sequential", input_output_aliases={8: 0})
    qw, kw = qw.astype(jnp.float32), kw.astype(jnp.float32)

    def step(acc, block):
        eq = jnp.asarray(heads)[:, None] == block[None, :]  # a padded repeat matches only its first copy
        hmap = jnp.where(eq.any(1), jnp.argmax(eq, 1), -1).astype(jnp.int32)
        M = matrices(block).astype(jnp.float32)
        return _by_mode(call, mode, (M, hmap, left, right, diag, w, qw, kw, acc), attrs), None

    out, _ = jax.lax.scan(step, jnp.zeros((B, L, L), jnp.float32), _head_blocks(count, heads, B, L))
    return out


_head_dense, _head_reduce = with_xla_backward(_head_call, _head_reduce_call)


def _rwkv_args(core, idx):
    load()
    gate, hg = _rows_or_dummy(core.gate, idx)
    args = (jnp.take(core.k, idx, axis=1).astype(jnp.float32), jnp.take(core.w, idx).astype(jnp.float32),
            jnp.take(core.u, idx).astype(jnp.float32), gate)
    return args, dict(has_gate=np.int64(hg), threads=np.int64(num_threads()))


def _rwkv_call(core, idx):
    """``(B, n, L, L)`` of an ``RwkvCore``'s channels ``idx``, one exponential per element."""
    args, attrs = _rwkv_args(core, idx)
    B, _, L = core.k.shape
    call = jax.ffi.ffi_call(_RWKV_TARGET, jax.ShapeDtypeStruct((B, idx.shape[0], L, L), jnp.float32),
                            vmap_method="sequential")
    return call(*args, **attrs, huge_pages=np.int64(huge_pages()))


def _rwkv_reduce_call(core, idx, mode, qw, kw):
    args, attrs = _rwkv_args(core, idx)
    B, _, L = core.k.shape
    call = jax.ffi.ffi_call(_RWKV_REDUCE_TARGET, jax.ShapeDtypeStruct((B, L, L), jnp.float32),
                            vmap_method="sequential")
    return _by_mode(call, mode, (*args, qw.astype(jnp.float32), kw.astype(jnp.float32)), attrs)


_rwkv_dense, _rwkv_reduce = with_xla_backward(_rwkv_call, _rwkv_reduce_call)


def _conv_call(core, idx):
    """``(B, n, L, L)`` of a ``ShortConvCore``'s channels ``idx``: each row written once."""
    load()
    right, hr = _rows_or_dummy(core.right, idx)
    left = jnp.take(core.left, idx, axis=1).astype(jnp.float32)
    B, _, L = left.shape
    call = jax.ffi.ffi_call(_CONV_TARGET, jax.ShapeDtypeStruct((B, idx.shape[0], L, L), jnp.float32),
                            vmap_method="sequential")
    return call(jnp.take(core.conv_w, idx, axis=0).astype(jnp.float32), left, right, has_right=np.int64(hr),
                threads=np.int64(num_threads()), huge_pages=np.int64(huge_pages()))


def _conv_reduce_call(core, idx, mode, qw, kw):
    """A ``ShortConvCore``'s reduce in XLA, band by band: ``H_c`` is nonzero only on ``K``
    diagonals, so ``out[i, i-s] = sum_c qw_c[i] f(l_c[i] w_c[K-1-s] r_c[i-s]) kw_c[i-s]``: ``O(C L K)``
    work, then the ``K`` diagonals placed into ``(B, L, L)``."""
    left = jnp.take(core.left, idx, axis=1).astype(jnp.float32)
    B, n, L = left.shape
    w = jnp.take(core.conv_w, idx, axis=0).astype(jnp.float32)
    right = jnp.ones_like(left) if core.right is None else jnp.take(core.right, idx, axis=1).astype(jnp.float32)
    shift = lambda x, s: jnp.pad(x, ((0, 0), (0, 0), (s, 0)))[..., :L]  # x[..., i - s], 0 for i < s
    out = jnp.zeros((B, L, L), jnp.float32)
    i = jnp.arange(L)
    for s in range(min(w.shape[1], L)):
        h = left * w[None, :, w.shape[1] - 1 - s, None] * shift(right, s)  # H_c[i, i - s]
        band = jnp.sum(qw * apply_mode(h, mode) * shift(kw, s), axis=1)
        out = out.at[:, i[s:], i[s:] - s].set(band[:, s:])
    return out


def _attention_call(core, idx):
    """``(B, n, L, L)`` softmax probabilities of an ``AttentionCore``'s heads ``idx``: the logits of
    the key blocks the window reaches, one softmax per row, each element written once."""
    load()
    q = jnp.take(core.q, idx, axis=1).astype(jnp.float32)
    B, n, L, _ = q.shape
    kv = (idx // (core.q.shape[1] // core.k.shape[1])).astype(jnp.int32)
    call = jax.ffi.ffi_call(_ATTENTION_TARGET, jax.ShapeDtypeStruct((B, n, L, L), jnp.float32),
                            vmap_method="sequential")
    return call(q, core.k.astype(jnp.float32), kv, core.seg.astype(jnp.int32), window=np.int64(core.window),
                threads=np.int64(num_threads()), huge_pages=np.int64(huge_pages()), stream=streamed((B, n, L, L)))


def _parallel_call(core, idx):
    """Every channel of a ``ParallelCore`` whose first part is a head-matrix core, in order: that
    part's kernel allocates the whole output and writes its channels, then each other part's
    channels are formed once (its kernel, or XLA) and copied into their slots (repeated ones
    too), in place. ``idx`` is ``arange(C)`` (``cpu_dense`` checks)."""
    first = core.parts[0]
    out = _head_call(first, jnp.arange(first.num_channels), total=core.num_channels)
    for part, r, start in zip(core.parts[1:], core.repeats[1:], core.starts[1:]):
        m = jnp.arange(part.num_channels)
        src = cpu_dense(part, m) if has_kernel(part) else part.dense(m)
        call = jax.ffi.ffi_call(_PLACE_TARGET, jax.ShapeDtypeStruct(out.shape, jnp.float32),
                                vmap_method="sequential", input_output_aliases={2: 0})
        out = call(src.astype(jnp.float32), jnp.repeat(m, r).astype(jnp.int32), out, offset=np.int64(start),
                   threads=np.int64(num_threads()))
    return out


def _parallel_fast(core, idx) -> bool:
    """Whether ``_parallel_call`` takes channels ``idx`` of ``core``: all of them, in order, concrete,
    the first part a head-matrix core read once per channel."""
    return (not isinstance(idx, jax.core.Tracer) and type(core.parts[0]) in HEAD_CORES and core.repeats[0] == 1
            and np.array_equal(np.asarray(idx), np.arange(core.num_channels)))


def _part_dense(part, idx):
    """A ``ParallelCore`` part's matrices: its kernel's, else XLA's."""
    return cpu_dense(part, idx) if has_kernel(part) else part.dense(idx)


def _part_reduce(part, local, how, qw, kw):
    """A ``ParallelCore`` part's reduce over its channels ``local``: its kernel's, else the XLA blocks."""
    if has_kernel(part):
        return cpu_reduce(part, local, how, qw, kw)
    B, n, L = qw.shape
    return blocked_reduce_jit(part, jnp.asarray(local), qw, kw, how, block_size(n, B, L, None))


_parallel_dense, _ = with_xla_backward(_parallel_call, None)

# The conv's dense is the kernel, its reduce plain XLA (differentiable as it is).
_conv_dense, _ = with_xla_backward(_conv_call, _conv_reduce_call)
# Attention: the dense kernel; the reduce is the XLA blocks (within the target already).
_attention_dense, _ = with_xla_backward(_attention_call, None)


def _bidirectional_dense(core, idx):
    """A ``BidirectionalCore``'s channels from both directions' kernels (flipped and summed by XLA)."""
    return core.dense_by(idx, cpu_dense)


def _bidirectional_reduce(core, idx, mode, qw, kw):
    """The blocked reduce with each block from both directions' kernels (the matrices are not
    causal, which the fused reduces assume)."""
    return blocked_reduce_by(core, idx, qw, kw, mode, cpu_dense)


def _las_call(core, idx):
    """``(B, n, L, L)`` LaS attention matrices of a ``LaSCore``'s heads ``idx``: the attention kernel's
    logits with the ELD and ALiBi distance terms, one softmax and one pooled row each, written once."""
    load()
    f32 = jnp.float32
    q = jnp.take(core.q, idx, axis=1).astype(f32)
    B, n, L, _ = q.shape
    per_head = lambda x: jnp.zeros((n,), f32) if x is None else jnp.take(jnp.asarray(x, f32), idx)
    lo, _ = pool_window(core.pool, core.align)
    call = jax.ffi.ffi_call(_LAS_TARGET, jax.ShapeDtypeStruct((B, n, L, L), f32), vmap_method="sequential")
    return call(q, core.k.astype(f32), idx.astype(jnp.int32), per_head(core.alpha), per_head(core.slope),
                has_alpha=np.int64(core.alpha is not None), has_slope=np.int64(core.slope is not None),
                pool=np.int64(core.pool), lo=np.int64(lo), chunk=np.int64(core.chunk or 0),
                threads=np.int64(num_threads()), huge_pages=np.int64(huge_pages()), stream=streamed((B, n, L, L)))


_las_dense, _ = with_xla_backward(_las_call, None)


def _reduce_by_blocks(dense):
    """A core's reduce as the blocked XLA reduce with each block formed by the dense kernel
    ``dense`` (attention: RecurrentGemma's benchmark layer 3.9-5.2 ms, against 6.0-7.2 ms with
    XLA's softmax)."""
    def reduce(core, idx, mode, qw, kw):
        B, n, L = qw.shape
        return blocked_reduce(core, idx, qw, kw, mode, block_size(n, B, L, None), dense=dense)

    return jax.jit(full_precision(reduce))


def _masked_call(core, idx):
    """``(B, n, L, L)`` of a ``DocumentMaskedCore`` over a core whose kernel takes no document ids: that
    kernel's channels ``idx`` with the entries between documents set to 0 (``DocumentMaskedCore.dense``)."""
    return core.dense_by(idx, cpu_dense)


_masked_dense, _ = with_xla_backward(_masked_call, None)


def _either(use_first, first, second):
    """An entry point calling ``first`` for a core where ``use_first(core)``, else ``second``."""
    return lambda core, *args: (first if use_first(core) else second)(core, *args)


# core type -> (dense, reduce). ``reduce`` calls the kernels eagerly: jitted, one compilation per
# shape serves every call (eager, the scans and mode switches around them compile on each call).
_state_decay = (_dense, jax.jit(full_precision(_reduce)))
_head_reduce_traced = jax.jit(full_precision(_head_reduce))


@functools.partial(jax.jit, static_argnums=1)
@full_precision
def _head_reduce_static(core, key, mode, qw, kw):
    """``_head_reduce`` of the channels ``key`` (a tuple: static), so the scan forms only their
    heads' matrices (each per-head map of ``explain.head_maps`` formed every head's before); one
    compilation per selection."""
    return _head_reduce(core, np.asarray(key, np.int32), mode, qw, kw)


def _head_reduce_by_channels(core, idx, mode, qw, kw):
    if isinstance(idx, jax.core.Tracer):
        return _head_reduce_traced(core, idx, mode, qw, kw)
    return _head_reduce_static(core, channel_key(idx), mode, qw, kw)


_head = (_head_dense, _head_reduce_by_channels)
# A low-rank ScalarDecayCore's channels share its groups' matrices, as a head-matrix core's its heads'.
_scalar_decay = tuple(_either(_low_rank, *pair) for pair in zip(_head, _state_decay))
_reads_own_documents = lambda core: _reads_documents(core.inner)
_document_masked = tuple(_either(_reads_own_documents, *pair)
                         for pair in zip(_state_decay, (_masked_dense, _reduce_by_blocks(_masked_dense))))
_KERNELS = {StateDecayCore: _state_decay, ScalarDecayCore: _scalar_decay, DocumentMaskedCore: _document_masked,
            **{t: _head for t in HEAD_CORES}, RwkvCore: (_rwkv_dense, jax.jit(_rwkv_reduce)),
            ShortConvCore: (_conv_dense, jax.jit(_conv_reduce_call)),
            AttentionCore: (_attention_dense, _reduce_by_blocks(_attention_dense)),
            LaSCore: (_las_dense, _reduce_by_blocks(_las_dense)),
            BidirectionalCore: (_bidirectional_dense, jax.jit(full_precision(_bidirectional_reduce)))}


def _channels(idx):
    """int32 channels: numpy where concrete (``with_xla_backward`` hands them to the kernel as they
    are, so a head kernel forms only their heads' matrices), else the traced array."""
    return jnp.asarray(idx, jnp.int32) if isinstance(idx, jax.core.Tracer) else np.asarray(idx, np.int32)


def cpu_dense(core, idx):
    """``core.dense(idx)`` by the fused CPU kernel.

    Args:
      core: a core ``has_kernel`` accepts; idx: ``(n,)`` int channel indices.
    Returns:
      ``(B, n, L, L)`` float32, equal to ``core.dense(idx)`` to float32 rounding.
    """
    check_core(core)
    # concrete channels stay numpy (with_xla_backward): a head kernel forms only their heads' matrices
    idx = _channels(idx)
    if type(core) is ParallelCore:
        return _parallel_dense(core, idx) if _parallel_fast(core, idx) else core.dense(idx)
    return _KERNELS[type(core)][0](core, idx)


def cpu_reduce(core, idx, how: str, qw, kw):
    """Fused channel reduction ``sum_c qw[b,c,i] f(H_c[b,i,j]) kw[b,c,j]`` on the CPU:
    only the ``(B, L, L)`` output is written.

    ``f`` is the identity (``how="mean"`` / ``"weighted"``), ``abs`` (``"abs_mean"``) or
    ``max(., 0)`` (``"pos_mean"``); the caller puts ``1/n`` into ``qw`` for the means.

    Args:
      core: a core ``has_kernel`` accepts; idx: ``(n,)`` int channels.
      qw, kw: ``(B, n, L)`` per-channel, per-position query / key weights.
    Returns:
      ``(B, L, L)`` float32.
    """
    check_core(core)
    if how not in MODES:
        raise ValueError(f"how must be one of {tuple(MODES)}, got {how!r}")
    if type(core) is ParallelCore:
        if isinstance(idx, jax.core.Tracer):
            return blocked_reduce_jit(core, idx, qw, kw, how, block_size(qw.shape[1], qw.shape[0], qw.shape[2], None))
        return parallel_reduce(core, idx, how, qw, kw, _part_dense, _part_reduce)
    reduce = _KERNELS[type(core)][1]
    idx = _channels(idx)
    return reduce(core, idx, jnp.asarray(MODES[how], jnp.int32), jnp.asarray(qw, jnp.float32),
                  jnp.asarray(kw, jnp.float32))


def _require():
    if jax.default_backend() != "cpu":
        raise ValueError(f"impl='cpu' runs on JAX's CPU backend; the default backend is "
                         f"{jax.default_backend()!r} (use 'auto' or 'pallas' there)")
    num_threads(strict=True)
    load()


AUTO_MIN_ENV = "IMPLICIT_ATTN_CPU_AUTO_MIN"


def auto_min_from_env() -> int:
    """The ``impl="auto"`` size threshold ``$IMPLICIT_ATTN_CPU_AUTO_MIN`` (factor elements;
    unset or empty: 65,536); ``ValueError`` naming the variable unless a non-negative integer."""
    raw = os.environ.get(AUTO_MIN_ENV, "").strip()
    if not raw:
        return 1 << 16
    if not raw.isdigit():
        raise ValueError(f"${AUTO_MIN_ENV}={raw!r} is not a non-negative integer (factor elements)")
    return int(raw)


# ``impl="auto"`` uses the kernels only for operators whose factors hold at least this many
# elements: below it XLA takes well under a millisecond, and a first call would otherwise
# wait several seconds for the library to compile (once per machine). Set from
# ``$IMPLICIT_ATTN_CPU_AUTO_MIN`` at import (the test suite sets 0: kernels at every size).
AUTO_MIN_FACTOR_ELEMENTS = auto_min_from_env()


def pays_off(core) -> bool:
    """Whether ``core``'s factors (every array in it, ``(B, C, L)``-sized and the like) hold
    at least ``AUTO_MIN_FACTOR_ELEMENTS`` elements, the size from which ``impl="auto"``
    uses the kernels."""
    return sum(int(x.size) for x in jax.tree.leaves(core) if hasattr(x, "size")) >= AUTO_MIN_FACTOR_ELEMENTS


def _forward_kernel(target: str, reference, prepare=lambda *a: a, out=lambda *a: a[0].shape, vjp_target=None,
                    **attrs):
    """A forward computation by the library's FFI handler ``target`` (its output float32 of shape
    ``out(*args)``, by default the first operand's; the operands ``prepare(*args)``; ``attrs`` its
    integer attributes besides ``threads``), differentiated in both modes through
    ``reference(*args)``, XLA's form of the same numbers; or, given ``vjp_target`` (a handler
    taking ``target``'s operands and attributes and the output's cotangent, returning one
    cotangent per operand), reverse mode by that kernel (``with_kernel_reverse_mode``).

    A custom JVP (not VJP): forward-mode derivatives of a model (``jax.jvp`` through its taps)
    need one, and reverse mode transposes the linear tangent map.
    """
    static = lambda: dict(threads=np.int64(num_threads()), **{k: np.int64(v) for k, v in attrs.items()})

    def call(*args):
        load()
        run = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out(*args), jnp.float32), vmap_method="sequential")
        return run(*prepare(*args), **static())

    if vjp_target is None:
        return with_reference_derivatives(call, reference)

    def backward(args, ct):
        load()
        operands, pull = jax.vjp(prepare, *args)
        run = jax.ffi.ffi_call(vjp_target, [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in operands],
                               vmap_method="sequential")
        return pull(tuple(run(*operands, ct.astype(jnp.float32), **static())))

    return with_kernel_reverse_mode(call, reference, backward, target)


def with_reference_derivatives(fast, reference):
    """``fast(*args)``'s values with ``reference(*args)``'s derivatives, forward and reverse mode
    (a custom JVP: reverse mode transposes the reference's linear tangent map). For a kernel
    ``fast`` and the XLA computation ``reference`` of the same numbers; every argument (a pytree)
    must be differentiable, as ``jax.custom_jvp`` wants."""
    run = jax.custom_jvp(fast)
    run.defjvp(lambda primals, tangents: (fast(*primals), jax.jvp(reference, primals, tangents)[1]))
    return run


KERNEL_REVERSE_ENV = "IMPLICIT_ATTN_KERNEL_REVERSE"


def kernel_reverse_mode() -> bool:
    """Whether the kernels that have a reverse-mode kernel use it (``with_kernel_reverse_mode``);
    ``$IMPLICIT_ATTN_KERNEL_REVERSE=0`` makes them transpose their XLA reference instead, as before,
    and leaves the residual stream's cotangent to XLA (``cotangent_computed_once``) (read when a
    gradient is traced)."""
    return os.environ.get(KERNEL_REVERSE_ENV, "1") not in ("0", "false", "no", "")


def with_kernel_reverse_mode(fast, reference, backward, name: str):
    """``fast(*args)``'s values with forward-mode derivatives through ``reference(*args)`` (XLA's
    JVP, as ``with_reference_derivatives``) and reverse mode by ``backward(args, cotangent) ->
    (one cotangent per argument)``, a kernel, instead of the transpose of the reference's tangent
    map (whose XLA program took most of a gradient's compile and run time). ``kernel_reverse_mode()``
    false: the reference's transpose, as ``with_reference_derivatives``.

    The tangent map is a primitive of its own (``<name>_tangent``): evaluated (and lowered, on
    any platform) as the reference's JVP, transposed by ``backward``, and batched by folding the
    mapped axis into every operand's leading axis (which must be a batch axis the reference
    maps independently). Second derivatives are not taken (nor were they before: ``fast`` is a
    kernel call without derivatives of its own).

    Args:
      fast, reference: as ``with_reference_derivatives``; arguments are float arrays.
      backward: ``(args tuple, cotangent of the output) -> tuple of cotangents`` shaped as ``args``.
      name: the primitive's name prefix.
    """
    tangent_p = Primitive(f"{name}_tangent")

    def tangent_map(*args, n, shape=None, dtype=None):
        return jax.jvp(reference, args[:n], args[n:])[1]

    tangent_jit = jax.jit(tangent_map, static_argnames=("n", "shape", "dtype"))

    def transpose(ct, *args, n, shape, dtype):
        primals, tangents = args[:n], args[n:]
        if any(ad.is_undefined_primal(x) for x in primals):
            raise ValueError(f"{name}: the tangent map is linear in its tangents only")
        if type(ct) is ad.Zero:
            return [None] * len(args)
        cts = backward(primals, ct)
        return [None] * n + [c if ad.is_undefined_primal(t) else None for t, c in zip(tangents, cts)]

    def batch(args, dims, n, shape, dtype):
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        lead = [jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
                for x, d in zip(args, dims)]
        y = tangent_p.bind(*(x.reshape((-1,) + x.shape[2:]) for x in lead), n=n,
                           shape=(size * shape[0],) + shape[1:], dtype=dtype)
        return y.reshape((size,) + shape), 0

    def rule(primals, tangents):
        y = fast(*primals)
        if not kernel_reverse_mode():
            return y, jax.jvp(reference, primals, tangents)[1]
        return y, tangent_p.bind(*primals, *tangents, n=len(primals), shape=tuple(y.shape), dtype=y.dtype)

    tangent_p.def_impl(lambda *args, **params: tangent_jit(*args, **params))
    tangent_p.def_abstract_eval(lambda *avals, n, shape, dtype: jax.core.ShapedArray(shape, dtype))
    mlir.register_lowering(tangent_p, mlir.lower_fun(tangent_map, multiple_results=False))
    ad.primitive_transposes[tangent_p] = transpose
    batching.primitive_batchers[tangent_p] = batch

    run = jax.custom_jvp(fast)
    run.defjvp(rule)
    return run


# A per batch row (B, C, N), so the reverse-mode primitive can batch by the leading axis.
_scan = _forward_kernel(_SCAN_TARGET, selective_scan_sequential,
                       lambda u, dt, A, Bm, Cm: (u, dt, jnp.swapaxes(A, 1, 2), Bm, Cm), vjp_target=_SCAN_VJP_TARGET)


def selective_scan(u, dt, A, Bm, Cm):
    """Mamba-1's selective scan by the fused CPU kernel: ``ops.selective_scan_sequential``'s
    numbers (to float32 rounding: the kernel's ``exp`` is its own), a machine vector of
    channels per work item (16 with AVX-512, 8 without), the channel blocks spread over
    ``num_threads()`` threads. Forward-mode derivatives go through ``ops.selective_scan_sequential``;
    reverse mode is the kernel's own backward pass (``with_kernel_reverse_mode``: states kept every
    32 positions and formed again chunk by chunk), or the reference's transpose with
    ``$IMPLICIT_ATTN_KERNEL_REVERSE=0``.

    Args:
      u, dt: ``(B, L, C)``; A: ``(C, N)`` with ``N <= MAX_STATE``; Bm, Cm: ``(B, L, N)``
        (cast to float32).
    Returns:
      ``(B, L, C)`` float32.
    """
    N = A.shape[-1]
    if N > MAX_STATE:
        raise ValueError(f"the selective-scan kernel keeps at most {MAX_STATE} states per channel, got {N}")
    A = jnp.broadcast_to(jnp.asarray(A, jnp.float32), (u.shape[0],) + A.shape)
    return _scan(*(jnp.asarray(x, jnp.float32) for x in (u, dt, A, Bm, Cm)))


# A forward's scan takes the kernel from SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS state
# updates on (4,194,304 by default: XLA's scan ~5.5 ms, the kernel ~1.2 ms on the 2-core Xeon).
# Below it XLA's scan is a few milliseconds at most (the shipped induction model's layer:
# 0.9 ms), less than the library's first build (~8 s) would cost a first forward.
SCAN_AUTO_MIN_FACTOR = 64


def scan_pays_off(u, A) -> bool:
    """Whether a CPU forward runs Mamba-1's scan of ``u (B, L, C)`` and ``A (C, N)`` by the kernel:
    JAX's default backend is the CPU, ``N <= MAX_STATE``, the scan updates at least
    ``SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS`` state entries (``B L C N``), and the
    kernel builds here."""
    return A.shape[-1] <= MAX_STATE and _updates_pay_off(int(np.prod(u.shape)) * A.shape[-1])


def _updates_pay_off(updates: int) -> bool:
    """The forward kernels' rule: JAX's default backend is the CPU, the recurrence updates at least
    ``SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS`` state entries, and the kernel builds here."""
    return (jax.default_backend() == "cpu" and updates >= SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS
            and available())


# A per batch row (B, 1, H), so the reverse-mode primitive can batch by the leading axis.
_ssd = _forward_kernel(_SSD_TARGET, ssd_chunked, vjp_target=_SSD_VJP_TARGET)


def ssd_scan(x, dt, A, Bm, Cm):
    """Mamba-2's SSD by the fused CPU kernel, one step per position: per head ``S_t =
    exp(dt_t A_h) S_{t-1} + (dt_t x_t) B_t^T``, ``y_t = S_t C_t`` (``ops.ssd_chunked``'s numbers to
    float32 rounding), a head's channels in vectors, the heads spread over ``num_threads()``
    threads. Forward-mode derivatives go through ``ops.ssd_chunked``; reverse mode is the kernel's own
    backward pass (``with_kernel_reverse_mode``: each head's state rows stored every 16 positions and
    formed again chunk by chunk), or the chunked form's transpose with ``$IMPLICIT_ATTN_KERNEL_REVERSE=0``.

    Args:
      x: ``(B, L, H, P)``; dt: ``(B, L, H)``; A: ``(H,)``; Bm, Cm: ``(B, L, G, N)`` with ``H % G
        == 0`` (cast to float32).
    Returns:
      ``(B, L, H, P)`` float32.
    """
    if x.ndim != 4 or Bm.ndim != 4 or Bm.shape[2] < 1 or x.shape[2] % Bm.shape[2]:
        raise ValueError(f"ssd_scan: x must be (B, L, H, P) and Bm (B, L, G, N) with H a multiple of G, "
                         f"got {x.shape} and {Bm.shape}")
    A = jnp.broadcast_to(jnp.asarray(A, jnp.float32), (x.shape[0], 1) + A.shape)
    return _ssd(*(jnp.asarray(a, jnp.float32) for a in (x, dt, A, Bm, Cm)))


def ssd_pays_off(x, Bm) -> bool:
    """Whether a CPU forward runs Mamba-2's SSD of ``x (B, L, H, P)`` with ``Bm (B, L, G, N)`` by
    the kernel: JAX's default backend is the CPU, the recurrence updates at least
    ``SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS`` state entries (``B L H P N``), and the
    kernel builds here."""
    return _updates_pay_off(int(np.prod(x.shape)) * Bm.shape[-1])


def _dplr_kernel(low_rank: bool, bonus: bool, after: bool):
    """The DPLR kernel for one combination of optional terms, its operands ``(q, k, v, log_w[, a,
    b][, bonus])`` (the absent ones passed to the handler as empty arrays)."""
    def split(extra):
        ab = tuple(extra[:2]) if low_rank else (None, None)
        return ab, (extra[-1] if bonus else None)

    def reference(q, k, v, log_w, *extra):
        (a, b), bo = split(extra)
        return dplr_rule(q, k, v, log_w, a, b, bo, after=after)

    def prepare(q, k, v, log_w, *extra):
        empty = jnp.zeros((0,), jnp.float32)
        (a, b), bo = split(extra)
        return q, k, v, log_w, *(empty if x is None else x for x in (a, b, bo))

    return _forward_kernel(_DPLR_TARGET, reference, prepare, out=lambda q, k, v, *rest: v.shape,
                           vjp_target=_DPLR_VJP_TARGET, has_ab=int(low_rank), has_bonus=int(bonus), after=int(after))


_dplr = {key: _dplr_kernel(*key) for key in itertools.product((False, True), repeat=3)}


def dplr_scan(q, k, v, log_w, a=None, b=None, bonus=None, after: bool = True):
    """The DPLR recurrence's outputs by the fused CPU kernel, one step per position: per head
    ``S_t = S_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T``, read ``o_t = S_t q_t`` (``after``) or
    ``S_{t-1} q_t + bonus_t v_t`` (``ops.dplr_rule``'s numbers to float32 rounding), the state's
    ``d_v`` values per key dimension in vectors, the heads spread over ``num_threads()`` threads.
    Derivatives (forward and reverse mode) go through ``ops.dplr_rule``.

    Args:
      q, k: ``(B, H, L, d_k)``; v: ``(B, H, L, d_v)``; log_w: ``(B, H, L, d_k)``; a, b: ``(B, H, L,
        d_k)`` or None (both or neither); bonus: ``(B, H, L)`` or None; after: as
        ``ops.dplr_rule`` (cast to float32).
    Returns:
      ``(B, H, L, d_v)`` float32.
    """
    if (a is None) != (b is None):
        raise ValueError("dplr_scan: give both low-rank vectors a and b, or neither")
    per_key = [x for x in (k, log_w, a, b) if x is not None]
    if (q.ndim != 4 or any(x.shape != q.shape for x in per_key) or v.ndim != 4 or v.shape[:3] != q.shape[:3]
            or (bonus is not None and bonus.shape != q.shape[:3])):
        raise ValueError(f"dplr_scan: q, k, log_w, a, b must be (B, H, L, d_k), v (B, H, L, d_v) and bonus "
                         f"(B, H, L); got q {q.shape}, k {k.shape}, v {v.shape}, log_w {log_w.shape}"
                         + ("" if a is None else f", a {a.shape}, b {b.shape}")
                         + ("" if bonus is None else f", bonus {bonus.shape}"))
    extra = ((a, b) if a is not None else ()) + ((bonus,) if bonus is not None else ())
    run = _dplr[(a is not None, bonus is not None, bool(after))]
    return run(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, log_w, *extra)))


def _delta_as_dplr(q, k, v, log_a, beta, erase: bool):
    """The gated delta rule's operands as the DPLR kernel's: ``S_{t-1} Diag(a_t) (I - b_t k_t k_t^T)
    + b_t v_t k_t^T`` is ``S_{t-1} (Diag(a_t) - (a_t k_t) (b_t k_t)^T) + v_t (b_t k_t)^T``."""
    log_w = log_a if log_a.ndim == 4 else jnp.broadcast_to(log_a[..., None], k.shape)
    bk = beta[..., None] * k
    empty = jnp.zeros((0,), jnp.float32)
    a, b = (-(jnp.exp(log_w) * k), bk) if erase else (empty, empty)
    return q, bk, v, log_w, a, b, empty


_delta = {erase: _forward_kernel(_DPLR_TARGET, functools.partial(delta_rule, erase=erase),
                                 functools.partial(_delta_as_dplr, erase=erase),
                                 out=lambda q, k, v, log_a, beta: v.shape, vjp_target=_DPLR_VJP_TARGET,
                                 has_ab=int(erase), has_bonus=0, after=1)
          for erase in (True, False)}


def delta_scan(q, k, v, log_a, beta, erase: bool = True):
    """The gated delta rule's outputs by the fused CPU kernel (``dplr_scan``'s, the rule written as
    a DPLR recurrence), one step per position: per head ``S_t = S_{t-1} Diag(a_t) (I - b_t k_t
    k_t^T) + b_t v_t k_t^T``, ``o_t = S_t q_t`` (``ops.delta_rule``'s numbers to float32 rounding).
    Derivatives (forward and reverse mode) go through ``ops.delta_rule``.

    Args:
      q, k: ``(B, H, L, d_k)``; v: ``(B, H, L, d_v)``; log_a: ``(B, H, L)`` (one decay per head) or
        ``(B, H, L, d_k)`` (one per key dimension); beta: ``(B, H, L)``; erase: as ``ops.delta_rule``
        (cast to float32).
    Returns:
      ``(B, H, L, d_v)`` float32.
    """
    if (q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]
            or log_a.shape not in (q.shape[:3], q.shape)):
        raise ValueError(f"delta_scan: q, k must be (B, H, L, d_k), v (B, H, L, d_v), log_a (B, H, L) or "
                         f"(B, H, L, d_k), beta (B, H, L); got q {q.shape}, k {k.shape}, v {v.shape}, "
                         f"log_a {log_a.shape}, beta {beta.shape}")
    return _delta[bool(erase)](*(jnp.asarray(a, jnp.float32) for a in (q, k, v, log_a, beta)))


def _mlstm_as_delta(q, k, v, log_f, log_i, m):
    """The mLSTM's operands as the non-erasing delta rule's: the stabilised state ``C_t = e^{f_t +
    m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} v_t k_t^T`` is its ``S_t`` with ``log a_t = f_t + m_{t-1}
    - m_t`` and ``b_t = e^{i_t - m_t}``, and a column of ones after ``v`` carries the normaliser's
    ``n_t``. ``m_{-1}`` is taken as ``m_0`` (the state before is zero, so it only keeps ``a_0 <= 1``)."""
    m_before = jnp.concatenate([m[..., :1], m[..., :-1]], axis=-1)
    ones = jnp.ones(v.shape[:-1] + (1,), jnp.float32)
    return q, k, jnp.concatenate([v, ones], axis=-1), log_f + m_before - m, jnp.exp(log_i - m)


def mlstm_scan(q, k, v, log_f, log_i, m, eps: float):
    """The mLSTM read-out by the fused CPU kernel, ``ops.mlstm_rule``'s numbers (to float32
    rounding; float32): per head the stabilised state ``C_t = e^{f_t + m_{t-1} - m_t} C_{t-1} +
    e^{i_t - m_t} v_t k_t^T`` and ``n_t`` likewise with ``1``, run by the non-erasing delta rule's
    recurrence (``delta_scan(..., erase=False)`` with a column of ones after ``v``), one step per
    position; ``h_t = C_t q_t / (max(|n_t . q_t|, e^{-m_t}) + eps)``. With the model's stabiliser
    (``ops.mlstm_stabiliser``: ``m_t >= f_t + m_{t-1}`` and ``m_t >= i_t``) every factor is at most 1,
    as in ``mlstm_rule``. Derivatives are those of this composition: the delta rule's (``delta_scan``:
    reverse mode by its kernel, forward mode through ``ops.delta_rule``) and XLA's for the rest.

    Args:
      q, k: ``(B, H, L, d_k)`` (``q`` already scaled); v: ``(B, H, L, d_v)``; log_f, log_i, m:
        ``(B, H, L)`` log forget gates, log input gates, the stabiliser; eps: added to the normaliser.
    Returns:
      ``(h (B, H, L, d_v), norm (B, H, L))`` float32, ``norm`` the normaliser ``max(|n_t . q_t|,
      e^{-m_t}) + eps``.
    """
    if (q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]
            or any(g.shape != q.shape[:3] for g in (log_f, log_i, m))):
        raise ValueError(f"mlstm_scan: q, k must be (B, H, L, d_k), v (B, H, L, d_v), log_f, log_i and m (B, H, L); "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}, log_f {log_f.shape}, log_i {log_i.shape}, "
                         f"m {m.shape}")

    def fast(q, k, v, log_f, log_i, m):
        o = _delta[False](*_mlstm_as_delta(q, k, v, log_f, log_i, m))
        norm = jnp.maximum(jnp.abs(o[..., -1]), jnp.exp(-m)) + jnp.asarray(eps, jnp.float32)
        return o[..., :-1] / norm[..., None], norm

    return fast(*(jnp.asarray(a, jnp.float32) for a in (q, k, v, log_f, log_i, m)))

def recurrence_pays_off(k, v) -> bool:
    """Whether a CPU forward runs a recurrence with a ``(d_v, d_k)`` state per head (the delta rule,
    the DPLR recurrence) of keys ``k (B, H, L, d_k)`` and values ``v (B, H, L, d_v)`` by the kernel:
    JAX's default backend is the CPU, it updates at least ``SCAN_AUTO_MIN_FACTOR *
    AUTO_MIN_FACTOR_ELEMENTS`` state entries (``B H L d_k d_v``), and the kernel builds here."""
    return _updates_pay_off(int(np.prod(v.shape)) * k.shape[-1])


_wkv = _forward_kernel(_WKV_TARGET, wkv_chunked, out=lambda w, u, k, v: k.shape)


def wkv_scan(w, u, k, v):
    """RWKV-4's WKV recurrence by the fused CPU kernel, one step per position: per channel HF's
    running-max recurrence (``ops.wkv_chunked``'s numbers to float32 rounding: the kernel's ``exp``
    is its own), sixteen channels per item, the items spread over ``num_threads()`` threads.
    Derivatives (forward and reverse mode) go through ``ops.wkv_chunked``.

    Args:
      w: ``(A,)`` log decay; u: ``(A,)`` bonus; k, v: ``(B, L, A)`` (cast to float32).
    Returns:
      ``(B, L, A)`` float32.
    """
    if k.ndim != 3 or v.shape != k.shape or w.shape != k.shape[-1:] or u.shape != k.shape[-1:]:
        raise ValueError(f"wkv_scan: w, u must be (A,) and k, v (B, L, A); got w {w.shape}, u {u.shape}, "
                         f"k {k.shape}, v {v.shape}")
    return _wkv(*(jnp.asarray(x, jnp.float32) for x in (w, u, k, v)))


# The chunked WKV form computes a (T, T) block per chunk of T = 32 positions and channel: its work,
# not the recurrence's B L A steps, is what the forward kernels' size rule compares.
WKV_CHUNK_WORK = 32


def wkv_pays_off(k) -> bool:
    """Whether a CPU forward runs RWKV-4's WKV of keys ``k (B, L, A)`` by the kernel: JAX's default
    backend is the CPU, the chunked form's in-chunk work (``B L A`` times ``WKV_CHUNK_WORK``) is at
    least ``SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS``, and the kernel builds here."""
    return _updates_pay_off(int(np.prod(k.shape)) * WKV_CHUNK_WORK)


def gated_delta_net(x, xcols, conv_w, conv_b, z, zcols, log_a, beta, norm_w, key_heads: int, eps: float):
    """The Gated DeltaNet mixer between its projections by the fused CPU kernel (Qwen3-Next's
    ``qwen3_next.block.delta_output``: conv, SiLU, l2 norms, the gated delta rule, the gated RMSNorm),
    one step per position, one (batch, key head) item per thread at a time (its ``q`` and ``k`` once for
    the value heads that read them). Per value head ``h``
    (key head ``g = h // (H_v / H_k)``): ``u = SiLU(conv([q_g | k_g | v_h]) + conv_b)``, ``q =
    l2(u_q) d_k^-1/2``, ``k = l2(u_k)``, ``S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``
    (``a_t = exp(log_a)``, ``b_t = beta``), ``o_t = S_t q_t``, ``y_t = norm_w SiLU(z_t) o_t /
    rms(o_t)``. A NaN in ``u_k``, ``u_v``, ``beta`` or ``log_a`` makes ``y`` NaN from its step on,
    one in ``u_q`` that step's ``y`` (the XLA path's ``ops.zero_nan`` / ``ops.mark_nan``). No
    derivatives of its own: a model wraps it with ``with_reference_derivatives``.

    Args:
      x: ``(B, L, P_x)`` the projection holding the conv's inputs; xcols: ``(2 H_k d_k + H_v
        d_v,)`` int, the column of ``x`` of each conv channel (``[q | k | v]``, head-major);
      conv_w: ``(2 H_k d_k + H_v d_v, K)``; conv_b: the same channels' bias, or None;
      z: ``(B, L, P_z)`` the projection holding the output gate's inputs; zcols: ``(H_v d_v,)``
        int, the column of ``z`` of each gate channel;
      log_a, beta: ``(B, L, H_v)``; norm_w: ``(d_v,)``; key_heads: ``H_k``; eps: the norm's.
      Floats are cast to float32.
    Returns:
      ``(B, L, H_v d_v)`` float32.
    Raises ``ValueError`` for inconsistent shapes; a column outside ``x`` or ``z`` is an error of
    the call.
    """
    xcols, zcols = (jnp.asarray(c) for c in (xcols, zcols))
    B, L = x.shape[:2] if x.ndim == 3 else (None, None)
    Hv = log_a.shape[-1] if log_a.ndim == 3 else 0
    nx, nz = (int(np.prod(c.shape)) for c in (xcols, zcols))
    dk = (nx - nz) // (2 * key_heads) if key_heads > 0 else 0
    if (x.ndim != 3 or z.ndim != 3 or z.shape[:2] != (B, L) or log_a.shape != (B, L, Hv) or beta.shape != log_a.shape
            or Hv < 1 or key_heads < 1 or Hv % key_heads or nz % Hv or dk < 1 or nx != 2 * key_heads * dk + nz
            or xcols.ndim != 1 or zcols.ndim != 1 or conv_w.ndim != 2 or conv_w.shape[0] != nx
            or norm_w.shape != (nz // Hv,) or (conv_b is not None and conv_b.shape != (nx,))
            or not jnp.issubdtype(xcols.dtype, jnp.integer) or not jnp.issubdtype(zcols.dtype, jnp.integer)):
        raise ValueError(f"gated_delta_net: want x (B, L, Px), xcols (2 Hk dk + Hv dv,) int, conv_w (2 Hk dk + Hv dv, "
                         f"K), conv_b (2 Hk dk + Hv dv,) or None, z (B, L, Pz), zcols (Hv dv,) int, log_a and beta "
                         f"(B, L, Hv), norm_w (dv,), Hv a multiple of key_heads = {key_heads}; got x {x.shape}, "
                         f"xcols {xcols.shape} {xcols.dtype}, conv_w {conv_w.shape}, "
                         f"conv_b {None if conv_b is None else conv_b.shape}, z {z.shape}, zcols {zcols.shape} "
                         f"{zcols.dtype}, log_a {log_a.shape}, beta {beta.shape}, norm_w {norm_w.shape}")
    load()
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    run = jax.ffi.ffi_call(_DELTA_NET_TARGET, jax.ShapeDtypeStruct((B, L, nz), jnp.float32),
                           vmap_method="sequential")
    bias = jnp.zeros((0,), jnp.float32) if conv_b is None else f32(conv_b)
    return run(f32(x), xcols.astype(jnp.int32), f32(conv_w), bias, f32(z), zcols.astype(jnp.int32), f32(log_a),
               f32(beta), f32(norm_w), threads=np.int64(num_threads()), key_heads=np.int64(key_heads),
               key_dim=np.int64(dk), eps=np.float32(eps))


def delta_net_pays_off(B: int, L: int, value_heads: int, dk: int, dv: int) -> bool:
    """Whether a CPU forward runs the Gated DeltaNet mixer of ``value_heads`` heads of ``(d_v,
    d_k)`` states over ``(B, L)`` by ``gated_delta_net``: the forward kernels' size rule on its
    recurrence (``recurrence_pays_off``'s)."""
    return _updates_pay_off(B * value_heads * L * dk * dv)


@functools.lru_cache(maxsize=None)
def _attention_forward(window: int):
    """The attention kernel for one window (an attribute of the call)."""
    return _forward_kernel(
        _ATTENTION_FORWARD_TARGET, functools.partial(attention_output, window=window),
        lambda q, k, v, seg: (q, k, v, jnp.arange(q.shape[1], dtype=jnp.int32) // (q.shape[1] // k.shape[1]), seg),
        out=lambda q, k, v, seg: q.shape[:3] + v.shape[3:], window=window)


def attention_forward(q, k, v, seg, window: int):
    """Masked softmax attention applied to the values by the fused CPU kernel, ``ops.attention_output``'s
    numbers (float32): per chunk of 16 queries the visible keys' logits (later keys, keys at distance
    ``>= window`` and other documents masked), their softmax and the product with the values, never
    forming the ``(L, L)`` matrix; the chunks spread over ``num_threads()`` threads. Derivatives
    (forward and reverse mode) go through ``ops.attention_output``.

    Args:
      q: ``(B, H, L, d)`` queries, already scaled and rotated; k: ``(B, KV, L, d)`` with ``H`` a
        multiple of ``KV`` (query head ``h`` uses key and value head ``h // (H // KV)``);
      v: ``(B, KV, L, e)``; seg: ``(B, L)`` int document ids; window: keys at distance
        ``>= window`` are masked (at least 1).
    Returns:
      ``(B, H, L, e)`` float32.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[1] < 1 or q.shape[1] % k.shape[1] or \
            k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or \
            seg.shape != q.shape[:1] + q.shape[2:3]:
        raise ValueError(f"attention_forward: expected q (B, H, L, d), k (B, KV, L, d) with H a multiple of KV, "
                         f"v (B, KV, L, e) and seg (B, L); got q {q.shape}, k {k.shape}, v {v.shape}, seg {seg.shape}")
    if any(a.dtype != jnp.float32 for a in (q, k, v)):
        raise ValueError(f"attention_forward: q, k and v must be float32, got {q.dtype}, {k.dtype} and {v.dtype}")
    if int(window) < 1:
        raise ValueError(f"attention_forward: window must be >= 1, got {window}")
    return _attention_forward(int(window))(q, k, v, jnp.asarray(seg, jnp.int32))


def attention_pays_off(q, v) -> bool:
    """Whether a CPU forward runs the attention of queries ``q (B, H, L, d)`` and values ``v (B, KV,
    L, e)`` by the kernel: JAX's default backend is the CPU, the logits and the product with the
    values (``B H L^2 (d + e)`` multiply-adds, the upper bound) are at least
    ``SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS``, and the kernel builds here."""
    B, H, L, d = q.shape
    return _updates_pay_off(B * H * L * L * (d + v.shape[-1]))


def _copy(x):
    load()
    return jax.ffi.ffi_call(_COPY_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="broadcast_all")(x)


_computed_once = with_reference_derivatives(_copy, lambda x: x)


def computed_once(x):
    """``x`` itself, computed once: on the CPU a float32 ``x`` goes through a copy by the kernel
    library, a point XLA:CPU cannot fuse across (it drops ``jax.lax.optimization_barrier`` before
    fusing), so the elementwise work that produced ``x`` runs once instead of inside each consumer.
    For small tables read by many large consumers: the rotary embeddings' cosines and sines,
    which XLA otherwise evaluated per head in each consumer (OLMo-Hybrid's benchmark attention layer
    9.3 ms, 6.1 ms with its tables computed once). Elsewhere (another backend, another dtype, no
    kernel library here) ``x`` as it is. Any shape; derivatives are the identity's."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32 or jax.default_backend() != "cpu" or not available():
        return x
    return jax.lax.platform_dependent(x, cpu=_computed_once, default=lambda t: t)


_cotangent_once = with_kernel_reverse_mode(lambda x: x, lambda x: x, lambda args, ct: (_copy(ct),), "cotangent_once")


def cotangent_computed_once(x):
    """``x`` itself, whose cotangent in reverse mode is computed once (``computed_once``'s copy
    applied to the cotangent, on the CPU). For the residual stream between layers: without it
    XLA:CPU formed each layer's cotangent inside every consumer, from the last layer's down
    (fusions of up to 1,500 operations over 354 inputs; 2.2 s of RWKV-6's 2.9 s logit gradients
    at L = 512). Forward values and forward-mode derivatives are the identity's; elsewhere
    (another backend, another dtype, fewer than ``AUTO_MIN_FACTOR_ELEMENTS`` elements, where a first
    call would otherwise wait for the kernel library to compile, no kernel library here,
    ``kernel_reverse_mode()`` off) the identity throughout. Any shape with a leading batch axis."""
    x = jnp.asarray(x)
    if (x.dtype != jnp.float32 or x.ndim == 0 or x.size < AUTO_MIN_FACTOR_ELEMENTS
            or jax.default_backend() != "cpu" or not available()):
        return x
    # a branch of its own per call: JAX caches a branch's traced derivatives by the function, which
    # would keep the first trace's kernel_reverse_mode()
    return jax.lax.platform_dependent(x, cpu=lambda t: _cotangent_once(t), default=lambda t: t)


def fill(shape, value: float = 0.0):
    """A fresh float32 array of ``shape``, every element ``value``, written as the dense kernels
    write their outputs: on huge pages where Linux gives them (unless ``IMPLICIT_ATTN_HUGE_PAGES=0``),
    by ``num_threads()`` threads. The benchmarks' bound on producing an output of that size, which
    XLA's ``jnp.full`` (on 4 KiB pages) overstates. Eager or under ``jit``;
    JAX's CPU backend and the kernel library only (the errors of ``impl="cpu"`` otherwise)."""
    _require()
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"fill: negative dimension in shape {shape}")
    call = jax.ffi.ffi_call(_FILL_TARGET, jax.ShapeDtypeStruct(shape, jnp.float32))
    return call(value=np.float32(value), threads=np.int64(num_threads()), huge_pages=np.int64(huge_pages()))


# Columns per pack of the grouped product (the handler's kGroupTile): two vectors of 16 floats.
GROUP_TILE = 32

_from_tokens = _forward_kernel(_FROM_TOKENS_TARGET, functools.partial(grouped.grouped_matmul_from_tokens, tile=GROUP_TILE),
                              out=lambda x, col, owner, w: (owner.shape[0], w.shape[1], GROUP_TILE))
_to_tokens = _forward_kernel(_TO_TOKENS_TARGET, grouped.grouped_matmul_to_tokens,
                            out=lambda h, col, weights, owner, w: (col.shape[0], w.shape[1]))


def _check_grouped(name: str, col, owner, w, **floats):
    """The grouped products' shared checks: ``col (T, k)`` int, ``owner (P,)`` int, ``w (E, R, K)``,
    every float operand float32 (ValueError naming ``name`` otherwise)."""
    if col.ndim != 2 or owner.ndim != 1 or w.ndim != 3:
        raise ValueError(f"{name}: col must be (T, k), owner (P,) and w (E, R, K); got col {col.shape}, "
                         f"owner {owner.shape}, w {w.shape}")
    if not (jnp.issubdtype(col.dtype, jnp.integer) and jnp.issubdtype(owner.dtype, jnp.integer)):
        raise ValueError(f"{name}: col and owner must be integers, got {col.dtype} and {owner.dtype}")
    bad = {k: v.dtype for k, v in dict(floats, w=w).items() if v.dtype != jnp.float32}
    if bad:
        raise ValueError(f"{name}: {', '.join(bad)} must be float32, got {', '.join(map(str, bad.values()))}")


def grouped_matmul_from_tokens(x, col, owner, w):
    """A mixture-of-experts layer's first product by the fused CPU kernel,
    ``ops.grouped_matmul_from_tokens``'s numbers (float32): pack ``p`` of ``GROUP_TILE`` token
    copies, all expert ``owner[p]``'s, times that expert's weights, each copy's token gathered from
    ``x`` inside the kernel (``ops.expert_columns`` lays the copies out). One pack per work item:
    its columns gathered once, then the expert's rows 12 at a time (6 without AVX-512) with the pack in
    cache; the packs
    spread over ``num_threads()`` threads. Derivatives (forward and reverse mode) go through the
    XLA form, which forms each pack's weights: a model's derivatives take a cheaper XLA form
    (``nn.moe.experts_forward``).

    Args:
      x: ``(T, K)`` tokens; col: ``(T, k)`` int, copy ``(t, j)``'s column in the packs laid end
        to end, all distinct, in ``[0, P GROUP_TILE)``; owner: ``(P,)`` int in ``[-1, E)``;
        w: ``(E, R, K)`` (float32).
    Returns:
      ``(P, R, GROUP_TILE)`` float32, zero columns where no copy is and zero packs where
      ``owner`` is -1.
    """
    _check_grouped("grouped_matmul_from_tokens", col, owner, w, x=x)
    if x.ndim != 2 or col.shape[0] != x.shape[0] or w.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_matmul_from_tokens: x must be (T, K) with col (T, k) and w (E, R, K); got x "
                         f"{x.shape}, col {col.shape}, w {w.shape}")
    return _from_tokens(x, jnp.asarray(col, jnp.int32), jnp.asarray(owner, jnp.int32), w)


def grouped_matmul_to_tokens(h, col, weights, owner, w):
    """A mixture-of-experts layer's second product by the fused CPU kernel,
    ``ops.grouped_matmul_to_tokens``'s numbers (float32): each pack times its expert's weights,
    each copy's column weighted and added into its token's output inside the kernel. Work items
    are blocks of output rows, each over every pack, so every output element is summed by one
    thread in pack order (the same bits for any thread count). Derivatives as
    ``grouped_matmul_from_tokens``'.

    Args:
      h: ``(P, K, GROUP_TILE)`` packs; col: ``(T, k)`` int, as in ``grouped_matmul_from_tokens``;
        weights: ``(T, k)`` each copy's weight; owner: ``(P,)`` int in ``[-1, E)``;
        w: ``(E, R, K)`` (float32).
    Returns:
      ``(T, R)`` float32, ``sum_j weights[t, j]`` times column ``col[t, j]`` of the products.
    """
    _check_grouped("grouped_matmul_to_tokens", col, owner, w, h=h, weights=weights)
    if (h.ndim != 3 or h.shape[2] != GROUP_TILE or owner.shape != h.shape[:1] or w.shape[2] != h.shape[1]
            or weights.shape != col.shape):
        raise ValueError(f"grouped_matmul_to_tokens: h must be (P, K, {GROUP_TILE}) with owner (P,), w (E, R, K) "
                         f"and weights shaped like col; got h {h.shape}, owner {owner.shape}, w {w.shape}, "
                         f"col {col.shape}, weights {weights.shape}")
    return _to_tokens(h, jnp.asarray(col, jnp.int32), weights, jnp.asarray(owner, jnp.int32), w)


def grouped_pays_off(copies: int, K: int, R: int) -> bool:
    """Whether a CPU forward runs a mixture-of-experts product of ``copies`` token copies, ``K``
    inputs and ``R`` outputs by the kernel: JAX's default backend is the CPU, the product has at
    least ``SCAN_AUTO_MIN_FACTOR * AUTO_MIN_FACTOR_ELEMENTS`` multiply-adds, and the kernel builds
    here (below that XLA's loop costs less than a first build)."""
    return _updates_pay_off(copies * K * R)


BACKEND = register_backend(KernelBackend(
    name="cpu", dense=cpu_dense, reduce=cpu_reduce, auto=lambda: jax.default_backend() == "cpu",
    require=_require, ready=available, pays_off=lambda core: pays_off(core)))
for _type in (*_KERNELS, ParallelCore):
    register_core("cpu", _type, _problem)


__all__ = ["auto_min_from_env", "cpu_dense", "cpu_reduce", "fill", "selective_scan", "scan_pays_off", "ssd_scan", "ssd_pays_off", "delta_scan", "mlstm_scan", "dplr_scan", "recurrence_pays_off", "gated_delta_net", "delta_net_pays_off", "with_reference_derivatives", "wkv_scan", "wkv_pays_off", "attention_forward", "attention_pays_off", "grouped_matmul_from_tokens", "grouped_matmul_to_tokens", "grouped_pays_off", "GROUP_TILE", "computed_once", "cotangent_computed_once", "head_matrices", "head_matrix_kernel", "available", "has_kernel", "check_core", "load", "build", "build_parts", "compile_flags", "ARCH_ENV",
           "pays_off", "AUTO_MIN_FACTOR_ELEMENTS", "AUTO_MIN_ENV", "SCAN_AUTO_MIN_FACTOR",
           "library_path", "cache_dir", "num_threads", "CpuKernelUnavailable"]
