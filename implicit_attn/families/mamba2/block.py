"""Mamba-2 (Hugging Face ``Mamba2ForCausalLM``): the block math as pure functions and the
exact implicit operator of each mixer (reusing Mamba's norm and residual stack).

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

import functools

import jax
import jax.numpy as jnp

from ...kernels import cpu as cpu_kernels
from ...nn import run_scan
from ...nn.hooks import apply_out_hook, layer_tap
from ...operator import Mamba2Core, Mamba2Operator
from ...ops import causal_conv, from_first, full_precision, linear, mark_nan, ssd_chunked, zero_nan
from ..mamba.block import residual_block, residual_lm, rms_norm
from .config import Config

VARIANTS = ("full", "s6_only", "no_conv", "no_gate", "no_act", "no_norm")
f32 = jnp.float32
# SSD chunk length: the config's, at most CHUNK (a performance knob: HF's chunk_size does not change the
# numbers, and past 64 the in-chunk decay matrices cost more than the chunk states they save)
CHUNK = 64


def split_heads(x, n: int):
    """``(..., n * m) -> (..., n, m)``."""
    return x.reshape(x.shape[:-1] + (n, x.shape[-1] // n))


def proj_scale(cfg: Config):
    """``(proj_size,)`` float32 factors of ``in_proj``'s rows from ``cfg.proj_multipliers``
    ``(z, x, B, C, dt)`` (Falcon-H1's muP vector; the ``[z0, x0]`` MLP part, if any, keeps 1)."""
    m, C, GN, H = cfg.d_mlp, cfg.d_ssm, cfg.n_groups * cfg.state_size, cfg.num_heads
    sizes = (C, C, GN, GN, H)
    return jnp.concatenate([jnp.ones((2 * m,), f32)] + [jnp.full((n,), s, f32)
                                                        for n, s in zip(sizes, cfg.proj_multipliers)])


def mixer_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of the mixer for input ``h (B, L, d_model)``.

    Returns a dict with ``z0, x0 (B, L, d_mlp)``, ``z, x, xpre, u (B, L, C)`` (x = SSM part
    of ``xBC`` before the conv, ``xpre`` after the conv with bias, ``u = SiLU(xpre)``),
    ``Bm, Cm (B, L, n_groups, N)`` float32, ``dt (B, L, H)`` float32, ``A (H,)`` float32.
    """
    m, C, G, N = cfg.d_mlp, cfg.d_ssm, cfg.n_groups, cfg.state_size
    if cfg.in_multiplier != 1.0:
        h = h * jnp.asarray(cfg.in_multiplier, h.dtype)
    proj = linear(h, p["in_proj.weight"], p.get("in_proj.bias"))
    if cfg.proj_multipliers is not None:
        proj = proj * proj_scale(cfg).astype(proj.dtype)
    z0, x0, z = proj[..., :m], proj[..., m:2 * m], proj[..., 2 * m:2 * m + C]
    xbc = proj[..., 2 * m + C:2 * m + C + cfg.conv_dim]
    dt_in = proj[..., 2 * m + C + cfg.conv_dim:]
    xbc_pre = causal_conv(xbc, p["conv1d.weight"][:, 0, :], p.get("conv1d.bias"))
    act = jax.nn.silu(xbc_pre)
    Bm = split_heads(act[..., C:C + G * N], G).astype(f32)
    Cm = split_heads(act[..., C + G * N:], G).astype(f32)
    dt = jax.nn.softplus(dt_in.astype(f32) + p["dt_bias"].astype(f32))
    dt = jnp.clip(dt, *cfg.time_step_limit)
    A = -jnp.exp(p["A_log"].astype(f32))
    return dict(z0=z0, x0=x0, z=z, x=xbc[..., :C], xpre=xbc_pre[..., :C], u=act[..., :C],
                Bm=Bm, Cm=Cm, dt=dt, A=A)


def ssd(x, dt, A, Bm, Cm, chunk: int, D=None):
    """Mamba-2's SSD: ``y_h = alpha_h x_h`` for every head, without forming ``alpha``.

    On CPU the fused kernel's recurrence (``kernels.cpu.ssd_scan``) where it pays off
    (``kernels.cpu.ssd_pays_off``), else the chunked form (``ops.ssd_chunked``: masked matmuls
    inside chunks, a scan over chunks); the platform lowered for picks (``nn.run_scan``), so an
    export for an accelerator gets the chunked form. Same numbers to float32 rounding. Any ``L``.

    Args:
      x: ``(B, L, H, P)`` head inputs; dt: ``(B, L, H)`` float32 step sizes; A: ``(H,)``
        float32 (negative); Bm, Cm: ``(B, L, G, N)`` with ``H % G == 0`` (head h reads
        group ``h // (H / G)``); chunk: chunk length of the chunked form; D: optional ``(H,)`` skip.
    Returns:
      ``(B, L, H, P)`` float32.
    """
    hg = x.shape[2] // Bm.shape[2]
    per_head = lambda g: jnp.repeat(g, hg, axis=2)  # (B, L, G) -> (B, L, H)
    # NaN stays causal (ops.nan): the state input (dt x) B^T makes the state NaN from there on,
    # and so does one that overflows (finite but huge x, dt or B: its largest entry is
    # max|dt x| max|B|); C only its row. From there on x and dt are zeroed for the computation
    # (a masked product would carry the overflow into earlier rows as 0 * inf), B where not finite.
    size = jnp.max(jnp.abs(x.astype(f32) * dt.astype(f32)[..., None]), axis=-1) * per_head(
        jnp.max(jnp.abs(Bm.astype(f32)), axis=-1))
    state_bad = from_first(~jnp.isfinite(size), axis=1)
    bad = (state_bad | per_head(jnp.isnan(Cm).any(-1)))[..., None]
    x, dt = zero_nan(x, state_bad[..., None]), zero_nan(dt, state_bad)
    Bm, Cm = zero_nan(Bm, jnp.isinf(Bm)), zero_nan(Cm)
    chunked = functools.partial(ssd_chunked, chunk=chunk)
    cpu = cpu_kernels.ssd_scan if cpu_kernels.ssd_pays_off(x, Bm) else chunked
    y = run_scan("auto", cpu, chunked, x, dt, A, Bm, Cm)
    if D is not None:
        y = y + x.astype(f32) * D.astype(f32)[:, None]
    return mark_nan(y, bad)


def gated_norm_scale(g, group_size: int, eps: float):
    """``1 / rms`` of ``g (B, L, C)`` over groups of ``group_size`` channels, per channel: ``(B, L, C)``."""
    gg = split_heads(g.astype(f32), g.shape[-1] // group_size)
    inv = jax.lax.rsqrt(jnp.mean(gg * gg, axis=-1, keepdims=True) + eps)
    return jnp.broadcast_to(inv, gg.shape).reshape(g.shape)


def gated_rms_norm(y, z, w, group_size: int, eps: float):
    """HF ``MambaRMSNormGated``: ``w * g / rms_group(g)``, ``g = y * SiLU(z)`` in float32. ``(B, L, C)``."""
    g = y.astype(f32) * jax.nn.silu(z.astype(f32))
    return w * (g * gated_norm_scale(g, group_size, eps)).astype(y.dtype)


def output_norm_scale(y, gate, w, cfg: Config):
    """The output norm as a per-token, per-channel factor ``n`` with ``out = y * gate * n``
    (``cfg.norm_mode``): ``w / rms_group(y gate)``, ``w / rms_group(y)``, or 1 (``"none"``).
    ``y, gate (B, L, C)`` float32, ``w (C,)`` or None -> ``(B, L, C)`` float32."""
    if cfg.norm_mode == "none":
        return jnp.ones_like(y)
    src = y * gate if cfg.norm_mode == "gate_then_norm" else y
    return w * gated_norm_scale(src, cfg.d_ssm // cfg.n_groups, cfg.layer_norm_epsilon)


def output_norm(y, z, w, cfg: Config):
    """The gated output norm of ``cfg.norm_mode`` on the SSD output ``y (B, L, C)``: HF's
    ``MambaRMSNormGated`` (``gated_rms_norm``), Falcon-H1's norm before the gate (float32,
    ``w * y / rms(y) * SiLU(z)``) or the gate alone."""
    if cfg.norm_mode == "gate_then_norm":
        return gated_rms_norm(y, z, w, cfg.d_ssm // cfg.n_groups, cfg.layer_norm_epsilon)
    gate = jax.nn.silu(z.astype(f32))
    yf = y.astype(f32)
    return (yf * output_norm_scale(yf, gate, None if w is None else w.astype(f32), cfg) * gate).astype(y.dtype)


def ssm_apply(q: dict, cfg: Config, v, D=None):
    """``alpha_h v_h`` for ``v (B, L, C)``: ``(B, L, C)`` float32."""
    H = cfg.num_heads
    y = ssd(split_heads(v, H), q["dt"], q["A"], q["Bm"], q["Cm"], min(cfg.chunk_size, CHUNK), D)
    return y.reshape(v.shape)


def mixer_inner(p: dict, h, cfg: Config):
    """Token-mixing output (gated-normed SSD, before ``out_proj``) and the MLP part.

    Returns ``(y (B, L, C) float32, q)`` with ``q`` the ``mixer_parts``.
    """
    q = mixer_parts(p, h, cfg)
    y = ssm_apply(q, cfg, q["u"], p["D"])
    y = output_norm(y, q["z"], p.get("norm.weight"), cfg)
    return y.astype(f32), q


def mixer_forward(p: dict, h, cfg: Config, hook=None):
    """HF ``Mamba2Mixer.forward`` (no cache): ``(B, L, d_model) -> (B, L, d_model)``.

    ``hook``: optional ``(B, C, L) -> (B, C, L)`` applied to the normed SSM output in the
    operator's ``output`` layout before ``out_proj`` (``mixer.hook_out``; see ``nn.hooks``).
    """
    y, q = mixer_inner(p, h, cfg)
    y = apply_out_hook(y, hook)
    if cfg.d_mlp:
        mlp = jax.nn.silu(q["z0"].astype(f32)) * q["x0"].astype(f32)
        y = jnp.concatenate([mlp, y], axis=-1)
    return linear(y.astype(h.dtype), p["out_proj.weight"], p.get("out_proj.bias"))


def mixer_operator(p: dict, h, cfg: Config, variant: str = "full") -> Mamba2Operator:
    """The mixer's implicit operator for input ``h (B, L, d_model)``; channels = SSM width ``C``.

    With ``g = w / rms`` (the output norm's per-token, per-group scale times its weight;
    ``cfg.norm_mode``: the rms of ``y SiLU(z)``, of ``y``, or ``g = 1`` without a norm),
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
    w = p.get("norm.weight")
    y = ssm_apply(q, cfg, q["u"], D)
    gate = jax.nn.silu(q["z"].astype(f32))
    norm = output_norm_scale(y, gate, None if w is None else w.astype(f32), cfg)
    output = y * gate * norm
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
        offset = left * ssm_apply(q, cfg, jnp.broadcast_to(src, q["x"].shape), D)
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
    """HF ``Mamba2Block.forward`` (``residual_block`` with the Mamba-2 mixer); ``tap``:
    optional ``(B, C, L)`` added to the mixer's operator output."""
    return residual_block(layer, h, cfg, mixer_forward, layer_tap(tap))


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """Full ``Mamba2ForCausalLM``: ``ids (B, L) -> (logits (B, L, vocab) float32, captured)``
    (see ``mamba.block.residual_lm``)."""
    return residual_lm(params, ids, cfg, mixer_forward, capture, adds, sets)


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
mixer_operator_jit = jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "variant"))
mixer_forward_jit = jax.jit(full_precision(mixer_forward), static_argnames=("cfg",))
block_forward_jit = jax.jit(full_precision(block_forward), static_argnames=("cfg",))


__all__ = ["VARIANTS", "rms_norm", "split_heads", "proj_scale", "mixer_parts", "ssd", "gated_norm_scale",
           "gated_rms_norm", "output_norm_scale", "output_norm", "ssm_apply", "mixer_inner", "mixer_forward",
           "mixer_operator", "head_matrices", "block_forward", "lm_forward", "lm_forward_jit", "mixer_operator_jit",
           "mixer_forward_jit", "block_forward_jit"]
