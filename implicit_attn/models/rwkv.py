"""RWKV-4 (Hugging Face ``RwkvForCausalLM``): block math as pure functions, NNX modules
on top, and the exact implicit operator of each time-mix block.

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

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..operator import ImplicitOperator, _dataclass_pytree
from .base import Weights, check_block_input, check_input_ids, check_layers, check_tap, check_taps, count_params

VARIANTS = ("full", "no_gate")
f32 = jnp.float32
_FINAL_LN_EPS = 1e-5  # HF builds ln_out with nn.LayerNorm's default eps, not layer_norm_epsilon
_NEG = -1e38  # "empty state" log-max, as the HF CPU path (finite: no inf - inf)


@dataclasses.dataclass(frozen=True)
class Config:
    """The fields of HF ``RwkvConfig`` the forward pass needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int = 1
    attention_hidden_size: int = 0
    intermediate_size: int = 0
    layer_norm_epsilon: float = 1e-5
    rescale_every: int = 6
    tie_word_embeddings: bool = False
    context_length: int = 1024

    def __post_init__(self):
        if not self.attention_hidden_size:
            object.__setattr__(self, "attention_hidden_size", self.hidden_size)
        if not self.intermediate_size:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "attention_hidden_size",
                     "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RWKV config {name} must be a positive integer, got {v!r}")
        if not isinstance(self.rescale_every, int) or isinstance(self.rescale_every, bool):
            raise ValueError(f"RWKV config rescale_every must be an integer, got {self.rescale_every!r}")

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
        d.update(model_type="rwkv", architectures=["RwkvForCausalLM"])
        return d

    def rescale(self, layer):
        """Eval-mode divisor ``2 ** (layer // rescale_every)`` of block ``layer``'s
        ``output`` / ``value`` weights (``layer`` may be a traced int)."""
        return 2 ** (layer // self.rescale_every) if self.rescale_every > 0 else 1


# ----------------------------------------------------------------------------- math

def layer_norm(x, w, b, eps: float):
    """``nn.LayerNorm`` over the last axis: float32 statistics, affine in the input dtype.
    ``(..., D) -> (..., D)``."""
    dtype = x.dtype
    xf = x.astype(f32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = ((xf - mu) * jax.lax.rsqrt(var + eps)).astype(dtype)
    return y * w + b


def token_shift(x):
    """``(B, L, D) -> (B, L, D)``: ``x_{t-1}``, zeros at t = 0 (HF ``ZeroPad2d((0,0,1,-1))``)."""
    return jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def _mix(x, prev, mu):
    """``x * mu + prev * (1 - mu)`` with ``mu (1, 1, D)``."""
    return x * mu + prev * (1 - mu)


def time_mix_parts(p: dict, h, cfg: Config) -> dict:
    """Intermediates of the time-mix block for input ``h (B, L, D)`` (after ``ln1``).

    Returns ``k, v, r`` (``(B, L, A)``, checkpoint dtype; ``r`` before the sigmoid) and
    ``w, u`` (``(A,)`` float32; ``w = -exp(time_decay)``).
    """
    prev = token_shift(h)
    k = _mix(h, prev, p["time_mix_key"]) @ p["key.weight"].T
    v = _mix(h, prev, p["time_mix_value"]) @ p["value.weight"].T
    r = _mix(h, prev, p["time_mix_receptance"]) @ p["receptance.weight"].T
    w = -jnp.exp(p["time_decay"].astype(f32))
    return dict(k=k, v=v, r=r, w=w, u=p["time_first"].astype(f32))


def _past_decay(n, w):
    """``n * w`` for integer steps ``n >= 0``; exactly 0 at ``n = 0`` (even for ``w = -inf``)."""
    return jnp.where(n > 0, n * w, 0.0)


def wkv(w, u, k, v, chunk: int = 32):
    """The WKV recurrence, max-shifted like HF's running-max state, by chunks.

    Within a chunk of ``T`` positions all outputs are computed at once (a masked
    ``T x T`` softmax-weighted sum); a ``lax.scan`` over the ``L / T`` chunks carries the
    state ``S = e^m (num, den)`` of everything before the chunk. No Python loop over
    positions, every exponent ``<= 0``.

    Args:
      w: ``(A,)`` log decay (``-exp(time_decay)``); u: ``(A,)`` bonus (``time_first``).
      k, v: ``(B, L, A)`` keys and values.
      chunk: positions per chunk ``T``.
    Returns:
      ``(B, L, A)`` float32 ``wkv_i = sum_j e^{l[i,j]} v_j / sum_j e^{l[i,j]}``.
    """
    B, L, A = k.shape
    T = max(1, min(chunk, L))
    nc = -(-L // T)
    pad = nc * T - L
    # End padding is never seen by earlier (causal) outputs; it is dropped.
    prep = lambda a: jnp.pad(a.astype(f32), ((0, 0), (0, pad), (0, 0))).reshape(B, nc, T, A).swapaxes(0, 1)
    kc, vc = prep(k), prep(v)  # (nc, B, T, A)
    w, u = w.astype(f32), u.astype(f32)
    s = jnp.arange(T, dtype=f32)
    si, sj = s[:, None], s[None, :]
    # Intra-chunk log weights without k: (s-1-s') w below the diagonal, u on it.
    rel = jnp.where(sj < si, _past_decay(si - 1 - sj, w[:, None, None]), u[:, None, None])  # (A, T, T)
    rel = jnp.where(sj <= si, rel, -jnp.inf)
    into = _past_decay(s[:, None], w)  # (T, A): decay from the chunk start to position s
    out_of = _past_decay(T - 1 - s[:, None], w)  # (T, A): from position s to the chunk end

    def step(state, kv):
        m, n, d = state  # (B, A)
        kk, vv = kv  # (B, T, A)
        l = rel[None] + jnp.swapaxes(kk, 1, 2)[:, :, None, :]  # (B, A, T, T)
        ms = m[:, None, :] + into[None]  # (B, T, A) log weight of the carried state
        top = jnp.maximum(ms, jnp.swapaxes(jnp.max(l, axis=-1), 1, 2))
        e = jnp.exp(l - jnp.swapaxes(top, 1, 2)[..., None])  # (B, A, T, T)
        es = jnp.exp(ms - top)
        num = es * n[:, None, :] + jnp.swapaxes(jnp.einsum("bast,bta->bas", e, vv), 1, 2)
        den = es * d[:, None, :] + jnp.swapaxes(jnp.sum(e, axis=-1), 1, 2)
        # State after the chunk: e^{T w} S + sum_s e^{(T-1-s) w + k_s} (v_s, 1).
        g = out_of[None] + kk  # (B, T, A)
        mc = m + _past_decay(jnp.float32(T), w)
        m2 = jnp.maximum(mc, jnp.max(g, axis=1))
        eg, ec = jnp.exp(g - m2[:, None]), jnp.exp(mc - m2)
        state = (m2, ec * n + jnp.sum(eg * vv, axis=1), ec * d + jnp.sum(eg, axis=1))
        return state, num / den

    init = (jnp.full((B, A), _NEG, f32), jnp.zeros((B, A), f32), jnp.zeros((B, A), f32))
    _, out = jax.lax.scan(step, init, (kc, vc))  # (nc, B, T, A)
    return out.swapaxes(0, 1).reshape(B, nc * T, A)[:, :L]


def time_mix_inner(p: dict, h, cfg: Config):
    """``sigmoid(r) * wkv``: the token-mixing output before ``output``, ``(B, L, A)`` float32."""
    q = time_mix_parts(p, h, cfg)
    return jax.nn.sigmoid(q["r"].astype(f32)) * wkv(q["w"], q["u"], q["k"], q["v"])


def time_mix_forward(p: dict, h, cfg: Config, layer: int = 0, tap=None):
    """HF ``RwkvSelfAttention.forward`` in eval mode (block ``layer``): ``(B, L, D) -> (B, L, D)``.

    ``tap``: optional ``(B, A, L)`` float32 added to ``sigmoid(r) * wkv`` (the operator's
    ``output`` layout) before the ``output`` projection.
    """
    y = time_mix_inner(p, h, cfg)
    if tap is not None:
        y = y + jnp.swapaxes(tap, 1, 2)
    wo = p["output.weight"] / cfg.rescale(layer)
    return y.astype(h.dtype) @ wo.T


def channel_mix_forward(p: dict, h, cfg: Config, layer: int = 0):
    """HF ``RwkvFeedForward.forward`` in eval mode: ``(B, L, D) -> (B, L, D)``:
    ``sigmoid(receptance(xr)) * value(relu(key(xk))^2)`` on token-shifted mixes."""
    prev = token_shift(h)
    k = _mix(h, prev, p["time_mix_key"]) @ p["key.weight"].T
    r = _mix(h, prev, p["time_mix_receptance"]) @ p["receptance.weight"].T
    k = jnp.square(jax.nn.relu(k))
    val = k @ (p["value.weight"] / cfg.rescale(layer)).T
    return jax.nn.sigmoid(r) * val


def softmax_decay_rows(k, w, u):
    """``softmax_rows(l)`` of each channel, masked and max-shifted (no overflow).

    Args:
      k: ``(B, c, L)`` keys; w, u: ``(c,)`` log decay and bonus (float32).
    Returns:
      ``(B, c, L, L)`` float32, ``l[i,j] = (i-1-j) w + k_j`` (j < i), ``u + k_i`` (j = i),
      zero above the diagonal; each row sums to 1.
    """
    L = k.shape[-1]
    i = jnp.arange(L)[:, None]
    j = jnp.arange(L)[None, :]
    past = (i - 1 - j).astype(f32)
    w, u = w[:, None, None], u[:, None, None]
    # where(): dist 0 (j = i-1) must give 0 even for w = -inf.
    rel = jnp.where(j < i, jnp.where(past > 0, past * w, 0.0), u)  # (c, L, L)
    l = jnp.where(j <= i, rel + k.astype(f32)[:, :, None, :], -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(l, axis=-1, keepdims=True))  # finite: diagonal is there
    e = jnp.exp(l - top)
    return e / jnp.sum(e, axis=-1, keepdims=True)


@_dataclass_pytree
class RwkvCore:
    """``H_c = diag(gate_c) softmax_rows(l_c)`` (see ``softmax_decay_rows``).

    Shapes: ``k (B, A, L)``, ``w, u (A,)`` float32, ``gate (B, A, L)`` or None.
    """

    k: Any
    w: Any
    u: Any
    gate: Any = None

    @property
    def num_channels(self) -> int:
        return self.w.shape[0]

    def dense(self, idx):
        """``(B, len(idx), L, L)`` float32 operators of channels ``idx``."""
        P = softmax_decay_rows(jnp.take(self.k, idx, axis=1), self.w[idx], self.u[idx])
        if self.gate is not None:
            P = jnp.take(self.gate, idx, axis=1)[..., :, None] * P
        return P


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


def _stack_layers(layers: list) -> dict:
    """Per-layer parameter dicts (without ``pre_ln``) stacked on a leading layer axis."""
    keep = ("ln1", "ln2", "attention", "feed_forward")
    return jax.tree.map(lambda *a: jnp.stack(a), *[{k: l[k] for k in keep} for l in layers])


def block_forward(lp: dict, h, cfg: Config, layer=0, tap=None):
    """HF ``RwkvBlock.forward`` in eval mode: ``(pre_ln on block 0), h + attention(ln1 h),
    h + feed_forward(ln2 h)``, halved after every ``rescale_every``-th block.

    Args:
      lp: ``{"ln1", "ln2", "attention", "feed_forward"}`` and optionally ``"pre_ln"``
        (block 0 only; ``lm_forward`` applies it before its scan over blocks);
      h: ``(B, L, D)`` residual stream; layer: block index (may be traced: it only picks
        the rescaling divisor); tap: optional ``(B, A, L)`` added to the time mix's
        operator output.
    Returns:
      ``(h_next (B, L, D), x (B, L, D))``: the block output and the time-mix input (``ln1`` output).
    """
    eps = cfg.layer_norm_epsilon
    pre = lp.get("pre_ln")
    if pre is not None:
        h = layer_norm(h, pre["weight"], pre["bias"], eps)
    x = layer_norm(h, lp["ln1"]["weight"], lp["ln1"]["bias"], eps)
    h = h + time_mix_forward(lp["attention"], x, cfg, layer, tap)
    hn = layer_norm(h, lp["ln2"]["weight"], lp["ln2"]["bias"], eps)
    h = h + channel_mix_forward(lp["feed_forward"], hn, cfg, layer)
    if cfg.rescale_every > 0:
        h = jnp.where((layer + 1) % cfg.rescale_every == 0, h / 2, h)
    return h, x


def lm_forward(params: dict, ids, cfg: Config, capture: tuple[int, ...] = (), taps=None):
    """Full LM in eval mode: ``ids (B, L) -> logits (B, L, vocab)`` float32.

    Also returns the time-mix inputs (``ln1`` outputs, ``(B, L, D)``) of the layers in
    ``capture``, in order. ``taps``: optional ``{layer: (B, A, L)}`` added to those
    layers' operator outputs (zeros give the same logits). The blocks run under one
    ``lax.scan`` (compile time independent of depth); block 0 adds ``pre_ln`` first.
    """
    eps = cfg.layer_norm_epsilon
    layers = params["layers"]
    n = len(layers)
    h = params["embeddings"][ids]
    pre = layers[0]["pre_ln"]
    h = layer_norm(h, pre["weight"], pre["bias"], eps)
    tap = None
    if taps:
        B, L = ids.shape
        zero = jnp.zeros((B, cfg.attention_hidden_size, L), f32)
        tap = jnp.stack([jnp.asarray(taps[i], f32) if i in taps else zero for i in range(n)])

    def block(h, xs):
        i, lp, t = xs
        h, x = block_forward(lp, h, cfg, i, t)
        return h, (x if capture else None)

    h, xs = jax.lax.scan(block, h, (jnp.arange(n), _stack_layers(layers), tap))
    captured = [xs[i] for i in capture]
    h = layer_norm(h, params["ln_out"]["weight"], params["ln_out"]["bias"], _FINAL_LN_EPS)
    head = params["embeddings"] if params.get("head") is None else params["head"]
    logits = (h.astype(head.dtype) @ head.T).astype(f32)
    return logits, captured


_lm_forward = jax.jit(lm_forward, static_argnames=("cfg", "capture"))
_time_mix_operator = jax.jit(time_mix_operator, static_argnames=("cfg", "variant"))
# The layer index only picks the rescaling divisor: traced, so all blocks share one compile.
_time_mix_forward = jax.jit(time_mix_forward, static_argnames=("cfg",))
_channel_mix_forward = jax.jit(channel_mix_forward, static_argnames=("cfg",))
_block_forward = jax.jit(block_forward, static_argnames=("cfg",))


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM`` (roughly HF's scales, decays spread
    over fast and slow channels). For demos, benchmarks and torch-free tests.

    ``key``: a JAX PRNG key or an int seed (drawn with numpy: no per-shape compiles).
    """
    if isinstance(key, (int, np.integer)):
        seed = int(key)
    else:
        seed = int(np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                              else key).astype(np.uint64).sum())
    g = np.random.default_rng(seed)
    D, A, F, V = cfg.hidden_size, cfg.attention_hidden_size, cfg.intermediate_size, cfg.vocab_size
    cast = lambda a: jnp.asarray(np.asarray(a, np.float32), dtype)
    nrm = lambda shape, s: cast(s * g.standard_normal(shape))
    uni = lambda shape: cast(g.uniform(size=shape))
    ln = lambda: {"weight": cast(1 + 0.1 * g.standard_normal(D)), "bias": nrm((D,), 0.1)}
    layers = []
    for i in range(cfg.num_hidden_layers):
        att = {"time_decay": cast(np.linspace(-5.0, 3.0, A) + 0.1 * g.standard_normal(A)),
               "time_first": cast(np.log(0.3) + 0.5 * g.standard_normal(A)),
               "time_mix_key": uni((1, 1, D)), "time_mix_value": uni((1, 1, D)),
               "time_mix_receptance": uni((1, 1, D)),
               "key.weight": nrm((A, D), D ** -0.5), "value.weight": nrm((A, D), D ** -0.5),
               "receptance.weight": nrm((A, D), D ** -0.5), "output.weight": nrm((D, A), A ** -0.5)}
        ffn = {"time_mix_key": uni((1, 1, D)), "time_mix_receptance": uni((1, 1, D)),
               "key.weight": nrm((F, D), D ** -0.5), "receptance.weight": nrm((D, D), D ** -0.5),
               "value.weight": nrm((D, F), F ** -0.5)}
        layers.append({"pre_ln": ln() if i == 0 else None, "ln1": ln(), "ln2": ln(),
                       "attention": att, "feed_forward": ffn})
    params = {"embeddings": nrm((V, D), 1.0), "layers": layers, "ln_out": ln(), "head": None}
    if not cfg.tie_word_embeddings:
        params["head"] = nrm((V, D), D ** -0.5)
    return params


# ----------------------------------------------------------------------------- modules

def _check_block_input(x, D: int):
    return check_block_input(x, D, "block input")


class RwkvSelfAttention(Weights):
    """NNX time mix of block ``layer``: ``__call__(x)`` is HF ``RwkvSelfAttention.forward``
    (eval mode); ``as_operator(x)`` its operator. ``x`` is the ``ln1`` output."""

    def __init__(self, cfg: Config, tensors: dict, layer: int = 0):
        super().__init__(tensors)
        self.cfg = cfg
        self.layer = layer

    def __call__(self, x):
        """``(B, L, D) -> (B, L, D)``."""
        x = _check_block_input(x, self.cfg.hidden_size)
        return _time_mix_forward(self.arrays(), x, cfg=self.cfg, layer=jnp.int32(self.layer))

    def as_operator(self, x, variant: str = "full") -> ImplicitOperator:
        """Implicit operator for time-mix input ``x (B, L, D)``; channels = attention width."""
        x = _check_block_input(x, self.cfg.hidden_size)
        if variant not in VARIANTS:
            raise ValueError(f"RWKV variant must be one of {VARIANTS}, got {variant!r}")
        return _time_mix_operator(self.arrays(), x, cfg=self.cfg, variant=variant)


class RwkvFeedForward(Weights):
    """NNX channel mix of block ``layer`` (eval mode)."""

    def __init__(self, cfg: Config, tensors: dict, layer: int = 0):
        super().__init__(tensors)
        self.cfg = cfg
        self.layer = layer

    def __call__(self, x):
        """``(B, L, D) -> (B, L, D)``; ``x`` is the ``ln2`` output."""
        x = _check_block_input(x, self.cfg.hidden_size)
        return _channel_mix_forward(self.arrays(), x, cfg=self.cfg, layer=jnp.int32(self.layer))


class RwkvBlock(nnx.Module):
    """``h (+pre_ln on block 0) -> h + attention(ln1 h) -> h + feed_forward(ln2 h)``
    (halved after every ``rescale_every``-th block in eval mode)."""

    def __init__(self, cfg: Config, layer: dict, index: int):
        self.cfg = cfg
        self.index = index
        self.pre_ln = None if layer.get("pre_ln") is None else Weights(layer["pre_ln"])
        self.ln1 = Weights(layer["ln1"])
        self.ln2 = Weights(layer["ln2"])
        self.attention = RwkvSelfAttention(cfg, layer["attention"], index)
        self.feed_forward = RwkvFeedForward(cfg, layer["feed_forward"], index)

    def params(self) -> dict:
        return {"pre_ln": None if self.pre_ln is None else self.pre_ln.arrays(),
                "ln1": self.ln1.arrays(), "ln2": self.ln2.arrays(),
                "attention": self.attention.arrays(), "feed_forward": self.feed_forward.arrays()}

    def __call__(self, h, tap=None):
        """One block, as in ``lm_forward`` (the same pure ``block_forward``; block 0 applies
        ``pre_ln`` first, as HF does).

        Args:
          h: ``(B, L, D)`` floating residual stream entering the block (for block 0: the
            embeddings).
          tap: optional ``(B, A, L)`` added to the time mix's operator output.
        Returns:
          ``(B, L, D)`` residual stream leaving the block (rescaled as in eval mode).
        """
        h = _check_block_input(h, self.cfg.hidden_size)
        if tap is not None:
            B, L, _ = h.shape
            tap = check_tap(tap, (B, self.cfg.attention_hidden_size, L))
        return _block_forward(self.params(), h, cfg=self.cfg, layer=jnp.int32(self.index), tap=tap)[0]


class LM(nnx.Module):
    """``RwkvForCausalLM`` (eval mode) in JAX. ``LM(config, params)`` with params from
    ``weights_convert.rwkv.to_params`` or ``init_params``."""

    family = "rwkv"
    mixer_name = "attention"

    def __init__(self, cfg: Config, params: dict):
        self.config = cfg
        self.embeddings = nnx.Param(jnp.asarray(params["embeddings"]))
        self.layers = nnx.List([RwkvBlock(cfg, l, i) for i, l in enumerate(params["layers"])])
        self.ln_out = Weights(params["ln_out"])
        head = params.get("head")
        self.head = None if head is None else nnx.Param(jnp.asarray(head))

    def params(self) -> dict:
        """The parameter tree the pure functions take."""
        return {"embeddings": self.embeddings[...], "layers": [l.params() for l in self.layers],
                "ln_out": self.ln_out.arrays(), "head": None if self.head is None else self.head[...]}

    @property
    def num_params(self) -> int:
        return count_params(self.params())

    def __call__(self, input_ids):
        """``(B, L)`` int token ids -> ``(B, L, vocab)`` float32 logits."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        return _lm_forward(self.params(), ids, cfg=self.config)[0]

    def tapped_logits(self, input_ids, taps: dict):
        """Logits with ``taps = {layer: (B, A, L)}`` added to those layers' operator
        outputs; differentiable in ``taps`` (for gradient-weighted attribution).
        Each tap must have exactly its layer's operator-output shape (ValueError otherwise)."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        B, L = ids.shape
        taps = check_taps(taps, lambda i: (B, self.config.attention_hidden_size, L), len(self.layers))
        return _lm_forward(self.params(), ids, cfg=self.config, taps=taps)[0]

    def mixer_inputs(self, input_ids, layers=None) -> dict[int, jax.Array]:
        """``{layer: (B, L, D)}`` inputs of the selected layers' time-mix blocks (``ln1`` outputs)."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        sel = sorted(set(check_layers(layers, len(self.layers))))
        _, cap = _lm_forward(self.params(), ids, cfg=self.config, capture=tuple(sel))
        return dict(zip(sel, cap))

    def operators(self, input_ids, layers=None, variant: str = "full") -> list[ImplicitOperator]:
        """One time-mix operator per selected layer (all by default), in the order asked."""
        if variant not in VARIANTS:
            raise ValueError(f"RWKV variant must be one of {VARIANTS}, got {variant!r}")
        sel = check_layers(layers, len(self.layers))
        xs = self.mixer_inputs(input_ids, sel)
        return [self.layers[i].attention.as_operator(xs[i], variant) for i in sel]

    def info(self) -> dict:
        c = self.config
        return {"family": "rwkv", "layers": c.num_hidden_layers, "d_model": c.hidden_size,
                "attention_hidden_size": c.attention_hidden_size,
                "intermediate_size": c.intermediate_size, "rescale_every": c.rescale_every,
                "vocab_size": c.vocab_size, "parameters": self.num_params,
                "dtype": str(self.embeddings[...].dtype)}


__all__ = ["Config", "LM", "RwkvSelfAttention", "RwkvFeedForward", "RwkvBlock", "RwkvCore", "VARIANTS",
           "init_params", "lm_forward", "layer_norm", "token_shift", "time_mix_parts", "time_mix_inner",
           "time_mix_forward", "channel_mix_forward", "time_mix_operator", "softmax_decay_rows", "wkv",
           "block_forward"]
