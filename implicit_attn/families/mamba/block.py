"""Mamba (Hugging Face ``MambaForCausalLM``): the block math as pure functions and the
exact implicit operator of each mixer.

Mixer (per channel c, inner width C = expand * d_model):
  ``x, z = in_proj(h)``; ``xc = conv(x)``; ``u = SiLU(xc)``; ``dt, B, C = proj(u)``;
  ``y = S6(u) * SiLU(z)`` with ``S6(u)_i = sum_j alpha[i, j] u_j``, then ``out_proj``.
Falcon-Mamba adds a weightless RMSNorm on ``dt`` (before ``dt_proj``), ``B`` and ``C``
(``Config.bcdt_norm_eps``), Jamba the same norms with weights (``BCDT_NORMS``, present in
the params when ``Config.bcdt_norm_weights``); they only change the data-dependent factors
of the operator.
Operator: ``H_c = diag(SiLU(z_c)) alpha_c diag(sigmoid(xc_c)) M_c`` acting on ``x``,
plus ``offset_c = diag(SiLU(z_c)) alpha_c (sigmoid(xc_c) * b_c)`` from the conv bias.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...kernels import cpu as cpu_kernels
from ...nn import run_scan
from ...nn.hooks import ForwardHooks, between_layers, apply_out_hook, layer_tap, no_hook, out_hook
from ...operator import ImplicitOperator, StateDecayCore
from ...ops import causal_conv, embed, full_precision, linear, linear_scan, selective_scan_sequential
from .config import Config

VARIANTS = ("full", "s6_only", "no_conv", "no_gate", "no_act")
f32 = jnp.float32


# The optional RMSNorm weights on dt, B and C (Jamba), local names in the mixer's params.
BCDT_NORMS = ("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")


def rms_norm(x, w, eps: float, weight_in_float32: bool = False):
    """HF's RMSNorm ``w x / rms(x)`` with float32 statistics: the weight applied in the input
    dtype after the cast back (``MambaRMSNorm`` and most), or, with ``weight_in_float32``, in
    float32 before it (``NemotronHRMSNorm``, ``LaraMiniRMSNorm``, ``OlmoHybridRMSNorm``). The two
    differ by one rounding in half precision. ``x (..., D)``, ``w (D,)`` -> ``(..., D)``."""
    dtype = x.dtype
    xf = x.astype(f32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight_in_float32:
        return (w.astype(f32) * xf).astype(dtype)
    return w * xf.astype(dtype)


def mixer_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of the mixer for input ``h (B, L, d_model)``.

    Returns a dict of ``(B, L, C)`` arrays ``x, z, xc, u, dt`` (dt float32) and
    ``(B, L, N)`` arrays ``Bm, Cm`` (float32), ``A (C, N)`` float32.
    """
    C, N, R = cfg.intermediate_size, cfg.state_size, cfg.time_step_rank
    proj = linear(h, p["in_proj.weight"], p.get("in_proj.bias"))
    x, z = proj[..., :C], proj[..., C:]
    w = p["conv1d.weight"][:, 0, :]
    xc = causal_conv(x, w, p.get("conv1d.bias"))
    u = jax.nn.silu(xc)
    xdbl = u @ p["x_proj.weight"].T
    dt_in, Bm, Cm = xdbl[..., :R], xdbl[..., R:R + N], xdbl[..., R + N:]
    if cfg.bcdt_norm_eps is not None:  # Falcon-Mamba (weightless), Jamba (weighted)
        dt_in, Bm, Cm = (rms_norm(v, p.get(n, jnp.ones((), v.dtype)), cfg.bcdt_norm_eps)
                         for v, n in zip((dt_in, Bm, Cm), BCDT_NORMS))
    dt = jax.nn.softplus(linear(dt_in, p["dt_proj.weight"], p["dt_proj.bias"]).astype(f32))
    A = -jnp.exp(p["A_log"].astype(f32))
    return dict(x=x, z=z, xc=xc, u=u, dt=dt, Bm=Bm.astype(f32), Cm=Cm.astype(f32), A=A)


def selective_scan(u, dt, A, Bm, Cm, D=None, method: str = "auto"):
    """S6: ``y_i = sum_j alpha[i, j] u_j``.

    ``method="parallel"``: ``jax.lax.associative_scan`` over all states
    ``(B, L, C, N)`` (O(log L) depth; for accelerators). ``"sequential"``: one
    ``lax.scan`` whose step forms the decay and input on the fly and keeps only the
    ``(B, C, N)`` state (``ops.selective_scan_sequential``). ``"auto"`` picks by the platform
    lowered for (``nn.run_scan``): on CPU the fused kernel (``kernels.cpu.selective_scan``) where
    it pays off (``kernels.cpu.scan_pays_off``), else the sequential scan. Same numbers (to
    float32 rounding).

    Args:
      u: ``(B, L, C)`` inputs; dt: ``(B, L, C)`` step sizes; A: ``(C, N)``;
      Bm, Cm: ``(B, L, N)``; D: optional ``(C,)`` skip.
    Returns:
      ``(B, L, C)`` float32.
    """
    u = u.astype(f32)

    def parallel(u, dt, A, Bm, Cm):
        a = jnp.exp(dt[..., None] * A)  # (B, L, C, N)
        b = (dt * u)[..., None] * Bm[:, :, None, :]
        return jnp.einsum("blcn,bln->blc", linear_scan(a, b, axis=1), Cm)

    cpu = (cpu_kernels.selective_scan if method == "auto" and cpu_kernels.scan_pays_off(u, A)
           else selective_scan_sequential)
    y = run_scan(method, cpu, parallel, u, dt, A, Bm, Cm)
    if D is not None:
        y = y + u * D.astype(f32)
    return y


def mixer_inner(p: dict, h, cfg: Config):
    """The mixer's token-mixing output before ``out_proj``: ``(B, L, C)`` float32."""
    q = mixer_parts(p, h, cfg)
    y = selective_scan(q["u"], q["dt"], q["A"], q["Bm"], q["Cm"], p["D"])
    return y * jax.nn.silu(q["z"].astype(f32))


def mixer_forward(p: dict, h, cfg: Config, hook=None):
    """HF ``MambaMixer.forward``: ``(B, L, d_model) -> (B, L, d_model)``.

    ``hook``: optional ``(B, C, L) -> (B, C, L)`` applied to the inner output in the
    operator's ``output`` layout before ``out_proj`` (``mixer.hook_out``; see ``nn.hooks``).
    """
    y = apply_out_hook(mixer_inner(p, h, cfg), hook)
    y = y.astype(h.dtype)
    return linear(y, p["out_proj.weight"], p.get("out_proj.bias"))


def mixer_operator(p: dict, h, cfg: Config, variant: str = "full", chunk: int = 16) -> ImplicitOperator:
    """The mixer's implicit operator for input ``h (B, L, d_model)``.

    ``variant``: ``"full"`` (exact: gate, S6 with D, activation, conv and its bias);
    ``"s6_only"``: ``alpha`` without D acting on ``u`` (Ali et al. 2024);
    ``"no_conv"``: ``diag(SiLU z) alpha diag(sigmoid xc)`` acting on the conv output ``xc``;
    ``"no_gate"``: ``alpha diag(sigmoid xc) M`` on ``x``; ``"no_act"``: ``diag(SiLU z) alpha M`` on ``x``.
    Only ``"full"`` reproduces ``output``; ``output`` is always the block's own.
    """
    if variant not in VARIANTS:
        raise ValueError(f"Mamba variant must be one of {VARIANTS}, got {variant!r}")
    q = mixer_parts(p, h, cfg)
    T = lambda a: jnp.swapaxes(a, 1, 2).astype(f32)  # (B, L, C) -> (B, C, L)
    D = p["D"].astype(f32)
    gate = jax.nn.silu(q["z"].astype(f32))
    sig = jax.nn.sigmoid(q["xc"].astype(f32))
    output = selective_scan(q["u"], q["dt"], q["A"], q["Bm"], q["Cm"], D) * gate
    conv_w = p["conv1d.weight"][:, 0, :].astype(f32)
    bias = p.get("conv1d.bias")
    alpha = lambda v, d=D: selective_scan(v, q["dt"], q["A"], q["Bm"], q["Cm"], d)

    left, right, diag, cw = gate, sig, sig * D * gate, conv_w
    values, offset = q["x"], None
    if variant == "full":
        if bias is not None:
            offset = gate * alpha(sig * bias.astype(f32))
    elif variant == "s6_only":
        left, right, diag, cw, values = None, None, None, None, q["u"]
    elif variant == "no_conv":
        cw, values = None, q["xc"]
    elif variant == "no_gate":
        left, diag = None, sig * D
        if bias is not None:
            offset = alpha(sig * bias.astype(f32))
    elif variant == "no_act":
        right, diag = None, D * gate
        if bias is not None:
            offset = gate * alpha(jnp.broadcast_to(bias.astype(f32), q["x"].shape))
    # alpha = K diag(dt) + D I: fold dt into the right-hand diagonal.
    right = q["dt"] if right is None else right * q["dt"]
    if diag is not None:
        diag = jnp.broadcast_to(diag, q["x"].shape)
    core = StateDecayCore(
        q=q["Cm"], k=q["Bm"], A=q["A"], dt=T(q["dt"]), left=None if left is None else T(left),
        right=T(right), diag=None if diag is None else T(diag), conv_w=cw, chunk=chunk)
    values = T(values)
    offset = jnp.zeros_like(values) if offset is None else T(offset)
    return ImplicitOperator(values=values, offset=offset, output=T(output), core=core)


def residual_block(layer: dict, h, cfg, mixer_forward, hook=None):
    """HF ``MambaBlock`` / ``Mamba2Block``: ``h + mixer(rms_norm(h))`` (residual in float32
    when ``cfg.residual_in_fp32``).

    Args:
      layer: ``{"norm": (d_model,), "mixer": {...}}``; h: ``(B, L, d_model)`` residual stream;
      mixer_forward: ``(params, hn, cfg, out_hook) -> (B, L, d_model)``;
      hook: optional ``(point, x) -> x`` called at the layer's hook points (``nn.hooks``).
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the block output and the mixer input.
    """
    hook = hook or no_hook
    h = hook("hook_resid_pre", h)
    residual = h.astype(f32) if cfg.residual_in_fp32 else h
    hn = rms_norm(h.astype(layer["norm"].dtype), layer["norm"], cfg.layer_norm_epsilon)
    hn = hook("mixer.hook_in", hn)
    h = hook("hook_resid_post", residual + mixer_forward(layer["mixer"], hn, cfg, out_hook(hook)))
    return h, hn


def residual_lm(params: dict, ids, cfg, mixer_forward, capture: tuple[str, ...] = (), adds=None, sets=None):
    """A stack of ``residual_block``s between embeddings and a final RMSNorm + head (HF
    ``MambaForCausalLM`` / ``Mamba2ForCausalLM``): ``ids (B, L) -> logits (B, L, vocab)``
    float32, and ``{name: activation}`` of the hook names in ``capture``. ``adds`` /
    ``sets``: ``{name: array}`` added to / replacing activations (``nn.hooks.ForwardHooks``)."""
    hooks = ForwardHooks(capture, adds, sets)
    h = hooks("hook_embed", embed(params["embeddings"], ids))
    for i, layer in enumerate(params["layers"]):
        h = between_layers(residual_block(layer, h, cfg, mixer_forward, hooks.layer(i))[0])
    h = rms_norm(h, params["norm_f"], cfg.layer_norm_epsilon)
    head = params["embeddings"] if params.get("lm_head") is None else params["lm_head"]
    logits = (h.astype(head.dtype) @ head.T).astype(f32)
    return logits, hooks.captured


def block_forward(layer: dict, h, cfg: Config, tap=None):
    """HF ``MambaBlock.forward`` (``residual_block`` with the Mamba mixer); ``tap``: optional
    ``(B, C, L)`` added to the mixer's operator output."""
    return residual_block(layer, h, cfg, mixer_forward, layer_tap(tap))


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None):
    """Full ``MambaForCausalLM``: ``ids (B, L) -> (logits (B, L, vocab) float32, captured)``
    (see ``residual_lm``)."""
    return residual_lm(params, ids, cfg, mixer_forward, capture, adds, sets)


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
block_forward_jit = jax.jit(full_precision(block_forward), static_argnames=("cfg",))
mixer_forward_jit = jax.jit(full_precision(mixer_forward), static_argnames=("cfg",))
mixer_operator_jit = jax.jit(full_precision(mixer_operator), static_argnames=("cfg", "variant", "chunk"))


__all__ = ["BCDT_NORMS", "VARIANTS", "rms_norm", "mixer_parts", "selective_scan", "mixer_inner", "mixer_forward",
           "mixer_operator", "residual_block", "residual_lm", "block_forward", "lm_forward", "lm_forward_jit",
           "block_forward_jit", "mixer_forward_jit", "mixer_operator_jit"]
