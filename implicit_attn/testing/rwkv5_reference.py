"""A plain-torch CPU reference of the RWKV team's Hugging Face RWKV-5 ("Eagle") model
(``Rwkv5ForCausalLM``, ``model_type: "rwkv5"``: the remote code of the RWKV/rwkv-5-world-* and
RWKV/v5-Eagle-7B-HF checkpoints, from transformers PR #26963 / #29095), checked against BlinkDL's
official ``rwkv`` pip package (0.8.32, its v5.2 path).

``transformers`` classes with that code's config fields and defaults and its parameter names and
shapes (transformers' RWKV-4 scheme: ``rwkv.embeddings``, ``rwkv.blocks.{i}.pre_ln`` / ``ln1`` /
``ln2`` / ``attention.*`` / ``feed_forward.*``, ``rwkv.ln_out``, ``head``), so that
``save_pretrained`` writes a checkpoint in the Hub layout and ``from_pretrained`` reads one back.
The forward pass is written from the published math (token shift, per-head matrix-state
recurrence read before the update plus the bonus ``time_faaaa``, evaluated step by step in
float32; ``GroupNorm_H(o / head_size_divisor) * silu(g)``), eval mode only, without a cache.

Eval-mode rescaling (``rescale_every = R > 0``), as the RWKV team's code does it, only when the
weights are float16 / bfloat16: block ``i`` uses ``attention.output`` and ``feed_forward.value``
divided by ``2 ** (i // R)`` and the residual stream is halved after every ``R``-th block (the
official package likewise rescales by default only in float16). In float32 nothing is rescaled
(it would change the numbers through the layer norms' eps acting on a stream scaled by ``2 **
-k``). The division happens at run time, so the weights stay in their training form and
``save_pretrained`` needs no undoing.

``official_state_dict`` renames the weights into the official RWKV-LM v5.2 checkpoint layout and
``official_logits`` runs the official package on them in a subprocess (``fla_rwkv.run_official``).

This is a test reference: it is never imported by the library. Needs the ``test`` extra
(torch, transformers; ``rwkv`` for ``official_logits``): ``pip install implicit-attn[test]``.

    model = Rwkv5ForCausalLM(Rwkv5Config(vocab_size=64, hidden_size=128, num_hidden_layers=3))
    perturb_weights(model, seed=0)
    logits = model(torch.tensor([[1, 2, 3]])).logits             # (1, 3, 64) float32
    ref = official_logits(model, [[1, 2, 3]])                     # numpy, same shape
"""
from __future__ import annotations

import numpy as np

from .deps import require
from .fla_rwkv import check_ids, rwkv6_recurrence, run_official

torch = require("torch")
transformers = require("transformers")
hf_init = require("transformers.initialization")
hf_outputs = require("transformers.modeling_outputs")

nn = torch.nn
F = torch.nn.functional

GROUP_NORM_EPS = 1e-5  # nn.GroupNorm's default, applied to o / head_size_divisor
INIT_STD = 0.02  # normal init of linears and embeddings (the config has no initializer_range)


class Rwkv5Config(transformers.PretrainedConfig):
    """The RWKV team's HF ``Rwkv5Config`` (``model_type="rwkv5"``): the same fields and defaults.

    ``H = hidden_size / head_size`` heads; ``attention_hidden_size`` defaults to (and must
    equal) ``hidden_size``; the channel mix is ``intermediate_size`` wide, else
    ``int(3.5 hidden_size) // 32 * 32`` (the PR code's config always stores None there; this one
    keeps the value given). ``num_attention_heads`` is stored only (the code derives the heads
    from ``head_size``). ``head_size_divisor`` (default 8): the output group norm reads
    ``o / head_size_divisor`` with eps 1e-5, i.e. eps ``1e-5 * head_size_divisor ** 2`` on ``o``:
    8 gives the official ``64e-5``; 1 is the earlier port without a divisor.
    ``rescale_every``: see the module docstring. ``use_cache`` is stored only."""

    model_type = "rwkv5"

    def __init__(
        self,
        vocab_size: int = 65536,
        hidden_size: int = 768,
        num_hidden_layers: int = 24,
        attention_hidden_size: int | None = None,
        num_attention_heads: int = 64,
        head_size: int = 64,
        head_size_divisor: float = 8,
        intermediate_size: int | None = None,
        layer_norm_epsilon: float = 1e-5,
        bos_token_id: int = 0,
        eos_token_id: int = 0,
        rescale_every: int = 6,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.attention_hidden_size = attention_hidden_size if attention_hidden_size is not None else hidden_size
        self.num_attention_heads = num_attention_heads
        self.head_size = head_size
        self.head_size_divisor = head_size_divisor
        self.intermediate_size = intermediate_size
        self.layer_norm_epsilon = layer_norm_epsilon
        self.rescale_every = rescale_every
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, **kwargs)


def ffn_size(config: Rwkv5Config) -> int:
    """The channel mix's width: ``intermediate_size``, else ``int(3.5 hidden_size) // 32 * 32``."""
    if config.intermediate_size is not None:
        return config.intermediate_size
    return int(config.hidden_size * 3.5) // 32 * 32


def check_config(config: Rwkv5Config) -> None:
    """``ValueError`` for widths the RWKV-5 code cannot build (heads not dividing the width, an
    attention width other than the hidden width)."""
    if config.head_size < 1 or config.hidden_size % config.head_size:
        raise ValueError(f"hidden_size ({config.hidden_size}) must be a multiple of head_size ({config.head_size})")
    if config.attention_hidden_size != config.hidden_size:
        raise ValueError(f"attention_hidden_size ({config.attention_hidden_size}) must equal hidden_size "
                         f"({config.hidden_size}): the time mix sizes its heads, time_decay and ln_x by hidden_size")
    if not config.head_size_divisor > 0:
        raise ValueError(f"head_size_divisor must be > 0, got {config.head_size_divisor}")


HALF = (torch.float16, torch.bfloat16)


def rescales(module: nn.Module, config: Rwkv5Config, dtype) -> bool:
    """Whether the eval-mode rescaling is on: ``rescale_every > 0``, eval mode, half-precision
    weights (``dtype``), as the RWKV team's code."""
    return not module.training and config.rescale_every > 0 and dtype in HALF


def rescale_divisor(module: nn.Module, config: Rwkv5Config, layer_id: int) -> int:
    """The eval-mode divisor ``2 ** (layer_id // rescale_every)`` of a block's output weights (1
    in training mode, without rescaling or in float32: ``rescales``)."""
    if not rescales(module, config, next(module.parameters()).dtype):
        return 1
    return 2 ** (layer_id // config.rescale_every)


def token_mix(x, shifted, mu):
    """``x mu + shifted (1 - mu)``: the token-shift interpolation with ``mu (1, 1, C)``."""
    return x * mu + shifted * (1 - mu)


def shift(x):
    """``(B, T, C)``: ``x_{t-1}``, zeros at ``t = 0``."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


class Rwkv5SelfAttention(nn.Module):
    """The RWKV-5 time mix: ``forward(x (B, T, C)) -> (B, T, C)`` on the ``ln1`` output (eval
    mode: ``output`` divided by the block's rescaling divisor)."""

    def __init__(self, config: Rwkv5Config, layer_id: int = 0):
        super().__init__()
        check_config(config)
        self.config = config
        self.layer_id = layer_id
        C, S = config.hidden_size, config.head_size
        H = C // S
        self.num_heads = H
        self.time_decay = nn.Parameter(torch.empty(H, S))
        self.time_faaaa = nn.Parameter(torch.empty(H, S))
        self.time_mix_gate = nn.Parameter(torch.empty(1, 1, C))
        self.time_mix_key = nn.Parameter(torch.empty(1, 1, C))
        self.time_mix_value = nn.Parameter(torch.empty(1, 1, C))
        self.time_mix_receptance = nn.Parameter(torch.empty(1, 1, C))
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)
        self.gate = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.ln_x = nn.GroupNorm(H, C, eps=GROUP_NORM_EPS)

    def forward(self, x):
        """``x (B, T, C)`` (the ``ln1`` output) -> ``(B, T, C)``."""
        B, T, C = x.shape
        H = self.num_heads
        prev = shift(x)
        proj = lambda name: getattr(self, name)(token_mix(x, prev, getattr(self, "time_mix_" + name)))  # noqa: E731
        per_head = lambda t: t.float().view(B, T, H, -1)  # noqa: E731
        r, k, v = per_head(proj("receptance")), per_head(proj("key")), per_head(proj("value"))
        g = F.silu(proj("gate"))
        log_w = (-torch.exp(self.time_decay.float()))[None, None].expand(B, T, H, -1)
        o, _ = rwkv6_recurrence(r, k, v, log_w, self.time_faaaa.float())
        o = o.reshape(B * T, C) / self.config.head_size_divisor
        o = F.group_norm(o, H, self.ln_x.weight.float(), self.ln_x.bias.float(), self.ln_x.eps).view(B, T, C)
        w = self.output.weight / rescale_divisor(self, self.config, self.layer_id)
        return F.linear(o.to(x.dtype) * g, w)


class Rwkv5FeedForward(nn.Module):
    """The RWKV-4/5 channel mix: ``sigmoid(receptance(xr)) * value(relu(key(xk))^2)`` on the
    ``ln2`` output (eval mode: ``value`` divided by the block's rescaling divisor)."""

    def __init__(self, config: Rwkv5Config, layer_id: int = 0):
        super().__init__()
        self.config = config
        self.layer_id = layer_id
        C, Fw = config.hidden_size, ffn_size(config)
        self.time_mix_key = nn.Parameter(torch.empty(1, 1, C))
        self.time_mix_receptance = nn.Parameter(torch.empty(1, 1, C))
        self.key = nn.Linear(C, Fw, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(Fw, C, bias=False)

    def forward(self, x):
        """``x (B, T, C)`` (the ``ln2`` output) -> ``(B, T, C)``."""
        prev = shift(x)
        k = torch.square(torch.relu(self.key(token_mix(x, prev, self.time_mix_key))))
        w = self.value.weight / rescale_divisor(self, self.config, self.layer_id)
        return torch.sigmoid(self.receptance(token_mix(x, prev, self.time_mix_receptance))) * F.linear(k, w)


class Rwkv5Block(nn.Module):
    """``(pre_ln on block 0), h + attention(ln1 h), h + feed_forward(ln2 h)``."""

    def __init__(self, config: Rwkv5Config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        eps = config.layer_norm_epsilon
        if layer_id == 0:
            self.pre_ln = nn.LayerNorm(config.hidden_size, eps=eps)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attention = Rwkv5SelfAttention(config, layer_id)
        self.feed_forward = Rwkv5FeedForward(config, layer_id)

    def forward(self, h):
        """``h (B, T, C)`` -> ``(B, T, C)`` (before the model's eval-mode halving)."""
        if self.layer_id == 0:
            h = self.pre_ln(h)
        h = h + self.attention(self.ln1(h))
        return h + self.feed_forward(self.ln2(h))


class Rwkv5PreTrainedModel(transformers.PreTrainedModel):
    """Weight init and the transformers plumbing of the RWKV-5 models."""

    config_class = Rwkv5Config
    base_model_prefix = "rwkv"
    main_input_name = "input_ids"
    _no_split_modules = ["Rwkv5Block"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module):
        """Random init: normal(0, 0.02) for linears and embeddings, ones / zeros for norms;
        interpolation weights uniform in (0, 1), decays spread per head from slow to fast
        (``time_decay`` -6 ... 1), a small bonus. Uses ``transformers.initialization`` (skips
        loaded parameters)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            hf_init.normal_(module.weight, mean=0.0, std=INIT_STD)
        elif isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
            hf_init.ones_(module.weight)
            hf_init.zeros_(module.bias)
        elif isinstance(module, Rwkv5SelfAttention):
            for name in ("key", "value", "receptance", "gate"):
                hf_init.uniform_(getattr(module, "time_mix_" + name), 0.0, 1.0)
            H, S = module.time_decay.shape
            hf_init.copy_(module.time_decay, torch.linspace(-6.0, 1.0, S).repeat(H, 1))
            hf_init.normal_(module.time_faaaa, mean=0.0, std=0.1)
        elif isinstance(module, Rwkv5FeedForward):
            hf_init.uniform_(module.time_mix_key, 0.0, 1.0)
            hf_init.uniform_(module.time_mix_receptance, 0.0, 1.0)


class Rwkv5Model(Rwkv5PreTrainedModel):
    """``forward(input_ids (B, L), output_hidden_states)``: the final-normed hidden states
    ``(B, L, C)``, and with ``output_hidden_states`` the tuple HF returns (each block's output,
    after the eval-mode halving, then the final-normed one)."""

    def __init__(self, config: Rwkv5Config):
        super().__init__(config)
        check_config(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList([Rwkv5Block(config, i) for i in range(config.num_hidden_layers)])
        self.ln_out = nn.LayerNorm(config.hidden_size)  # nn.LayerNorm's eps, not layer_norm_epsilon
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(self, input_ids, output_hidden_states: bool = False, **kwargs):
        """``input_ids (B, L)`` -> ``(final-normed (B, L, C), hidden states or None)``."""
        R = self.config.rescale_every
        h = self.embeddings(input_ids)
        halve = rescales(self, self.config, h.dtype)
        states = []
        for i, block in enumerate(self.blocks):
            h = block(h)
            if halve and (i + 1) % R == 0:
                h = h / 2
            states.append(h)
        h = self.ln_out(h)
        return (h, tuple(states) + (h,)) if output_hidden_states else (h, None)


class Rwkv5ForCausalLM(Rwkv5PreTrainedModel):
    """The RWKV team's HF ``Rwkv5ForCausalLM`` in plain torch (float32, CPU, eval mode after
    construction): ``.rwkv`` (``Rwkv5Model``) and ``head``. ``forward(input_ids (B, L),
    use_cache=False, output_hidden_states=False)`` -> ``CausalLMOutput(logits (B, L, vocab)
    float32, hidden_states)``; no cache (``use_cache`` is ignored), no loss, no padding masks.
    The head is tied to the embeddings only if ``config.tie_word_embeddings``."""

    _tied_weights_keys = {"head.weight": "rwkv.embeddings.weight"}

    def __init__(self, config: Rwkv5Config):
        super().__init__(config)
        self.rwkv = Rwkv5Model(config)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.eval()

    def get_input_embeddings(self):
        return self.rwkv.embeddings

    def set_input_embeddings(self, value):
        self.rwkv.embeddings = value

    def get_output_embeddings(self):
        return self.head

    def set_output_embeddings(self, value):
        self.head = value

    def forward(self, input_ids=None, use_cache=False, output_hidden_states=False, attention_mask=None,
                labels=None, **kwargs):
        """``input_ids (B, L)`` -> ``CausalLMOutput(logits (B, L, vocab) float32, hidden_states)``
        (see the class docstring)."""
        if input_ids is None:
            raise ValueError("input_ids is required")
        if labels is not None:
            raise NotImplementedError("labels: this reference computes logits only, no loss")
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
            raise NotImplementedError("attention_mask with padding is not supported by this reference")
        h, states = self.rwkv(input_ids, output_hidden_states=bool(output_hidden_states))
        return hf_outputs.CausalLMOutput(logits=self.head(h).float(), hidden_states=states)


# ----------------------------------------------------------------------------- random weights

@torch.no_grad()
def perturb_weights(model: Rwkv5ForCausalLM, seed: int = 0) -> Rwkv5ForCausalLM:
    """Set every parameter to a seeded random value of a realistic scale, away from any trivial
    initial value: embeddings N(0, 1); linear weights N(0, 1/fan_in) (the head 3x that); layer
    and group norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2); interpolation weights U(0, 1);
    ``time_decay`` spread per head over -6 ... 1 plus N(0, 0.1^2) (per-step decays from ~1 to
    ~0.07); ``time_faaaa`` N(0, 0.3^2). Logits come out O(1..10). Returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    normal = lambda p, std, mean=0.0: p.copy_(torch.randn(p.shape, generator=gen) * std + mean)  # noqa: E731
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embeddings.weight"):
            normal(p, 1.0)
        elif ".ln" in name or name.startswith("rwkv.ln") or "pre_ln" in name:
            normal(p, 0.1, 1.0 if leaf == "weight" else 0.0)
        elif leaf.startswith("time_mix_"):
            p.copy_(torch.rand(p.shape, generator=gen))
        elif leaf == "time_decay":
            H, S = p.shape
            p.copy_(torch.linspace(-6.0, 1.0, S).repeat(H, 1) + 0.1 * torch.randn(p.shape, generator=gen))
        elif leaf == "time_faaaa":
            normal(p, 0.3)
        elif name == "head.weight":
            normal(p, 3.0 * p.shape[1] ** -0.5)
        elif leaf == "weight" and p.ndim == 2:
            normal(p, p.shape[1] ** -0.5)
        else:
            raise KeyError(f"perturb_weights: no rule for parameter {name!r} {tuple(p.shape)}")
    return model


# ----------------------------------------------------------------------------- official package

@torch.no_grad()
def official_state_dict(model: Rwkv5ForCausalLM) -> dict:
    """The weights of an ``Rwkv5ForCausalLM`` under the official RWKV-LM v5.2 checkpoint names and
    shapes: ``emb.weight``, ``blocks.{i}.ln0`` (block 0's ``pre_ln``), ``ln1``, ``ln2``,
    ``att.time_mix_k/v/r/g (1, 1, C)``, ``att.time_decay, att.time_faaaa (H, S)``,
    ``att.receptance/key/value/gate/output.weight`` (out, in), ``att.ln_x``, ``ffn.time_mix_k/r
    (1, 1, C)``, ``ffn.key/receptance/value.weight``, ``ln_out``, ``head.weight`` (the embeddings
    when tied). The training-form weights (no rescaling). Returns ``name -> float32 tensor``
    (copies)."""
    if not isinstance(model, Rwkv5ForCausalLM):
        raise TypeError(f"expected Rwkv5ForCausalLM, got {type(model).__name__}")
    if model.config.head_size < 2:
        raise ValueError("the official package reads time_decay (H, 1) as RWKV-5.0/5.1: head_size must be >= 2")
    hf = {k: v.detach().float().clone().contiguous() for k, v in model.state_dict().items()}
    out = {"emb.weight": hf["rwkv.embeddings.weight"], "ln_out.weight": hf["rwkv.ln_out.weight"],
           "ln_out.bias": hf["rwkv.ln_out.bias"],
           "head.weight": hf.get("head.weight", hf["rwkv.embeddings.weight"]).clone()}
    for i in range(model.config.num_hidden_layers):
        b, p = f"blocks.{i}.", f"rwkv.blocks.{i}."
        for official, ours in (("ln0", "pre_ln"), ("ln1", "ln1"), ("ln2", "ln2"), ("att.ln_x", "attention.ln_x")):
            if p + ours + ".weight" in hf:
                out[b + official + ".weight"] = hf[p + ours + ".weight"]
                out[b + official + ".bias"] = hf[p + ours + ".bias"]
        for n, full in (("k", "key"), ("v", "value"), ("r", "receptance"), ("g", "gate")):
            out[b + f"att.time_mix_{n}"] = hf[p + f"attention.time_mix_{full}"]
        for name in ("time_decay", "time_faaaa", "receptance.weight", "key.weight", "value.weight", "gate.weight",
                     "output.weight"):
            out[b + "att." + name] = hf[p + "attention." + name]
        out[b + "ffn.time_mix_k"] = hf[p + "feed_forward.time_mix_key"]
        out[b + "ffn.time_mix_r"] = hf[p + "feed_forward.time_mix_receptance"]
        for name in ("key.weight", "receptance.weight", "value.weight"):
            out[b + "ffn." + name] = hf[p + "feed_forward." + name]
    return out


def official_logits(model: Rwkv5ForCausalLM, ids, timeout: float = 600) -> np.ndarray:
    """Logits of the official ``rwkv`` package (its RWKV-5.2 pure-torch path, ``"cpu fp32"``) on
    ``model``'s weights (``official_state_dict``) for ``ids (B, L)`` ints, without rescaling (its
    float32 default, and ours in float32): numpy float32 ``(B, L, vocab)``. See
    ``fla_rwkv.run_official`` (one subprocess).

    Agreement to float32 rounding needs the official constants: the output group norm's eps is
    ``64e-5`` there, which is ``head_size_divisor = 8`` here (eps ``1e-5 * 8^2``); all its layer
    norms use ``1e-5`` (``layer_norm_epsilon``). Raises ``ImportError`` if the package is not
    installed, ``RuntimeError`` with the subprocess's output if it fails."""
    ids = check_ids(ids)
    weights = official_state_dict(model)
    return run_official(weights, ids, 5, rescale_layer=0, timeout=timeout)


__all__ = ["Rwkv5Config", "Rwkv5SelfAttention", "Rwkv5FeedForward", "Rwkv5Block", "Rwkv5PreTrainedModel",
           "Rwkv5Model", "Rwkv5ForCausalLM", "perturb_weights", "official_state_dict", "official_logits", "ffn_size",
           "check_config", "rescales", "rescale_divisor", "HALF", "token_mix", "shift", "GROUP_NORM_EPS", "INIT_STD"]
