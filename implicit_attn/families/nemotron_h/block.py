"""Nemotron-H (HF ``NemotronHForCausalLM``): the block math as pure functions.

Each HF layer is ``h + mixer(rms_norm(h))`` with one mixer: HF's Mamba-2 mixer
(``mamba2.block`` with ``Config.mixer_config``; ``dt`` clamped to ``time_step_limit``),
full causal GQA attention without positional encoding (``nn.attention``), an MLP
``down(relu(up x)^2)``, or a mixture of such experts (sigmoid group-limited top-k routing,
optional latent projections around the experts, plus a shared expert). Our layer ``k``
runs HF's ``k``-th token-mixing layer and then the MLP / MoE layers after it, each with its
own norm and residual. Operators: the Mamba-2 operator of each Mamba layer (every Mamba-2
variant), the explicit attention operator (channels = heads) of each attention layer.
"""
from __future__ import annotations

import jax.numpy as jnp

from ...nn.hooks import no_hook, out_hook
from ...nn.moe import experts_forward, relu2, sigmoid_group_topk
from ...ops import linear
from ..bamba.block import hybrid_functions, hybrid_mixers
from ..mamba.block import rms_norm
from ..mamba2 import VARIANTS
from ..mamba2.block import mixer_forward as mamba_forward
from ..mamba2.block import mixer_operator as mamba_operator
from .config import Config

f32 = jnp.float32


def mlp_forward(p: dict, x, prefix: str = ""):
    """HF ``NemotronHMLP``: ``down(relu(up(x))^2)`` (biases if ``mlp_bias``). ``(..., D) -> (..., D)``."""
    u = relu2(linear(x, p[prefix + "up_proj.weight"], p.get(prefix + "up_proj.bias")))
    return linear(u, p[prefix + "down_proj.weight"], p.get(prefix + "down_proj.bias"))


def moe_forward(p: dict, x, cfg: Config):
    """HF ``NemotronHMoE``: ``(B, L, D) -> (B, L, D)``.

    The router (``gate.weight (E, D)``, ``gate.e_score_correction_bias (E,)``, float32) picks
    ``num_experts_per_tok`` experts (``nn.moe.sigmoid_group_topk``); the experts
    (``experts.up_proj (E, I, D')``, ``experts.down_proj (E, D', I)``) run on ``x`` or, with
    ``moe_latent_size``, on ``fc1_latent_proj(x)`` with ``fc2_latent_proj`` after them; the
    shared expert (``shared_experts.*``) sees ``x``.
    """
    B, L, D = x.shape
    t = x.reshape(B * L, D)
    weights, experts = sigmoid_group_topk(
        linear(t.astype(f32), p["gate.weight"].astype(f32)), p["gate.e_score_correction_bias"],
        cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    latent = "fc1_latent_proj.weight" in p
    u = linear(t, p["fc1_latent_proj.weight"], p.get("fc1_latent_proj.bias")) if latent else t
    out = experts_forward(u, weights, experts, p["experts.up_proj"], p["experts.down_proj"], relu2)
    if latent:
        out = linear(out, p["fc2_latent_proj.weight"], p.get("fc2_latent_proj.bias"))
    return out.reshape(B, L, D) + mlp_forward(p, x, "shared_experts.")


def ffn_forward(p: dict, x, cfg: Config):
    """An MLP or MoE layer's mixer (the MoE if its params have a router). ``(B, L, D)``."""
    return moe_forward(p, x, cfg) if "gate.weight" in p else mlp_forward(p, x)


def nemotron_layer(layer: dict, h, cfg: Config, kind: str, hook, mixer_fn, ffn_fn, residual_scale=None):
    """One layer of ours: the token-mixing HF layer ``h + mixer(rms_norm(h))``, then each
    MLP / MoE HF layer after it, ``h + ffn(rms_norm(h))`` (``bamba.block.hybrid_layer``'s
    signature; ``residual_scale`` must be None: Nemotron-H has none).

    Args:
      layer: ``{"input_layernorm", "mixer", "feed_forward": [{"norm", "ffn"}, ...]}``.
      h: ``(B, L, d_model)`` residual stream; kind: ``"mamba"`` or ``"attention"``.
    Returns:
      ``(h_next (B, L, d_model), hn (B, L, d_model))``: the layer output and the mixer input.
    """
    hook = hook or no_hook
    h = hook("hook_resid_pre", h)
    hn = hook("mixer.hook_in", rms_norm(h, layer["input_layernorm"], cfg.rms_norm_eps, cfg.norm_weight_in_float32))
    h = hook("hook_resid_mid", h + mixer_fn(layer["mixer"], hn, cfg, kind, out_hook(hook)))
    for sub in layer["feed_forward"]:
        h = h + ffn_fn(sub["ffn"], rms_norm(h, sub["norm"], cfg.rms_norm_eps, cfg.norm_weight_in_float32), cfg)
    return hook("hook_resid_post", h), hn


mixer_forward, mixer_operator = hybrid_mixers(mamba_forward, mamba_operator)

# HF ``NemotronHBlock`` / ``NemotronHForCausalLM``: no scales, the output head never tied.
FUNCTIONS = hybrid_functions(mixer_forward, mixer_operator, ffn_forward, layer_fn=nemotron_layer)
decoder_layer, layer_forward, lm_forward = FUNCTIONS.decoder_layer, FUNCTIONS.layer_forward, FUNCTIONS.lm_forward
lm_forward_jit, layer_forward_jit = FUNCTIONS.lm_forward_jit, FUNCTIONS.layer_forward_jit
mixer_forward_jit, mixer_operator_jit = FUNCTIONS.mixer_forward_jit, FUNCTIONS.mixer_operator_jit

__all__ = ["VARIANTS", "mlp_forward", "moe_forward", "ffn_forward", "nemotron_layer", "mixer_forward",
           "mixer_operator", "decoder_layer", "layer_forward", "lm_forward", "lm_forward_jit", "layer_forward_jit",
           "mixer_forward_jit", "mixer_operator_jit"]
