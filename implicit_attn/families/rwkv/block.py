"""RWKV-4 (Hugging Face ``RwkvForCausalLM``): the block math as pure functions and the exact
implicit operator of each time-mix block.

Time mix (per channel c of the attention width A), on ``x = ln1(h)``:
  token shift ``x'_t = x_{t-1}`` (zero at t = 0); ``k, v, r`` are the ``key``, ``value``,
  ``receptance`` projections of ``x * mu + x' * (1 - mu)`` (one ``time_mix_*`` each);
  ``w = -exp(time_decay)``, ``u = time_first``;
  ``wkv_i = sum_{j<=i} e^{l[i,j]} v_j / sum_{j<=i} e^{l[i,j]}`` with
  ``l[i,j] = (i-1-j) w + k_j`` (j < i), ``l[i,i] = u + k_i``; output ``output(sigmoid(r) * wkv)``.
Operator: ``H_c = diag(sigmoid(r_c)) softmax_rows(l_c)`` acting on ``v`` (offset 0).
The token shift and the projections act *before* H: H maps the value vectors.

Eval-mode rescaling (HF ``_rescale_layers``): with ``rescale_every = R > 0`` block ``i``
uses ``attention.output`` and ``feed_forward.value`` divided by ``2 ** (i // R)`` and the
hidden state is halved after every R-th block. Checkpoints hold the unscaled weights;
the division happens here at run time (exact: powers of two).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...kernels import cpu as cpu_kernels
from ...nn import run_scan
from ...nn.hooks import ForwardHooks, apply_out_hook, layer_tap, no_hook, out_hook
from ...ops import embed, from_first, full_precision, mark_nan, wkv_chunked, zero_nan
from ...operator import ImplicitOperator, RwkvCore
from .config import Config

VARIANTS = ("full", "no_gate")
f32 = jnp.float32
FINAL_LN_EPS = 1e-5  # HF builds ln_out with nn.LayerNorm's default eps, not layer_norm_epsilon


def layer_norm(x, w, b, eps: float):
    """``nn.LayerNorm`` over the last axis: float32 statistics and affine, one rounding to the
    input dtype at the end (torch's half-precision kernel). ``x (..., D)``, ``w, b (D,)`` -> ``(..., D)``."""
    xf = x.astype(f32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(f32) + b.astype(f32)).astype(x.dtype)


def token_shift(x):
    """``(B, L, D) -> (B, L, D)``: ``x_{t-1}``, zeros at t = 0 (HF ``ZeroPad2d((0,0,1,-1))``)."""
    return jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def mix(x, prev, mu):
    """Token-shift interpolation: ``x * mu + prev * (1 - mu)`` with ``mu (1, 1, D)``."""
    return x * mu + prev * (1 - mu)


def time_mix_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of the time-mix block for input ``h (B, L, D)`` (after ``ln1``).

    Returns ``k, v, r`` (``(B, L, A)``, checkpoint dtype; ``r`` before the sigmoid) and
    ``w, u`` (``(A,)`` float32; ``w = -exp(time_decay)``).
    """
    prev = token_shift(h)
    k = mix(h, prev, p["time_mix_key"]) @ p["key.weight"].T
    v = mix(h, prev, p["time_mix_value"]) @ p["value.weight"].T
    r = mix(h, prev, p["time_mix_receptance"]) @ p["receptance.weight"].T
    w = -jnp.exp(p["time_decay"].astype(f32))
    return dict(k=k, v=v, r=r, w=w, u=p["time_first"].astype(f32))


def wkv(w, u, k, v, chunk: int = 32):
    """The WKV recurrence ``wkv_i = sum_j e^{l[i,j]} v_j / sum_j e^{l[i,j]}`` (``ops.wkv_chunked``),
    NaN kept causal (``ops.nan``). On CPU the fused kernel (``kernels.cpu.wkv_scan``, HF's
    running-max recurrence) where it pays off (``kernels.cpu.wkv_pays_off``), the chunked form
    elsewhere and in exports for accelerators (``nn.run_scan``).

    Args:
      w: ``(A,)`` log decay (``-exp(time_decay)``); u: ``(A,)`` bonus (``time_first``).
      k, v: ``(B, L, A)`` keys and values.
      chunk: positions per chunk of the chunked form.
    Returns:
      ``(B, L, A)`` float32.
    """
    bad = from_first(jnp.isnan(k) | jnp.isnan(v), axis=1)
    args = (w.astype(f32), u.astype(f32), zero_nan(k).astype(f32), zero_nan(v).astype(f32))
    chunked = functools.partial(wkv_chunked, chunk=chunk)
    out = run_scan("auto", cpu_kernels.wkv_scan if cpu_kernels.wkv_pays_off(k) else chunked, chunked, *args)
    return mark_nan(out, bad)


def time_mix_inner(p: dict, h, cfg: Config):
    """``sigmoid(r) * wkv``: the token-mixing output before ``output``, ``(B, L, A)`` float32."""
    q = time_mix_parts(p, h, cfg)
    return jax.nn.sigmoid(q["r"].astype(f32)) * wkv(q["w"], q["u"], q["k"], q["v"])


def time_mix_forward(p: dict, h, cfg: Config, layer: int = 0, hook=None):
    """HF ``RwkvSelfAttention.forward`` in eval mode (block ``layer``): ``(B, L, D) -> (B, L, D)``.

    ``hook``: optional ``(B, A, L) -> (B, A, L)`` applied to ``sigmoid(r) * wkv`` in the
    operator's ``output`` layout before the ``output`` projection (``mixer.hook_out``).
    """
    y = apply_out_hook(time_mix_inner(p, h, cfg), hook)
    wo = p["output.weight"] / cfg.rescale(layer, h.dtype)
    return y.astype(h.dtype) @ wo.T


def channel_mix_forward(p: dict, h, cfg: Config, layer: int = 0):
    """HF ``RwkvFeedForward.forward`` in eval mode: ``(B, L, D) -> (B, L, D)``:
    ``sigmoid(receptance(xr)) * value(relu(key(xk))^2)`` on token-shifted mixes."""
    prev = token_shift(h)
    k = mix(h, prev, p["time_mix_key"]) @ p["key.weight"].T
    r = mix(h, prev, p["time_mix_receptance"]) @ p["receptance.weight"].T
    k = jnp.square(jax.nn.relu(k))
    val = k @ (p["value.weight"] / cfg.rescale(layer, h.dtype)).T
    return jax.nn.sigmoid(r) * val


def time_mix_operator(p: dict, h, cfg: Config, variant: str = "full") -> ImplicitOperator:
    """The time-mix block's implicit operator for input ``h (B, L, D)`` (after ``ln1``).

    ``"full"``: ``diag(sigmoid r) softmax_rows(l)`` on ``v`` (exact); ``"no_gate"``:
    ``softmax_rows(l)`` on ``v``. ``values = v (B, A, L)``, ``offset = 0``,
    ``output = sigmoid(r) * wkv`` (the block's own, from the scan).
    """
    if variant not in VARIANTS:
        raise ValueError(f"RWKV variant must be one of {VARIANTS}, got {variant!r}")
    q = time_mix_parts(p, h, cfg)
    T = lambda a: jnp.swapaxes(a, 1, 2).astype(f32)  # (B, L, A) -> (B, A, L)
    gate = jax.nn.sigmoid(q["r"].astype(f32))
    output = gate * wkv(q["w"], q["u"], q["k"], q["v"])
    core = RwkvCore(k=T(q["k"]), w=q["w"], u=q["u"], gate=T(gate) if variant == "full" else None)
    values = T(q["v"])
    return ImplicitOperator(values=values, offset=jnp.zeros_like(values), output=T(output), core=core)


# the per-layer parameters the blocks read (``pre_ln`` is applied before the first block)
LAYER_KEYS = ("ln1", "ln2", "attention", "feed_forward")


def rwkv_block(lp: dict, h, cfg: Config, layer=0, hook=None, time_mix=None):
    """HF ``RwkvBlock.forward`` in eval mode: ``(pre_ln on block 0), h + attention(ln1 h),
    h + feed_forward(ln2 h)``, halved after every ``rescale_every``-th block.

    Args:
      lp: ``{"ln1", "ln2", "attention", "feed_forward"}`` and optionally ``"pre_ln"``
        (block 0 only; ``lm_forward`` applies it before the blocks);
      h: ``(B, L, D)`` residual stream; layer: block index (may be traced: it only picks
        the rescaling divisor); hook: optional ``(point, x) -> x`` called at the block's
        hook points (``nn.hooks``; ``mixer.hook_out`` is ``(B, A, L)``);
      time_mix: the time mix's forward ``(p, x, cfg, layer, hook) -> (B, L, D)`` (default
        RWKV-4's ``time_mix_forward``; RWKV-5 passes its own, the rest of the block is shared).
    Returns:
      ``(h_next (B, L, D), x (B, L, D))``: the block output and the time-mix input (``ln1`` output).
    """
    hook = hook or no_hook
    time_mix = time_mix_forward if time_mix is None else time_mix
    eps = cfg.layer_norm_epsilon
    pre = lp.get("pre_ln")
    if pre is not None:
        h = layer_norm(h, pre["weight"], pre["bias"], eps)
    h = hook("hook_resid_pre", h)
    x = hook("mixer.hook_in", layer_norm(h, lp["ln1"]["weight"], lp["ln1"]["bias"], eps))
    h = hook("hook_resid_mid", h + time_mix(lp["attention"], x, cfg, layer, out_hook(hook)))
    hn = layer_norm(h, lp["ln2"]["weight"], lp["ln2"]["bias"], eps)
    h = h + channel_mix_forward(lp["feed_forward"], hn, cfg, layer)
    period = cfg.rescale_period(h.dtype)
    if period > 0:
        h = jnp.where((layer + 1) % period == 0, h / 2, h)
    return hook("hook_resid_post", h), x


def block_forward(lp: dict, h, cfg: Config, layer=0, tap=None, time_mix=None):
    """``rwkv_block`` with an optional ``tap (B, A, L)`` added to the time mix's operator output
    (``time_mix`` as there)."""
    return rwkv_block(lp, h, cfg, layer, layer_tap(tap), time_mix)


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[str, ...] = (), adds=None, sets=None,
               time_mix=None):
    """Full LM in eval mode: ``ids (B, L) -> logits (B, L, vocab)`` float32, and
    ``{name: activation}`` of the hook names in ``capture``. ``adds`` / ``sets``:
    ``{name: array}`` added to / replacing activations (``nn.hooks.ForwardHooks``;
    ``hook_embed`` is the embedding before block 0's ``pre_ln``, ``blocks.0.hook_resid_pre``
    after it). The blocks run one after another (``ForwardHooks.run_layers``).
    ``time_mix``: as in ``rwkv_block`` (default RWKV-4's).
    """
    eps = cfg.layer_norm_epsilon
    layers = params["layers"]
    hooks = ForwardHooks(capture, adds, sets)
    h = hooks("hook_embed", embed(params["embeddings"], ids))
    pre = layers[0]["pre_ln"]
    h = layer_norm(h, pre["weight"], pre["bias"], eps)
    h = hooks.run_layers(lambda h, i, lp, hook: rwkv_block(lp, h, cfg, i, hook, time_mix)[0], h, layers,
                         LAYER_KEYS)
    h = layer_norm(h, params["ln_out"]["weight"], params["ln_out"]["bias"], FINAL_LN_EPS)
    head = params["embeddings"] if params.get("head") is None else params["head"]
    logits = (h.astype(head.dtype) @ head.T).astype(f32)
    return logits, hooks.captured


lm_forward_jit = jax.jit(full_precision(lm_forward), static_argnames=("cfg", "capture"))
time_mix_operator_jit = jax.jit(full_precision(time_mix_operator), static_argnames=("cfg", "variant"))
# The layer index only picks the rescaling divisor: traced, so all blocks share one compile.
time_mix_forward_jit = jax.jit(full_precision(time_mix_forward), static_argnames=("cfg",))
channel_mix_forward_jit = jax.jit(full_precision(channel_mix_forward), static_argnames=("cfg",))
block_forward_jit = jax.jit(full_precision(block_forward), static_argnames=("cfg",))


__all__ = ["VARIANTS", "layer_norm", "token_shift", "mix", "time_mix_parts", "wkv", "time_mix_inner",
           "time_mix_forward", "channel_mix_forward", "time_mix_operator", "LAYER_KEYS", "rwkv_block", "block_forward",
           "lm_forward", "lm_forward_jit", "time_mix_operator_jit", "time_mix_forward_jit",
           "channel_mix_forward_jit", "block_forward_jit"]
