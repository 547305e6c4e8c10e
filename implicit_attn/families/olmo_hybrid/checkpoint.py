"""OLMo-Hybrid checkpoints: the shape table (the names HF writes), HF tensors <-> params, and
``init_params`` drawn from the same table.

Stored layout (what ``OlmoHybridForCausalLM.save_pretrained`` writes, and what we write):
``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` (unless tied); per
DeltaNet layer ``attention_layer_norm.weight`` (HF's ``input_layernorm``),
``feedforward_layer_norm.weight`` (HF's ``post_attention_layernorm``), ``linear_attn.*``
(``{q,k,v,g,a,b,o}_proj.weight``, ``{q,k,v}_conv1d.weight``, ``A_log``, ``dt_bias``,
``o_norm.weight``), ``mlp.{gate,up,down}_proj.weight``; per attention layer
``feedforward_layer_norm.weight`` (HF's ``post_attention_layernorm``),
``post_feedforward_layernorm.weight``, ``self_attn.{q,k,v,o}_proj.weight``,
``self_attn.{q,k}_norm.weight``, ``mlp.*``.

HF reads the norms under either name and concatenates the three convs into one ``conv1d``
(its own writer splits that back into three near-equal pieces, not into q, k and v: 40 channels
as 14, 14, 12). ``standard_form`` accepts all those forms and turns them into ours (the convs
split as q, k, v), so the shape check stays strict; the parameter tree holds HF's module names
(one ``conv1d.weight``).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...nn import CheckpointError, hf_from_params, init_from_table, params_from_hf
from ..bamba.checkpoint import init_rule as bamba_init_rule
from ..bamba.checkpoint import sub
from .config import Config

# HF's module names -> the names HF writes (HF renames them back when it reads)
STORED_NORMS = {"input_layernorm.weight": "attention_layer_norm.weight",
                "post_attention_layernorm.weight": "feedforward_layer_norm.weight"}
CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def delta_shapes(cfg: Config) -> dict:
    """Local names (under ``linear_attn.``) -> stored shapes of a Gated DeltaNet mixer."""
    D, Hv, K = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
    kd, vd = cfg.key_dim, cfg.value_dim
    return {"q_proj.weight": (kd, D), "k_proj.weight": (kd, D), "v_proj.weight": (vd, D), "g_proj.weight": (vd, D),
            "a_proj.weight": (Hv, D), "b_proj.weight": (Hv, D), "o_proj.weight": (D, vd),
            "q_conv1d.weight": (kd, 1, K), "k_conv1d.weight": (kd, 1, K), "v_conv1d.weight": (vd, 1, K),
            "A_log": (Hv,), "dt_bias": (Hv,), "o_norm.weight": (cfg.linear_value_head_dim,)}


def attention_shapes(cfg: Config) -> dict:
    """Local names (under ``self_attn.``) -> shapes of an attention mixer."""
    D, H, KV, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    m = {"q_proj.weight": (H * d, D), "k_proj.weight": (KV * d, D), "v_proj.weight": (KV * d, D),
         "o_proj.weight": (D, H * d), "q_norm.weight": (H * d,), "k_norm.weight": (KV * d,)}
    if cfg.attention_bias:
        m.update({"q_proj.bias": (H * d,), "k_proj.bias": (KV * d,), "v_proj.bias": (KV * d,), "o_proj.bias": (D,)})
    return m


def layer_norm_names(kind: str) -> tuple[str, str]:
    """The two norms of a ``kind`` layer, by HF module name."""
    if kind == "delta":
        return "input_layernorm", "post_attention_layernorm"
    return "post_attention_layernorm", "post_feedforward_layernorm"


def stored(name: str) -> str:
    return STORED_NORMS.get(name + ".weight", name + ".weight")


def expected_shapes(cfg: Config) -> tuple[dict, dict]:
    """``(required, optional)`` stored tensor names -> shapes."""
    D, V, F = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    req = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        req.update({p + stored(n): (D,) for n in layer_norm_names(kind)})
        mixer = ("linear_attn.", delta_shapes(cfg)) if kind == "delta" else ("self_attn.", attention_shapes(cfg))
        req.update({p + mixer[0] + k: s for k, s in mixer[1].items()})
        req.update({p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                    p + "mlp.down_proj.weight": (D, F)})
    opt = {}
    (opt if cfg.tie_word_embeddings else req)["lm_head.weight"] = (V, D)
    return req, opt


def standard_form(cfg: Config, tensors: dict) -> dict:
    """``tensors`` with HF's other names for the norms renamed to the stored ones, and each
    DeltaNet's convs (one ``conv1d.weight``, or three pieces of any split) split as q, k, v;
    ``CheckpointError`` where the pieces do not add up."""
    t = dict(tensors)
    kd, vd = cfg.key_dim, cfg.value_dim
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        for hf, ours in STORED_NORMS.items():
            if p + hf in t and p + ours not in t:
                t[p + ours] = t.pop(p + hf)
        if kind != "delta":
            continue
        a = p + "linear_attn."
        pieces = [a + c for c in CONVS]
        if a + "conv1d.weight" in t and not any(n in t for n in pieces):
            whole = t.pop(a + "conv1d.weight")
        elif all(n in t for n in pieces):
            parts = [t.pop(n) for n in pieces]
            if any(np.ndim(x) != 3 for x in parts) or len({tuple(np.shape(x)[1:]) for x in parts}) != 1:
                raise CheckpointError(f"olmo_hybrid checkpoint: {', '.join(pieces)} have shapes "
                                      f"{[tuple(np.shape(x)) for x in parts]}; they must be (n, 1, K) pieces")
            whole = np.concatenate([np.asarray(x) for x in parts], axis=0)
        else:
            continue
        if np.ndim(whole) != 3 or np.shape(whole)[0] != 2 * kd + vd:
            raise CheckpointError(f"olmo_hybrid checkpoint: layer {i}'s conv tensor (q, k and v joined) has shape "
                                  f"{tuple(np.shape(whole))}, expected {(2 * kd + vd, 1, cfg.linear_conv_kernel_dim)}")
        t[pieces[0]], t[pieces[1]], t[pieces[2]] = np.split(whole, [kd, 2 * kd], axis=0)
    return t


def params_from_tensors(cfg: Config, tensors: dict) -> dict:
    """Stored tensors (checked) -> the ``LM`` tree: per layer its two norms (HF module names),
    ``mixer`` (HF's module names; the convs joined into ``conv1d.weight``) and ``mlp``."""
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        layer = {n: tensors[p + stored(n)] for n in layer_norm_names(kind)}
        if kind == "delta":
            mixer = sub(tensors, p + "linear_attn.")
            mixer["conv1d.weight"] = jnp.concatenate([jnp.asarray(mixer.pop(c)) for c in CONVS], axis=0)
        else:
            mixer = sub(tensors, p + "self_attn.")
        layers.append({**layer, "mixer": mixer, "mlp": sub(tensors, p + "mlp.")})
    return {"embed_tokens": tensors["model.embed_tokens.weight"], "layers": layers,
            "final_layernorm": tensors["model.norm.weight"],
            "lm_head": None if cfg.tie_word_embeddings else tensors["lm_head.weight"]}


def tensors_from_params(cfg: Config, params: dict) -> dict:
    """The ``LM`` tree -> stored tensors (unchecked)."""
    kd = cfg.key_dim
    t = {"model.embed_tokens.weight": params["embed_tokens"], "model.norm.weight": params["final_layernorm"]}
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, params["layers"])):
        p = f"model.layers.{i}."
        t.update({p + stored(n): layer[n] for n in layer_norm_names(kind)})
        mixer = dict(layer["mixer"])
        if kind == "delta":
            q, k, v = jnp.split(jnp.asarray(mixer.pop("conv1d.weight")), [kd, 2 * kd], axis=0)
            mixer.update(dict(zip(CONVS, (q, k, v))))
        prefix = p + ("linear_attn." if kind == "delta" else "self_attn.")
        t.update({prefix + k: v for k, v in mixer.items()})
        t.update({p + "mlp." + k: v for k, v in layer["mlp"].items()})
    if not cfg.tie_word_embeddings:
        if params.get("lm_head") is None:
            raise CheckpointError("untied olmo_hybrid model has no lm_head")
        t["lm_head.weight"] = params["lm_head"]
    return t


def to_params(config: dict, tensors: dict) -> tuple[Config, dict]:
    """HF config dict + tensors (any of HF's forms, ``standard_form``) -> ``(Config, params)``
    after strict checks."""
    try:
        cfg = Config.from_hf(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"olmo_hybrid config: {e}") from e
    return params_from_hf(Config, expected_shapes, params_from_tensors, config, standard_form(cfg, tensors),
                          "olmo_hybrid")


def from_params(cfg: Config, params: dict) -> tuple[dict, dict]:
    """``(Config, params)`` -> HF ``(config dict, numpy tensors)``."""
    return hf_from_params(cfg, tensors_from_params(cfg, params), expected_shapes, "olmo_hybrid")


def init_rule(name: str, shape: tuple, g: np.random.Generator) -> np.ndarray:
    """Bamba's rules; the DeltaNet's decays and gated-norm weight at HF-like scales."""
    if name.endswith("A_log"):
        return np.log(g.uniform(0.5, 8.0, shape))
    if name.endswith("dt_bias"):
        return g.uniform(-1.0, 1.0, shape)
    if name.endswith(("o_norm.weight", "q_norm.weight", "k_norm.weight", "layer_norm.weight")):
        return 1.0 + 0.1 * g.standard_normal(shape)
    return bamba_init_rule(name, shape, g)


def init_params(cfg: Config, key, dtype=jnp.float32) -> dict:
    """Random parameters in the layout of ``LM``, drawn from the shape table."""
    return init_from_table(cfg, expected_shapes, init_rule, params_from_tensors, key, dtype)


__all__ = ["STORED_NORMS", "CONVS", "delta_shapes", "attention_shapes", "layer_norm_names", "expected_shapes",
           "standard_form", "params_from_tensors", "tensors_from_params", "to_params", "from_params", "init_rule",
           "init_params"]
