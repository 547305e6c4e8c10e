"""Mamba-2 (Hugging Face ``Mamba2ForCausalLM``): block math as pure functions, NNX modules
on top, and the exact implicit operator of each mixer.

Mixer (SSM width ``C = num_heads * head_dim``, heads ``h`` of ``P = head_dim`` channels,
``n_groups`` groups of B/C shared by ``num_heads / n_groups`` consecutive heads):
  ``[z0, x0,] z, xBC, dt = in_proj(h)``; ``xpre = conv(xBC)`` (x, B and C together, with
  bias); ``x, B, C = split(SiLU(xpre))``; ``Delta_h = clamp(softplus(dt_h + dt_bias_h))``;
  ``A_h = -exp(A_log_h)``; SSD ``y = alpha_h u`` per head with
  ``alpha_h[i, j] = (C_g[i] . B_g[j]) exp(A_h sum_{t=j+1..i} Delta_h[t]) Delta_h[j] + D_h [i=j]``;
  gated RMSNorm ``w * g / rms_group(g)`` with ``g = y * SiLU(z)`` (HF: norm after the gate);
  ``out_proj([SiLU(z0) * x0,] normed)``. The ``z0, x0`` MLP part exists only when
  ``num_heads * head_dim < expand * hidden_size`` (``mamba_ssm``'s ``d_ssm < d_inner``; HF
  configs always have it empty).
Operator of SSM channel ``c`` in head ``h``:
  ``H_c = diag(w_c / rms_g(c)) diag(SiLU(z_c)) alpha_h diag(sigmoid(xpre_c)) M_c`` acting on
  the x part of ``xBC`` before the conv, ``offset_c = diag(w_c / rms SiLU(z_c)) alpha_h
  (sigmoid(xpre_c) * b_c)`` from the conv bias.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..operator import ImplicitOperator, _dataclass_pytree
from ..ops import causal_conv, conv_right, linear_scan, segment_sum
from .base import Weights, check_block_input, check_input_ids, check_layers, check_tap, check_taps, count_params
from .mamba import rms_norm

VARIANTS = ("full", "s6_only", "no_conv", "no_gate", "no_act", "no_norm")
HEAD_MATRICES = ("alpha", "mean")
f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of HF ``Mamba2Config`` the forward pass needs."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 1
    num_hidden_layers: int = 1
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 256
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    time_step_limit: tuple = (0.0, float("inf"))

    def __post_init__(self):
        object.__setattr__(self, "time_step_limit", tuple(float(t) for t in self.time_step_limit))
        if self.hidden_act != "silu":
            raise ValueError(f"Mamba-2 hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        for name in ("vocab_size", "hidden_size", "num_heads", "head_dim", "state_size", "n_groups",
                     "num_hidden_layers", "conv_kernel", "chunk_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Mamba-2 config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba-2 num_heads ({self.num_heads}) must be a multiple of "
                             f"n_groups ({self.n_groups})")
        if self.d_ssm > self.intermediate_size:
            raise ValueError(f"Mamba-2 num_heads * head_dim ({self.d_ssm}) exceeds expand * hidden_size "
                             f"({self.intermediate_size})")
        if len(self.time_step_limit) != 2 or not 0 <= self.time_step_limit[0] <= self.time_step_limit[1]:
            raise ValueError(f"Mamba-2 time_step_limit must be (low, high) with 0 <= low <= high, "
                             f"got {self.time_step_limit}")

    @property
    def intermediate_size(self) -> int:
        """Input width of ``out_proj`` (``expand * hidden_size``)."""
        return int(self.expand * self.hidden_size)

    @property
    def d_ssm(self) -> int:
        """SSM width = operator channels: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def d_mlp(self) -> int:
        """Width of the optional gated-MLP part of ``in_proj`` (0 for HF configs)."""
        return self.intermediate_size - self.d_ssm

    @property
    def conv_dim(self) -> int:
        return self.d_ssm + 2 * self.n_groups * self.state_size

    @property
    def proj_size(self) -> int:
        return 2 * self.d_mlp + self.d_ssm + self.conv_dim + self.num_heads

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in names if k in d and d[k] is not None}
        for req in ("vocab_size", "hidden_size", "num_heads"):
            if req not in kw:
                raise ValueError(f"config.json is missing {req!r}")
        if "time_step_limit" in kw:
            kw["time_step_limit"] = tuple(_float_from_json(t) for t in kw["time_step_limit"])
        return cls(**kw)

    def to_hf(self) -> dict:
        d = dataclasses.asdict(self)
        d["time_step_limit"] = [_float_to_json(t) for t in self.time_step_limit]
        d.update(model_type="mamba2", architectures=["Mamba2ForCausalLM"])
        return d


def _float_from_json(v):
    """HF writes non-finite floats as ``{"__float__": "Infinity"}`` (strict JSON)."""
    if isinstance(v, dict):
        if set(v) != {"__float__"}:
            raise ValueError(f"cannot read {v!r} as a number")
        return float(v["__float__"])
    return float(v)


def _float_to_json(v: float):
    return v if math.isfinite(v) else {"__float__": "Infinity" if v > 0 else "-Infinity"}


# ----------------------------------------------------------------------------- math

def _linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def _heads(x, n: int):
    """``(..., n * m) -> (..., n, m)``."""
    return x.reshape(x.shape[:-1] + (n, x.shape[-1] // n))


def mixer_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of the mixer for input ``h (B, L, d_model)``.

    Returns a dict with ``z0, x0 (B, L, d_mlp)``, ``z, x, xpre, u (B, L, C)`` (x = SSM part
    of ``xBC`` before the conv, ``xpre`` after the conv with bias, ``u = SiLU(xpre)``),
    ``Bm, Cm (B, L, n_groups, N)`` float32, ``dt (B, L, H)`` float32, ``A (H,)`` float32.
    """
    m, C, G, N, H = cfg.d_mlp, cfg.d_ssm, cfg.n_groups, cfg.state_size, cfg.num_heads
    proj = _linear(h, p["in_proj.weight"], p.get("in_proj.bias"))
    z0, x0, z = proj[..., :m], proj[..., m:2 * m], proj[..., 2 * m:2 * m + C]
    xbc = proj[..., 2 * m + C:2 * m + C + cfg.conv_dim]
    dt_in = proj[..., 2 * m + C + cfg.conv_dim:]
    xbc_pre = causal_conv(xbc, p["conv1d.weight"][:, 0, :], p.get("conv1d.bias"))
    act = jax.nn.silu(xbc_pre)
    Bm = _heads(act[..., C:C + G * N], G).astype(f32)
    Cm = _heads(act[..., C + G * N:], G).astype(f32)
    dt = jax.nn.softplus(dt_in.astype(f32) + p["dt_bias"].astype(f32))
    dt = jnp.clip(dt, *cfg.time_step_limit)
    A = -jnp.exp(p["A_log"].astype(f32))
    return dict(z0=z0, x0=x0, z=z, x=xbc[..., :C], xpre=xbc_pre[..., :C], u=act[..., :C],
                Bm=Bm, Cm=Cm, dt=dt, A=A)


def ssd(x, dt, A, Bm, Cm, chunk: int, D=None):
    """Chunked SSD: ``y_h = alpha_h x_h`` for every head, without forming ``alpha``.

    Intra-chunk blocks are masked matmuls; chunk states are passed on by a scan over
    chunks. Any ``L`` (the tail chunk is zero-padded with ``dt = 0``).

    Args:
      x: ``(B, L, H, P)`` head inputs; dt: ``(B, L, H)`` float32 step sizes; A: ``(H,)``
        float32 (negative); Bm, Cm: ``(B, L, G, N)`` with ``H % G == 0`` (head h reads
        group ``h // (H / G)``); chunk: chunk length; D: optional ``(H,)`` skip.
    Returns:
      ``(B, L, H, P)`` float32.
    """
    Bn, L, H, P = x.shape
    G, N = Bm.shape[2:]
    hg = H // G
    Q = min(chunk, L)
    nc = -(-L // Q)
    pad = nc * Q - L
    padt = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    xf = x.astype(f32)
    xs = padt(xf * dt[..., None]).reshape(Bn, nc, Q, G, hg, P)
    Bc = padt(Bm).reshape(Bn, nc, Q, G, N)
    Cc = padt(Cm).reshape(Bn, nc, Q, G, N)
    la = padt(dt * A).reshape(Bn, nc, Q, G, hg)
    la = jnp.moveaxis(la, 2, -1)  # (B, nc, G, hg, Q)

    # Diagonal blocks: (C_i . B_j) exp(segment sum) masked.
    dec = jnp.exp(segment_sum(la))  # (B, nc, G, hg, Q, Q)
    cb = jnp.einsum("bcign,bcjgn->bcgij", Cc, Bc)
    y = jnp.einsum("bcgij,bcghij,bcjghp->bcighp", cb, dec, xs)

    # State at the end of each chunk, then passed from chunk to chunk.
    cs = jnp.cumsum(la, axis=-1)
    tot = cs[..., -1]  # (B, nc, G, hg)
    states = jnp.einsum("bcjgn,bcghj,bcjghp->bcghpn", Bc, jnp.exp(tot[..., None] - cs), xs)
    h = linear_scan(jnp.exp(tot)[..., None, None], states, axis=1)
    prev = jnp.pad(h, ((0, 0), (1, 0)) + ((0, 0),) * 4)[:, :nc]  # state entering each chunk
    y = y + jnp.einsum("bcign,bcghpn,bcghi->bcighp", Cc, prev, jnp.exp(cs))

    y = y.reshape(Bn, nc * Q, H, P)[:, :L]
    if D is not None:
        y = y + xf * D.astype(f32)[:, None]
    return y


def chunked_decay(log_a, chunk: int = 64):
    """Causal decay matrices ``exp(sum_{t=j+1..i} log_a[t])`` without an ``L x L`` cumsum.

    For ``i`` in chunk ``I`` and ``j`` in an earlier chunk ``J`` the exponent is
    ``(S_i - S_I0) + (sum of chunks J+1..I-1) + (S_Jend - S_j)`` from chunk-local sums: three
    terms of one sign, each small-magnitude and accurate, so no cancellation and no overflow;
    diagonal blocks use stable segment sums. ``O(L^2)`` elementwise work.

    Args:
      log_a: ``(..., L)`` log decays (finite, <= 0).
      chunk: chunk length.
    Returns:
      ``(..., L, L)`` float32, exact zeros above the diagonal.
    """
    log_a = log_a.astype(f32)
    L = log_a.shape[-1]
    Q = min(chunk, L)
    nc = -(-L // Q)
    pre = log_a.shape[:-1]
    la = jnp.pad(log_a, [(0, 0)] * len(pre) + [(0, nc * Q - L)]).reshape(pre + (nc, Q))
    cs = jnp.cumsum(la, axis=-1)
    tot = cs[..., -1]
    inner = segment_sum(tot)  # (..., nc, nc): chunks J+1..I
    between = jnp.concatenate([jnp.zeros_like(inner[..., :1, :]), inner[..., :-1, :]], axis=-2)
    off = (cs[..., :, :, None, None] + between[..., :, None, :, None]
           + (tot[..., :, None] - cs)[..., None, None, :, :])  # (..., I, i, J, j)
    I = jnp.arange(nc)
    below = (I[:, None] > I[None, :])[:, None, :, None]
    same = (I[:, None] == I[None, :])[:, None, :, None]
    diag = segment_sum(la)  # (..., nc, Q, Q)
    T = jnp.where(below, off, jnp.where(same, diag[..., :, :, None, :], -jnp.inf))
    out = jnp.exp(T).reshape(pre + (nc * Q, nc * Q))
    return out if nc * Q == L else out[..., :L, :L]


def gated_norm_scale(g, group_size: int, eps: float):
    """``1 / rms`` of ``g (B, L, C)`` over groups of ``group_size`` channels, per channel: ``(B, L, C)``."""
    gg = _heads(g.astype(f32), g.shape[-1] // group_size)
    inv = jax.lax.rsqrt(jnp.mean(gg * gg, axis=-1, keepdims=True) + eps)
    return jnp.broadcast_to(inv, gg.shape).reshape(g.shape)


def gated_rms_norm(y, z, w, group_size: int, eps: float):
    """HF ``MambaRMSNormGated``: ``w * g / rms_group(g)``, ``g = y * SiLU(z)`` in float32. ``(B, L, C)``."""
    g = y.astype(f32) * jax.nn.silu(z.astype(f32))
    return w * (g * gated_norm_scale(g, group_size, eps)).astype(y.dtype)


def _ssm(q: dict, cfg: Config, v, D=None):
    """``alpha_h v_h`` for ``v (B, L, C)``: ``(B, L, C)`` float32."""
    H = cfg.num_heads
    y = ssd(_heads(v, H), q["dt"], q["A"], q["Bm"], q["Cm"], cfg.chunk_size, D)
    return y.reshape(v.shape)


def mixer_inner(p: dict, h, cfg: Config):
    """Token-mixing output (gated-normed SSD, before ``out_proj``) and the MLP part.

    Returns ``(y (B, L, C) float32, q)`` with ``q`` the ``mixer_parts``.
    """
    q = mixer_parts(p, h, cfg)
    y = _ssm(q, cfg, q["u"], p["D"])
    y = gated_rms_norm(y, q["z"], p["norm.weight"], cfg.d_ssm // cfg.n_groups, cfg.layer_norm_epsilon)
    return y.astype(f32), q


def mixer_forward(p: dict, h, cfg: Config, tap=None):
    """HF ``Mamba2Mixer.forward`` (no cache): ``(B, L, d_model) -> (B, L, d_model)``.

    ``tap``: optional ``(B, C, L)`` float32 added to the normed SSM output (the operator's
    ``output`` layout) before ``out_proj``; its gradient is the gradient w.r.t. ``output``.
    """
    y, q = mixer_inner(p, h, cfg)
    if tap is not None:
        y = y + jnp.swapaxes(tap, 1, 2)
    if cfg.d_mlp:
        mlp = jax.nn.silu(q["z0"].astype(f32)) * q["x0"].astype(f32)
        y = jnp.concatenate([mlp, y], axis=-1)
    return _linear(y.astype(h.dtype), p["out_proj.weight"], p.get("out_proj.bias"))


# ----------------------------------------------------------------------------- operator

@_dataclass_pytree(static=("heads_per_group",))
class Mamba2Core:
    """``H_c = (diag(left_c) alpha_h diag(right_c)) M_c`` for channel ``c`` of head ``h = head[c]``,
    ``alpha_h = K_h diag(dt_h) + D_h I``, ``K_h[i, j] = (q_g[i] . k_g[j]) exp(sum_{t=j+1..i} log_a_h[t])``
    with ``g = h // heads_per_group``.

    ``q k^T`` is computed per group of B/C (once per ``dense`` call), never per channel.
    Shapes: ``log_a, dt (B, H, L)``, ``D (H,)``, ``q, k (B, G, L, N)``, ``head (C,)`` int,
    ``left, right (B, C, L)`` or None (ones), ``conv_w (C, K)`` or None (no conv).
    """

    log_a: Any
    dt: Any
    D: Any
    q: Any
    k: Any
    head: Any
    left: Any = None
    right: Any = None
    conv_w: Any = None
    heads_per_group: int = 1

    @property
    def num_channels(self) -> int:
        return self.head.shape[0]

    @property
    def num_heads(self) -> int:
        return self.log_a.shape[1]

    def _qk(self, groups):
        """``(B, len(groups), L, L)`` of ``q_g k_g^T``, computed for the fewest groups."""
        G = self.q.shape[1]
        n = groups.shape[0]
        if G == 1:
            qk = jnp.einsum("bin,bjn->bij", self.q[:, 0], self.k[:, 0])[:, None]
            return jnp.broadcast_to(qk, (qk.shape[0], n) + qk.shape[2:])
        if n >= G:
            qk = jnp.einsum("bgin,bgjn->bgij", self.q, self.k)
            return jnp.take(qk, groups, axis=1)
        return jnp.einsum("bgin,bgjn->bgij", jnp.take(self.q, groups, 1), jnp.take(self.k, groups, 1))

    def alpha(self, heads):
        """``(B, len(heads), L, L)`` float32 matrices ``alpha_h`` (dt and D folded in)."""
        K = chunked_decay(jnp.take(self.log_a, heads, axis=1))
        K = K * self._qk(heads // self.heads_per_group) * jnp.take(self.dt, heads, axis=1)[..., None, :]
        L = K.shape[-1]
        return K + self.D[heads][:, None, None] * jnp.eye(L, dtype=f32)

    def _alpha_each(self, heads):
        """``alpha`` of each head in ``heads (k,)``, one head per loop step: ``(B, k, L, L)``.

        The loop materialises the k matrices; a plain ``take(alpha(heads), ...)`` lets XLA
        fuse the elementwise ``alpha`` into the gather and recompute it for every channel.
        Jitted at module level, so eager calls reuse one compilation per shape.
        """
        return _alpha_each(self, heads)

    def block_alpha(self, idx):
        """``alpha_{head[c]}`` for the channels ``c`` of ``idx``: ``(B, len(idx), L, L)``,
        computed once per distinct head and gathered (the ``P`` channels of a head share it).

        Concrete ``idx``: the distinct heads are found exactly (``np.unique``). Traced ``idx``
        (inside ``jit``/``scan``, e.g. ``reduce``'s contiguous channel blocks): ``n`` channels
        spanning a contiguous range touch at most ``k = (n - 2) // P + 2`` heads, so the
        distinct heads are found with a static-size ``jnp.unique`` of size ``k``; if a block
        touches more (an arbitrary, scattered ``idx``), a ``lax.cond`` falls back to one
        ``alpha`` per channel. Same numbers either way.
        """
        heads = self.head[idx]
        n, H = heads.shape[0], self.num_heads
        if not isinstance(heads, jax.core.Tracer):
            uniq, inv = np.unique(np.asarray(heads), return_inverse=True)
            if uniq.shape[0] == n:
                return self.alpha(heads)
            return jnp.take(self._alpha_each(jnp.asarray(uniq)), jnp.asarray(inv.reshape(-1)), axis=1)
        P = max(1, self.num_channels // H)
        k = min(n, H, (n - 2) // P + 2)
        if k >= n:
            return self.alpha(heads)
        # Padding with the largest head keeps ``uniq`` sorted for ``searchsorted``.
        uniq = jnp.unique(heads, size=k, fill_value=jnp.max(heads))
        inv = jnp.minimum(jnp.searchsorted(uniq, heads, method="compare_all"), k - 1)
        gathered = lambda: jnp.take(self._alpha_each(uniq), inv, axis=1)
        if k >= H:  # every head fits: always exact
            return gathered()
        return jax.lax.cond(jnp.all(uniq[inv] == heads), gathered, lambda: self.alpha(heads))

    def dense(self, idx):
        H = self.block_alpha(idx)
        if self.left is not None:
            H = jnp.take(self.left, idx, axis=1)[..., :, None] * H
        if self.right is not None:
            H = H * jnp.take(self.right, idx, axis=1)[..., None, :]
        return H if self.conv_w is None else conv_right(H, jnp.take(self.conv_w, idx, axis=0))

    def head_mean(self, h):
        """Mean of ``H_c`` over the channels ``c`` of head ``h`` (an int or a traced scalar)
        without forming any ``H_c``: ``(B, L, L)``.

        ``(1/P) sum_c (diag(l_c) alpha diag(r_c) M_c)[i, j]
        = sum_s alpha[i, j+s] W_s[i, j+s]``, ``W_s = (1/P) sum_c l_c[i] r_c[j'] w_c[K-1-s]``:
        one rank-``P`` matmul per conv tap instead of ``P`` dense matrices.
        """
        P = self.num_channels // self.num_heads
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, h * P, P, axis=1)
        alpha = self.alpha(jnp.reshape(h, (1,)))[:, 0]
        Bn, L = alpha.shape[0], alpha.shape[-1]
        left = jnp.ones((Bn, P, L), f32) if self.left is None else sl(self.left)
        right = jnp.ones((Bn, P, L), f32) if self.right is None else sl(self.right)
        w = (jnp.ones((P, 1), f32) if self.conv_w is None
             else jax.lax.dynamic_slice_in_dim(self.conv_w, h * P, P, axis=0))
        Kc = w.shape[1]
        out = jnp.zeros_like(alpha)
        for s in range(Kc):
            W = jnp.einsum("bpi,bpj,p->bij", left, right, w[:, Kc - 1 - s]) / P
            X = jnp.pad(alpha * W, ((0, 0), (0, 0), (0, s)))[..., s:]
            out = out + X
        return out


@jax.jit
def _alpha_each(core: Mamba2Core, heads):
    return jnp.moveaxis(jax.lax.map(lambda h: core.alpha(h[None])[:, 0], heads), 0, 1)


@_dataclass_pytree
class Mamba2Operator(ImplicitOperator):
    """``ImplicitOperator`` with per-head matrices (channels ``h*P .. h*P+P-1`` form head ``h``)."""

    def head_matrices(self, how: str = "alpha", heads=None):
        """Per-head ``(B, H', L, L)`` float32 matrices, computed once per head.

        ``how="alpha"``: ``alpha_h = (C B^T) * exp(A_h T_h) diag(Delta_h) + D_h I`` (the SSD
        "effective attention" of head h; for ``"s6_only"`` without D).
        ``how="mean"``: the mean of ``H_c`` over the head's channels, everything folded in
        (norm, gate, activation, conv), equal to ``materialize()`` averaged per head.
        ``heads``: None (all), an int or a list of head indices.
        """
        if how not in HEAD_MATRICES:
            raise ValueError(f"how must be one of {HEAD_MATRICES}, got {how!r}")
        core = self.core
        H = core.num_heads
        if heads is None:
            hs = jnp.arange(H)
        else:
            hl = [heads] if isinstance(heads, (int, np.integer)) else list(heads)
            if not hl or any(not isinstance(h, (int, np.integer)) or not -H <= h < H for h in hl):
                raise ValueError(f"heads must be ints in [-{H}, {H}), got {heads!r}")
            hs = jnp.asarray([int(h) % H for h in hl])
        if how == "alpha":
            return core.alpha(hs)
        return jnp.moveaxis(jax.lax.map(core.head_mean, hs), 0, 1)


def mixer_operator(p: dict, h, cfg: Config, variant: str = "full") -> Mamba2Operator:
    """The mixer's implicit operator for input ``h (B, L, d_model)``; channels = SSM width ``C``.

    With ``g = w / rms`` (the gated norm's per-token, per-group scale times its weight),
    ``s = SiLU(z)``, ``a = sigmoid(xpre)``, ``alpha_h`` the SSD matrix with D:

    * ``"full"``: ``diag(g s) alpha diag(a) M`` on ``x`` (pre-conv), offset
      ``g s alpha (a b)``; exact.
    * ``"s6_only"``: ``alpha_h`` without D (``(C B^T) exp(A T) diag(Delta)``) on ``u = SiLU(xpre)``.
    * ``"no_conv"``: ``diag(g s) alpha diag(a)`` on ``xpre`` (the conv output with bias).
    * ``"no_gate"``: ``diag(g) alpha diag(a) M`` on ``x``, offset ``g alpha (a b)``.
    * ``"no_norm"``: ``diag(s) alpha diag(a) M`` on ``x``, offset ``s alpha (a b)``.
    * ``"no_act"``: ``diag(g s) alpha M`` on ``x``, offset ``g s alpha b``.

    ``output`` is always the block's own (normed) output, so ``"full"`` and ``"no_conv"``
    reproduce it; the others are the paper's ablations and do not.
    """
    if variant not in VARIANTS:
        raise ValueError(f"Mamba-2 variant must be one of {VARIANTS}, got {variant!r}")
    q = mixer_parts(p, h, cfg)
    T = lambda a: jnp.swapaxes(a, 1, 2).astype(f32)  # (B, L, C) -> (B, C, L)
    C, P, H = cfg.d_ssm, cfg.head_dim, cfg.num_heads
    D = p["D"].astype(f32)
    w = p["norm.weight"].astype(f32)
    y = _ssm(q, cfg, q["u"], D)
    gate = jax.nn.silu(q["z"].astype(f32))
    gs = y * gate
    norm = w * gated_norm_scale(gs, C // cfg.n_groups, cfg.layer_norm_epsilon)
    output = gs * norm
    sig = jax.nn.sigmoid(q["xpre"].astype(f32))
    conv_w = p["conv1d.weight"][:C, 0, :].astype(f32)
    bias = p.get("conv1d.bias")
    bias = None if bias is None else bias[:C].astype(f32)

    left, right, cw, values = norm * gate, sig, conv_w, q["x"]
    if variant == "s6_only":
        left, right, cw, values, D = None, None, None, q["u"], jnp.zeros_like(D)
    elif variant == "no_conv":
        cw, values = None, q["xpre"]
    elif variant == "no_gate":
        left = norm
    elif variant == "no_norm":
        left = gate
    elif variant == "no_act":
        right = None
    offset = None
    if bias is not None and cw is not None:
        src = bias if right is None else right * bias
        offset = left * _ssm(q, cfg, jnp.broadcast_to(src, q["x"].shape), D)
    core = Mamba2Core(
        log_a=T(q["dt"] * q["A"]), dt=T(q["dt"]), D=D,
        q=jnp.moveaxis(q["Cm"], 2, 1), k=jnp.moveaxis(q["Bm"], 2, 1),
        head=jnp.arange(C, dtype=jnp.int32) // P,
        left=None if left is None else T(left), right=None if right is None else T(right),
        conv_w=cw, heads_per_group=H // cfg.n_groups)
    values = T(values)
    offset = jnp.zeros_like(values) if offset is None else T(offset)
    return Mamba2Operator(values=values, offset=offset, output=T(output), core=core)


def head_matrices(op: Mamba2Operator, how: str = "alpha", heads=None):
    """Function form of ``Mamba2Operator.head_matrices``: ``(B, H', L, L)``."""
    return op.head_matrices(how, heads)


def block_forward(layer: dict, h, cfg: Config, tap=None):
    """HF ``Mamba2Block.forward``: ``h + mixer(rms_norm(h))`` (residual in float32 when
    ``residual_in_fp32``).

    Args:
      layer: ``{"norm": (d_model,), "mixer": {...}}``; h: ``(B, L, d_model)`` residual stream;
      tap: optional ``(B, C, L)`` added to the mixer's operator output (see ``mixer_forward``).
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the block output and the mixer input.
    """
    hn = rms_norm(h.astype(layer["norm"].dtype), layer["norm"], cfg.layer_norm_epsilon)
    residual = h.astype(f32) if cfg.residual_in_fp32 else h
    return residual + mixer_forward(layer["mixer"], hn, cfg, tap), hn


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[int, ...] = (), taps=None):
    """Full LM: ``ids (B, L) -> logits (B, L, vocab)`` float32.

    Also returns the mixer inputs of the layers in ``capture`` (a list of
    ``(B, L, d_model)`` arrays, in order). ``taps``: optional ``{layer: (B, C, L)}``
    added to those layers' operator outputs (zeros give the same logits).
    """
    taps = taps or {}
    h = params["embeddings"][ids]
    captured = []
    for i, layer in enumerate(params["layers"]):
        h, hn = block_forward(layer, h, cfg, taps.get(i))
        if i in capture:
            captured.append(hn)
    h = rms_norm(h, params["norm_f"], cfg.layer_norm_epsilon)
    head = params["embeddings"] if params.get("lm_head") is None else params["lm_head"]
    logits = (h.astype(head.dtype) @ head.T).astype(f32)
    return logits, captured


_lm_forward = jax.jit(lm_forward, static_argnames=("cfg", "capture"))
_mixer_operator = jax.jit(mixer_operator, static_argnames=("cfg", "variant"))
_mixer_forward = jax.jit(mixer_forward, static_argnames=("cfg",))
_block_forward = jax.jit(block_forward, static_argnames=("cfg",))


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM`` (HF-like initialisation scales).

    Compiled as one program (eager random ops would compile one by one)."""
    return _init_params(cfg, key, jnp.dtype(dtype))


def _init_params_impl(cfg: Config, key, dtype) -> dict:
    D, H, K = cfg.hidden_size, cfg.num_heads, cfg.conv_kernel
    keys = iter(jax.random.split(key, 10 * cfg.num_hidden_layers + 4))
    nrm = lambda shape, s: (s * jax.random.normal(next(keys), shape)).astype(dtype)
    layers = []
    for _ in range(cfg.num_hidden_layers):
        dt = jnp.exp(jax.random.uniform(next(keys), (H,), minval=math.log(1e-3), maxval=math.log(0.1)))
        m = {
            "in_proj.weight": nrm((cfg.proj_size, D), D ** -0.5),
            "conv1d.weight": nrm((cfg.conv_dim, 1, K), K ** -0.5),
            "dt_bias": (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype),
            "A_log": jnp.log(jax.random.uniform(next(keys), (H,), minval=1.0, maxval=16.0)).astype(dtype),
            "D": (1.0 + 0.1 * jax.random.normal(next(keys), (H,))).astype(dtype),
            "norm.weight": (1.0 + 0.1 * jax.random.normal(next(keys), (cfg.d_ssm,))).astype(dtype),
            "out_proj.weight": nrm((D, cfg.intermediate_size), cfg.intermediate_size ** -0.5),
        }
        if cfg.use_conv_bias:
            m["conv1d.bias"] = nrm((cfg.conv_dim,), 0.1)
        if cfg.use_bias:
            m["in_proj.bias"] = nrm((cfg.proj_size,), 0.02)
            m["out_proj.bias"] = nrm((D,), 0.02)
        layers.append({"norm": jnp.ones((D,), dtype), "mixer": m})
    params = {"embeddings": nrm((cfg.vocab_size, D), 0.1), "layers": layers,
              "norm_f": jnp.ones((D,), dtype), "lm_head": None}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = nrm((cfg.vocab_size, D), D ** -0.5)
    return params


_init_params = jax.jit(_init_params_impl, static_argnums=(0, 2))


# ----------------------------------------------------------------------------- modules

class Mamba2Mixer(Weights):
    """NNX mixer: ``__call__(h)`` is HF ``Mamba2Mixer.forward``; ``as_operator(x)`` its operator."""

    def __init__(self, cfg: Config, tensors: dict):
        super().__init__(tensors)
        self.cfg = cfg

    def __call__(self, h):
        """``(B, L, d_model) -> (B, L, d_model)``."""
        h = check_block_input(h, self.cfg.hidden_size, "mixer input")
        return _mixer_forward(self.arrays(), h, cfg=self.cfg)

    def as_operator(self, x, variant: str = "full") -> Mamba2Operator:
        """Implicit operator for mixer input ``x (B, L, d_model)``; channels = ``num_heads * head_dim``."""
        x = check_block_input(x, self.cfg.hidden_size, "mixer input")
        if variant not in VARIANTS:
            raise ValueError(f"Mamba-2 variant must be one of {VARIANTS}, got {variant!r}")
        return _mixer_operator(self.arrays(), x, cfg=self.cfg, variant=variant)


class Mamba2Block(nnx.Module):
    """Residual block: ``h + mixer(rms_norm(h))``."""

    def __init__(self, cfg: Config, layer: dict):
        self.cfg = cfg
        self.norm = nnx.Param(jnp.asarray(layer["norm"]))
        self.mixer = Mamba2Mixer(cfg, layer["mixer"])

    def params(self) -> dict:
        return {"norm": self.norm[...], "mixer": self.mixer.arrays()}

    def __call__(self, h, tap=None):
        """One residual block, as in ``lm_forward`` (the same pure ``block_forward``).

        Args:
          h: ``(B, L, d_model)`` floating residual stream entering the block.
          tap: optional ``(B, C, L)`` (``C = num_heads * head_dim``) added to the mixer's
            operator output.
        Returns:
          ``(B, L, d_model)`` residual stream leaving the block (float32 when
          ``residual_in_fp32``).
        """
        h = check_block_input(h, self.cfg.hidden_size, "block input")
        if tap is not None:
            B, L, _ = h.shape
            tap = check_tap(tap, (B, self.cfg.d_ssm, L))
        return _block_forward(self.params(), h, cfg=self.cfg, tap=tap)[0]


class LM(nnx.Module):
    """``Mamba2ForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``weights_convert.mamba2.to_params`` or ``init_params``."""

    family = "mamba2"
    mixer_name = "mixer"

    def __init__(self, cfg: Config, params: dict):
        self.config = cfg
        self.embeddings = nnx.Param(jnp.asarray(params["embeddings"]))
        self.layers = nnx.List([Mamba2Block(cfg, l) for l in params["layers"]])
        self.norm_f = nnx.Param(jnp.asarray(params["norm_f"]))
        head = params.get("lm_head")
        self.lm_head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        """The parameter tree the pure functions take."""
        return {"embeddings": self.embeddings[...], "layers": [l.params() for l in self.layers],
                "norm_f": self.norm_f[...], "lm_head": None if self.lm_head is None else self.lm_head[...]}

    @property
    def num_params(self) -> int:
        return count_params(self.params())

    def __call__(self, input_ids):
        """``(B, L)`` int token ids -> ``(B, L, vocab)`` float32 logits."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        return _lm_forward(self.params(), ids, cfg=self.config)[0]

    def tapped_logits(self, input_ids, taps: dict):
        """Logits with ``taps = {layer: (B, C, L)}`` added to those layers' operator
        outputs; differentiable in ``taps`` (for gradient-weighted attribution).
        Each tap must have exactly its layer's operator-output shape (ValueError otherwise)."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        B, L = ids.shape
        taps = check_taps(taps, lambda i: (B, self.config.d_ssm, L), len(self.layers))
        return _lm_forward(self.params(), ids, cfg=self.config, taps=taps)[0]

    def mixer_inputs(self, input_ids, layers=None) -> dict[int, jax.Array]:
        """``{layer: (B, L, d_model)}`` inputs of the selected layers' mixers."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        sel = check_layers(layers, len(self.layers))
        _, cap = _lm_forward(self.params(), ids, cfg=self.config, capture=tuple(sorted(set(sel))))
        return dict(zip(sorted(set(sel)), cap))

    def operators(self, input_ids, layers=None, variant: str = "full") -> list[Mamba2Operator]:
        """One operator per selected layer (all by default), in the order asked."""
        sel = check_layers(layers, len(self.layers))
        xs = self.mixer_inputs(input_ids, sel)
        return [self.layers[i].mixer.as_operator(xs[i], variant) for i in sel]

    def info(self) -> dict:
        c = self.config
        return {"family": "mamba2", "layers": c.num_hidden_layers, "d_model": c.hidden_size,
                "d_inner": c.intermediate_size, "num_heads": c.num_heads, "head_dim": c.head_dim,
                "n_groups": c.n_groups, "state_size": c.state_size, "d_mlp": c.d_mlp,
                "conv_kernel": c.conv_kernel, "chunk_size": c.chunk_size, "vocab_size": c.vocab_size,
                "parameters": self.num_params, "dtype": str(self.embeddings[...].dtype)}


__all__ = ["Config", "LM", "Mamba2Mixer", "Mamba2Block", "Mamba2Core", "Mamba2Operator", "VARIANTS",
           "HEAD_MATRICES", "init_params", "lm_forward", "mixer_forward", "mixer_inner", "mixer_operator",
           "mixer_parts", "ssd", "chunked_decay", "gated_rms_norm", "gated_norm_scale", "head_matrices",
           "block_forward"]
