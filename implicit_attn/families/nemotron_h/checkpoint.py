"""Nemotron-H checkpoints: the shape table (HF names as saved on disk), HF tensors <->
params, and ``init_params`` drawn from the same table.

HF layout (the ``backbone.`` names ``save_pretrained`` writes and hub checkpoints hold):
``backbone.embeddings.weight``, ``backbone.norm_f.weight``, ``lm_head.weight`` (never tied);
per HF layer ``backbone.layers.{i}.norm.weight`` and ``backbone.layers.{i}.mixer.*``: HF
Mamba-2 names, ``{q,k,v,o}_proj.weight``, ``{up,down}_proj.*`` (MLP), or ``gate.weight``,
``gate.e_score_correction_bias``, ``experts.{e}.{up,down}_proj.weight``,
``shared_experts.{up,down}_proj.*`` and optional ``fc{1,2}_latent_proj.*`` (MoE). In the
params the experts are stacked as HF holds them in memory: ``experts.up_proj (E, I, D')``,
``experts.down_proj (E, D', I)``. Our layer ``k`` (``Config.blocks[k]``) is
``{"input_layernorm", "mixer", "feed_forward": [{"norm", "ffn"} per MLP / MoE layer]}``.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...nn import hf_from_params, init_from_table, params_from_hf
from ...nn.checkpoint import StateDictNames
from ...nn.moe import split_experts, stack_experts
from ..bamba.checkpoint import attention_shapes, sub
from ..mamba.checkpoint import init_rule as mamba_init_rule
from ..mamba2.checkpoint import mixer_shapes as mamba_shapes
from .config import Config

FUSED = {"experts.up_proj": ["up_proj.weight"], "experts.down_proj": ["down_proj.weight"]}
# transformers' state_dict() holds the model under ``model.`` and the experts stacked
STATE_DICT_NAMES = StateDictNames(renamed=((r"^model\.", "backbone."),), stacked=FUSED)


def mlp_shapes(cfg: Config, width: int, d_in: int | None = None, prefix: str = "") -> dict:
    """Local names -> shapes of an ``up``/``down`` MLP of ``width`` on ``d_in`` features
    (default ``hidden_size``), biases if ``mlp_bias``."""
    D = cfg.hidden_size if d_in is None else d_in
    m = {prefix + "up_proj.weight": (width, D), prefix + "down_proj.weight": (D, width)}
    if cfg.mlp_bias:
        m.update({prefix + "up_proj.bias": (width,), prefix + "down_proj.bias": (D,)})
    return m


def layer_shapes(cfg: Config, kind: str) -> dict:
    """Local names (under ``mixer.``) -> shapes of one HF layer's mixer of ``kind``."""
    if kind == "mamba":
        return mamba_shapes(cfg.mixer_config)
    if kind == "attention":
        return attention_shapes(cfg)
    if kind == "mlp":
        return mlp_shapes(cfg, cfg.intermediate_size)
    D, E, lat = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_latent_size
    d_in = D if lat is None else lat
    m = {"gate.weight": (E, D), "gate.e_score_correction_bias": (E,),
         **mlp_shapes(cfg, cfg.moe_shared_expert_intermediate_size, prefix="shared_experts.")}
    for e in range(E):
        m.update({f"experts.{e}.up_proj.weight": (cfg.moe_intermediate_size, d_in),
                  f"experts.{e}.down_proj.weight": (d_in, cfg.moe_intermediate_size)})
    if lat is not None:
        m.update({"fc1_latent_proj.weight": (lat, D), "fc2_latent_proj.weight": (D, lat)})
        if cfg.mlp_bias:
            m.update({"fc1_latent_proj.bias": (lat,), "fc2_latent_proj.bias": (D,)})
    return m


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` HF tensor names -> shapes."""
    V, D = cfg.vocab_size, cfg.hidden_size
    req = {"backbone.embeddings.weight": (V, D), "backbone.norm_f.weight": (D,), "lm_head.weight": (V, D)}
    for i, kind in enumerate(cfg.layers_block_type):
        p = f"backbone.layers.{i}."
        req[p + "norm.weight"] = (D,)
        req.update({p + "mixer." + k: s for k, s in layer_shapes(cfg, kind).items()})
    return req, {}


def ffn_params(cfg: Config, kind: str, t: dict) -> dict:
    """An MLP / MoE layer's tensors as stored -> params (experts stacked)."""
    return stack_experts(t, cfg.n_routed_experts, FUSED) if kind == "moe" else t


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """HF tensors (already checked) -> the ``LM`` parameter tree (one entry per block)."""
    layer = lambda i: f"backbone.layers.{i}."
    kinds = cfg.layers_block_type
    layers = [{"input_layernorm": tensors[layer(b[0]) + "norm.weight"],
               "mixer": sub(tensors, layer(b[0]) + "mixer."),
               "feed_forward": [{"norm": tensors[layer(i) + "norm.weight"],
                                 "ffn": ffn_params(cfg, kinds[i], sub(tensors, layer(i) + "mixer."))}
                                for i in b[1:]]}
              for b in cfg.blocks]
    return {"embed_tokens": tensors["backbone.embeddings.weight"], "layers": layers,
            "final_layernorm": tensors["backbone.norm_f.weight"], "lm_head": tensors["lm_head.weight"]}


def tensors_from_params(cfg: Config, params: dict) -> dict:
    """The inverse of ``params_from_tensors`` (unchecked)."""
    t = {"backbone.embeddings.weight": params["embed_tokens"], "backbone.norm_f.weight": params["final_layernorm"],
         "lm_head.weight": params["lm_head"]}
    kinds = cfg.layers_block_type
    for b, layer in zip(cfg.blocks, params["layers"]):
        t[f"backbone.layers.{b[0]}.norm.weight"] = layer["input_layernorm"]
        t.update({f"backbone.layers.{b[0]}.mixer.{k}": v for k, v in layer["mixer"].items()})
        for i, f in zip(b[1:], layer["feed_forward"]):
            t[f"backbone.layers.{i}.norm.weight"] = f["norm"]
            ffn = split_experts(f["ffn"], cfg.n_routed_experts, FUSED) if kinds[i] == "moe" else f["ffn"]
            t.update({f"backbone.layers.{i}.mixer.{k}": v for k, v in ffn.items()})
    return t


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors -> ``(Config, params)`` after strict checks."""
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, tensors, "nemotron_h")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, tensors)`` (numpy)."""
    return hf_from_params(cfg, tensors_from_params(cfg, params), expected_shapes, "nemotron_h")


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Mamba-2's rules; layer norm weights near 1 (not exactly 1, so a misplaced weight
    shows in tests); a small random router correction bias."""
    if name.endswith("e_score_correction_bias"):
        return 0.1 * g.standard_normal(shape)
    if name.endswith(".norm.weight"):
        return 1.0 + 0.1 * g.standard_normal(shape)
    return mamba_init_rule(name, shape, g)


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["FUSED", "STATE_DICT_NAMES", "mlp_shapes", "layer_shapes", "expected_shapes", "ffn_params", "params_from_tensors",
           "tensors_from_params", "to_params", "from_params", "init_rule", "init_params"]
