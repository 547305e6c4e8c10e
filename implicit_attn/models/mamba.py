"""Mamba (Hugging Face ``MambaForCausalLM``): block math as pure functions, NNX modules
on top, and the exact implicit operator of each mixer.

Mixer (per channel c, inner width C = expand * d_model):
  ``x, z = in_proj(h)``; ``xc = conv(x)``; ``u = SiLU(xc)``; ``dt, B, C = proj(u)``;
  ``y = S6(u) * SiLU(z)`` with ``S6(u)_i = sum_j alpha[i, j] u_j``, then ``out_proj``.
Operator: ``H_c = diag(SiLU(z_c)) alpha_c diag(sigmoid(xc_c)) M_c`` acting on ``x``,
plus ``offset_c = diag(SiLU(z_c)) alpha_c (sigmoid(xc_c) * b_c)`` from the conv bias.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..operator import ImplicitOperator, StateDecayCore
from ..ops import causal_conv, linear_scan
from .base import (SCAN_METHODS, Weights, check_block_input, check_input_ids, check_layers, check_tap,
                   check_taps, count_params, scan_method)

VARIANTS = ("full", "s6_only", "no_conv", "no_gate", "no_act")
f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of HF ``MambaConfig`` the forward pass needs."""

    vocab_size: int
    hidden_size: int
    state_size: int = 16
    num_hidden_layers: int = 1
    conv_kernel: int = 4
    expand: int = 2
    intermediate_size: int = 0
    time_step_rank: int = 0
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", int(self.expand * self.hidden_size))
        if self.time_step_rank in (0, "auto"):
            object.__setattr__(self, "time_step_rank", math.ceil(self.hidden_size / 16))
        if self.hidden_act != "silu":
            raise ValueError(f"Mamba hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in names if k in d and d[k] is not None}
        for req in ("vocab_size", "hidden_size"):
            if req not in kw:
                raise ValueError(f"config.json is missing {req!r}")
        return cls(**kw)

    def to_hf(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(model_type="mamba", architectures=["MambaForCausalLM"])
        return d


# ----------------------------------------------------------------------------- math

def rms_norm(x, w, eps: float):
    """HF ``MambaRMSNorm``: float32 statistics, weight applied in the input dtype. ``(..., D)``."""
    dtype = x.dtype
    xf = x.astype(f32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(dtype)


def _linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def mixer_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of the mixer for input ``h (B, L, d_model)``.

    Returns a dict of ``(B, L, C)`` arrays ``x, z, xc, u, dt`` (dt float32) and
    ``(B, L, N)`` arrays ``Bm, Cm`` (float32), ``A (C, N)`` float32.
    """
    C, N, R = cfg.intermediate_size, cfg.state_size, cfg.time_step_rank
    proj = _linear(h, p["in_proj.weight"], p.get("in_proj.bias"))
    x, z = proj[..., :C], proj[..., C:]
    w = p["conv1d.weight"][:, 0, :]
    xc = causal_conv(x, w, p.get("conv1d.bias"))
    u = jax.nn.silu(xc)
    xdbl = u @ p["x_proj.weight"].T
    dt_in, Bm, Cm = xdbl[..., :R], xdbl[..., R:R + N], xdbl[..., R + N:]
    dt = jax.nn.softplus(_linear(dt_in, p["dt_proj.weight"], p["dt_proj.bias"]).astype(f32))
    A = -jnp.exp(p["A_log"].astype(f32))
    return dict(x=x, z=z, xc=xc, u=u, dt=dt, Bm=Bm.astype(f32), Cm=Cm.astype(f32), A=A)


# Shared with the RG-LRU (base.scan_method): on CPU the fused sequential scan is ~15x
# faster than the associative scan at d_inner 1536, L 512 (it never writes (B, L, C, N)).
_scan_method = scan_method


def selective_scan(u, dt, A, Bm, Cm, D=None, method: str = "auto"):
    """S6: ``y_i = sum_j alpha[i, j] u_j``.

    ``method="parallel"``: ``jax.lax.associative_scan`` over all states
    ``(B, L, C, N)`` (O(log L) depth; for accelerators). ``"sequential"``: one
    ``lax.scan`` whose step forms the decay and input on the fly and keeps only the
    ``(B, C, N)`` state (fastest on CPU). ``"auto"`` picks by backend. Same numbers.

    Args:
      u: ``(B, L, C)`` inputs; dt: ``(B, L, C)`` step sizes; A: ``(C, N)``;
      Bm, Cm: ``(B, L, N)``; D: optional ``(C,)`` skip.
    Returns:
      ``(B, L, C)`` float32.
    """
    u = u.astype(f32)
    if _scan_method(method) == "parallel":
        a = jnp.exp(dt[..., None] * A)  # (B, L, C, N)
        b = (dt * u)[..., None] * Bm[:, :, None, :]
        y = jnp.einsum("blcn,bln->blc", linear_scan(a, b, axis=1), Cm)
    else:
        def step(h, xs):
            d, uu, bb, cc = xs
            h = jnp.exp(d[..., None] * A) * h + (d * uu)[..., None] * bb[:, None, :]
            return h, jnp.einsum("bcn,bn->bc", h, cc)

        xs = tuple(jnp.moveaxis(v, 1, 0) for v in (dt, u, Bm, Cm))
        h0 = jnp.zeros((u.shape[0], u.shape[2], A.shape[1]), f32)
        y = jnp.moveaxis(jax.lax.scan(step, h0, xs)[1], 0, 1)
    if D is not None:
        y = y + u * D.astype(f32)
    return y


def mixer_inner(p: dict, h, cfg: Config):
    """The mixer's token-mixing output before ``out_proj``: ``(B, L, C)`` float32."""
    q = mixer_parts(p, h, cfg)
    y = selective_scan(q["u"], q["dt"], q["A"], q["Bm"], q["Cm"], p["D"])
    return y * jax.nn.silu(q["z"].astype(f32))


def mixer_forward(p: dict, h, cfg: Config, tap=None):
    """HF ``MambaMixer.forward``: ``(B, L, d_model) -> (B, L, d_model)``.

    ``tap``: optional ``(B, C, L)`` float32 added to the inner output (the operator's
    ``output`` layout) before ``out_proj``; its gradient is the gradient w.r.t. ``output``.
    """
    y = mixer_inner(p, h, cfg)
    if tap is not None:
        y = y + jnp.swapaxes(tap, 1, 2)
    y = y.astype(h.dtype)
    return _linear(y, p["out_proj.weight"], p.get("out_proj.bias"))


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


def block_forward(layer: dict, h, cfg: Config, tap=None):
    """HF ``MambaBlock.forward``: ``h + mixer(rms_norm(h))`` (residual in float32 when
    ``residual_in_fp32``).

    Args:
      layer: ``{"norm": (d_model,), "mixer": {...}}``; h: ``(B, L, d_model)`` residual stream;
      tap: optional ``(B, C, L)`` added to the mixer's operator output (see ``mixer_forward``).
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the block output and the mixer input.
    """
    residual = h.astype(f32) if cfg.residual_in_fp32 else h
    hn = rms_norm(h.astype(layer["norm"].dtype), layer["norm"], cfg.layer_norm_epsilon)
    return residual + mixer_forward(layer["mixer"], hn, cfg, tap), hn


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[int, ...] = (), taps=None):
    """Full LM: ``ids (B, L) -> logits (B, L, vocab)`` float32.

    Also returns the mixer inputs of the layers in ``capture`` (a list of
    ``(B, L, d_model)`` arrays, in order). ``taps``: optional ``{layer: (B, C, L)}``
    added to those layers' operator outputs (zeros give the same logits; their
    gradients are d target / d op.output).
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
_block_forward = jax.jit(block_forward, static_argnames=("cfg",))
_mixer_forward = jax.jit(mixer_forward, static_argnames=("cfg",))
_mixer_operator = jax.jit(mixer_operator, static_argnames=("cfg", "variant", "chunk"))


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM`` (HF-like initialisation scales).

    Used by the demo and by tests that need a model without torch.
    """
    D, C, N, R, K = cfg.hidden_size, cfg.intermediate_size, cfg.state_size, cfg.time_step_rank, cfg.conv_kernel
    keys = iter(jax.random.split(key, 8 * cfg.num_hidden_layers + 4))
    nrm = lambda shape, s: (s * jax.random.normal(next(keys), shape)).astype(dtype)
    layers = []
    for _ in range(cfg.num_hidden_layers):
        dt = jnp.exp(jax.random.uniform(next(keys), (C,), minval=math.log(1e-3), maxval=math.log(0.1)))
        m = {
            "in_proj.weight": nrm((2 * C, D), D ** -0.5),
            "conv1d.weight": nrm((C, 1, K), K ** -0.5),
            "x_proj.weight": nrm((R + 2 * N, C), C ** -0.5),
            "dt_proj.weight": nrm((C, R), R ** -0.5),
            "dt_proj.bias": (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype),
            "A_log": jnp.log(jnp.broadcast_to(jnp.arange(1, N + 1, dtype=f32), (C, N))).astype(dtype),
            "D": (1.0 + 0.1 * jax.random.normal(next(keys), (C,))).astype(dtype),
            "out_proj.weight": nrm((D, C), C ** -0.5),
        }
        if cfg.use_conv_bias:
            m["conv1d.bias"] = nrm((C,), 0.1)
        if cfg.use_bias:
            m["in_proj.bias"] = nrm((2 * C,), 0.02)
            m["out_proj.bias"] = nrm((D,), 0.02)
        layers.append({"norm": jnp.ones((D,), dtype), "mixer": m})
    params = {"embeddings": nrm((cfg.vocab_size, D), 0.1), "layers": layers,
              "norm_f": jnp.ones((D,), dtype), "lm_head": None}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = nrm((cfg.vocab_size, D), D ** -0.5)
    return params


# ----------------------------------------------------------------------------- modules

class MambaMixer(Weights):
    """NNX mixer: ``__call__(h)`` is HF ``MambaMixer.forward``; ``as_operator(x)`` its operator."""

    def __init__(self, cfg: Config, tensors: dict):
        super().__init__(tensors)
        self.cfg = cfg

    def __call__(self, h):
        """``(B, L, d_model) -> (B, L, d_model)``."""
        h = check_block_input(h, self.cfg.hidden_size, "mixer input")
        return _mixer_forward(self.arrays(), h, cfg=self.cfg)

    def as_operator(self, x, variant: str = "full") -> ImplicitOperator:
        """Implicit operator for mixer input ``x (B, L, d_model)``; channels = inner width."""
        x = check_block_input(x, self.cfg.hidden_size, "mixer input")
        if variant not in VARIANTS:
            raise ValueError(f"Mamba variant must be one of {VARIANTS}, got {variant!r}")
        return _mixer_operator(self.arrays(), x, cfg=self.cfg, variant=variant)


class MambaBlock(nnx.Module):
    """Residual block: ``h + mixer(rms_norm(h))``."""

    def __init__(self, cfg: Config, layer: dict):
        self.cfg = cfg
        self.norm = nnx.Param(jnp.asarray(layer["norm"]))
        self.mixer = MambaMixer(cfg, layer["mixer"])

    def params(self) -> dict:
        return {"norm": self.norm[...], "mixer": self.mixer.arrays()}

    def __call__(self, h, tap=None):
        """One residual block, as in ``lm_forward`` (the same pure ``block_forward``).

        Args:
          h: ``(B, L, d_model)`` floating residual stream entering the block.
          tap: optional ``(B, C, L)`` added to the mixer's operator output.
        Returns:
          ``(B, L, d_model)`` residual stream leaving the block (float32 when
          ``residual_in_fp32``).
        """
        h = check_block_input(h, self.cfg.hidden_size, "block input")
        if tap is not None:
            B, L, _ = h.shape
            tap = check_tap(tap, (B, self.cfg.intermediate_size, L))
        return _block_forward(self.params(), h, cfg=self.cfg, tap=tap)[0]


class LM(nnx.Module):
    """``MambaForCausalLM`` in JAX. ``LM(config, params)`` with params from
    ``weights_convert.mamba.to_params`` or ``init_params``."""

    family = "mamba"
    mixer_name = "mixer"

    def __init__(self, cfg: Config, params: dict):
        self.config = cfg
        self.embeddings = nnx.Param(jnp.asarray(params["embeddings"]))
        self.layers = nnx.List([MambaBlock(cfg, l) for l in params["layers"]])
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
        taps = check_taps(taps, lambda i: (B, self.config.intermediate_size, L), len(self.layers))
        return _lm_forward(self.params(), ids, cfg=self.config, taps=taps)[0]

    def mixer_inputs(self, input_ids, layers=None) -> dict[int, jax.Array]:
        """``{layer: (B, L, d_model)}`` inputs of the selected layers' mixers."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        sel = check_layers(layers, len(self.layers))
        _, cap = _lm_forward(self.params(), ids, cfg=self.config, capture=tuple(sorted(set(sel))))
        return dict(zip(sorted(set(sel)), cap))

    def operators(self, input_ids, layers=None, variant: str = "full") -> list[ImplicitOperator]:
        """One operator per selected layer (all by default), in the order asked."""
        sel = check_layers(layers, len(self.layers))
        xs = self.mixer_inputs(input_ids, sel)
        return [self.layers[i].mixer.as_operator(xs[i], variant) for i in sel]

    def info(self) -> dict:
        c = self.config
        return {"family": "mamba", "layers": c.num_hidden_layers, "d_model": c.hidden_size,
                "d_inner": c.intermediate_size, "state_size": c.state_size,
                "conv_kernel": c.conv_kernel, "vocab_size": c.vocab_size,
                "parameters": self.num_params, "dtype": str(self.embeddings[...].dtype)}


__all__ = ["Config", "LM", "MambaMixer", "MambaBlock", "VARIANTS", "init_params", "lm_forward",
           "mixer_forward", "mixer_inner", "mixer_operator", "mixer_parts", "selective_scan", "rms_norm",
           "block_forward", "SCAN_METHODS"]
