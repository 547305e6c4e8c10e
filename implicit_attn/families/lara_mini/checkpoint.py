"""LaraMini checkpoints: Bamba's layout builder (``bamba.checkpoint.layout_checkpoint``) under
the names the released checkpoints and ``save_pretrained`` use: ``model.embed_tokens.weight``,
``model.norm.weight``, ``lm_head.weight`` (unless tied); per layer ``input_layernorm.weight``,
``post_attention_layernorm.weight``, ``linear_attn.*`` (``in_proj.weight (2 H_k d_k + 2 H_v d_v
+ 2 H_v, D)``, rows ``[q | k | v | z | b | a]``, ``conv1d.weight``, ``dt_bias``, ``A_log``,
``out_norm.weight (d_v,)``, ``out_proj.weight``) or ``self_attn.*`` (``{q,k,v,o}_proj``,
``{q,k}_norm.weight (head_dim,)``), and ``mlp.*``: ``gate.weight (E, D)``, the experts stacked,
``experts.gate_up_proj (E, 2I, D)``, ``experts.down_proj (E, D, I)``, and the
``shared_expert.{gate,up,down}_proj.weight`` MLP.

transformers' module names differ (its conversion mapping splits ``in_proj`` into
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` and calls ``out_norm`` ``norm``);
``standard_form`` reads a file written from its ``state_dict()`` as the saved form.
"""
from __future__ import annotations

import numpy as np

from ...nn import CheckpointError
from ..bamba.checkpoint import Layout, layout_checkpoint
from ..qwen3_next.checkpoint import init_rule as qwen3_next_init_rule
from ..qwen3_next.checkpoint import swiglu_shapes
from .config import Config

# transformers' state-dict names of the DeltaNet's projections, in the rows of the stored ``in_proj``
SPLIT_PROJECTIONS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")


def delta_shapes(cfg: Config) -> dict:
    """Local names (under ``linear_attn.``) -> stored shapes of a Gated DeltaNet mixer."""
    D, Hv = cfg.hidden_size, cfg.linear_num_value_heads
    conv = 2 * cfg.key_dim + cfg.value_dim
    return {"in_proj.weight": (conv + cfg.value_dim + 2 * Hv, D),
            "conv1d.weight": (conv, 1, cfg.linear_conv_kernel_dim), "dt_bias": (Hv,), "A_log": (Hv,),
            "out_norm.weight": (cfg.linear_value_head_dim,), "out_proj.weight": (D, cfg.value_dim)}


def attention_shapes(cfg: Config) -> dict:
    """Local names (under ``self_attn.``) -> shapes of an attention mixer (either kind)."""
    D, H, KV, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    m = {"q_proj.weight": (H * d, D), "k_proj.weight": (KV * d, D), "v_proj.weight": (KV * d, D),
         "o_proj.weight": (D, H * d), "q_norm.weight": (d,), "k_norm.weight": (d,)}
    if cfg.attention_bias:
        m.update({"q_proj.bias": (H * d,), "k_proj.bias": (KV * d,), "v_proj.bias": (KV * d,), "o_proj.bias": (D,)})
    return m


def mixer_tables(cfg: Config, layout) -> dict:
    attention = attention_shapes(cfg)
    return {"delta": delta_shapes(cfg), "sliding": attention, "attention": attention}


def ffn_shapes(cfg: Config, i: int) -> dict:
    """Local names (under ``mlp.``) -> shapes of layer ``i``'s mixture of experts as stored."""
    D, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    return {"gate.weight": (E, D), "experts.gate_up_proj": (E, 2 * I, D), "experts.down_proj": (E, D, I),
            **swiglu_shapes(D, cfg.shared_expert_intermediate_size, "shared_expert.")}


LAYOUT = Layout("lara_mini", "model.norm.weight", "post_attention_layernorm.weight", "mlp.", ffn_shapes,
                mixer_prefix={"delta": "linear_attn.", "sliding": "self_attn.", "attention": "self_attn."},
                mixer_tables=mixer_tables)


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Qwen3-Next's rules, with the plain-weight norms near 1 (HF starts them at 1)."""
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "out_norm.weight")) \
            or name == "model.norm.weight":
        return 1.0 + 0.1 * g.standard_normal(shape)
    return qwen3_next_init_rule(name, shape, g)


CHECKPOINT = layout_checkpoint(Config, LAYOUT, init_rule)
expected_shapes, params_from_tensors = CHECKPOINT.expected_shapes, CHECKPOINT.params_from_tensors
from_params, init_params = CHECKPOINT.from_params, CHECKPOINT.init_params


def standard_form(cfg: Config, tensors: dict) -> dict:
    """``tensors`` with transformers' state-dict names of each DeltaNet (``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; ``norm.weight``) turned into the saved ones
    (their rows joined into ``in_proj.weight``; ``out_norm.weight``). ``CheckpointError`` where
    only some of the four are present, or with the saved tensor too."""
    t = dict(tensors)
    for i, kind in enumerate(cfg.layer_types):
        if kind != "delta":
            continue
        a = f"model.layers.{i}.linear_attn."
        if a + "norm.weight" in t and a + "out_norm.weight" not in t:
            t[a + "out_norm.weight"] = t.pop(a + "norm.weight")
        parts = [a + n for n in SPLIT_PROJECTIONS]
        present = [n for n in parts if n in t]
        if not present:
            continue
        if len(present) < len(parts) or a + "in_proj.weight" in t:
            both = " and in_proj.weight" if a + "in_proj.weight" in t else ""
            raise CheckpointError(f"lara_mini checkpoint: layer {i} has {', '.join(present)}{both}; the DeltaNet's "
                                  f"input projections are either in_proj.weight or all of "
                                  f"{', '.join(SPLIT_PROJECTIONS)}")
        pieces = [t.pop(n) for n in parts]
        if any(np.ndim(x) != 2 for x in pieces) or len({np.shape(x)[1] for x in pieces}) != 1:
            raise CheckpointError(f"lara_mini checkpoint: layer {i}'s {', '.join(SPLIT_PROJECTIONS)} have shapes "
                                  f"{[tuple(np.shape(x)) for x in pieces]}; they must be matrices of one input width")
        t[a + "in_proj.weight"] = np.concatenate([np.asarray(x) for x in pieces], axis=0)
    return t


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors (saved names or transformers' state-dict names,
    ``standard_form``) -> ``(Config, params)`` after strict checks."""
    try:
        cfg = Config.from_hf(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"lara_mini config: {e}") from e
    return CHECKPOINT.to_params(config, standard_form(cfg, tensors))


__all__ = ["SPLIT_PROJECTIONS", "delta_shapes", "attention_shapes", "mixer_tables", "ffn_shapes", "LAYOUT", "init_rule",
           "CHECKPOINT", "expected_shapes", "params_from_tensors", "standard_form", "to_params", "from_params",
           "init_params"]
