"""LaraMini beyond the conformance suite: Lara-4-Mini's layout scaled down, the sliding window
and the full layers' missing positional encoding in the operators, both checkpoint forms
(the released fused ``in_proj`` and transformers' state-dict names), and the config's forms."""
from __future__ import annotations

import numpy as np
import pytest

from implicit_attn.families import lara_mini
from implicit_attn.nn import CheckpointError
from conftest import torch_or_skip

# Lara-4-Mini: 34 layers of the period-5 pattern, 16 heads (4 KV) of 128, window 512, 8 key / 16
# value DeltaNet heads of 128, 128 experts (4 per token), tied; here 10 layers at width 32, window 5
LARA_4_MINI = dict(vocab_size=64, hidden_size=32, num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=8, sliding_window=5, linear_conv_kernel_dim=4, linear_key_head_dim=4,
                   linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
                   num_experts_per_tok=4, moe_intermediate_size=8, shared_expert_intermediate_size=8)


def tiny_model(seed: int = 0):
    cfg = lara_mini.Config.from_hf(lara_mini.SPEC.tiny)
    return lara_mini.LM(cfg, lara_mini.init_params(cfg, seed))


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    cfg = lara_mini.Config.from_hf(LARA_4_MINI)
    assert cfg.layer_types == ("delta", "sliding", "delta", "attention", "sliding") * 2 and cfg.tie_word_embeddings
    ids = np.random.default_rng(1).integers(0, 64, (2, 17))
    report = assert_hf_parity("lara_mini", LARA_4_MINI, ids)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 10
    assert max(report["exactness"]["full"]) <= 1e-5


def test_sliding_layers_attend_within_the_window_and_full_layers_without_positions():
    """A sliding layer's operator is exactly zero at distance >= ``sliding_window`` and not below
    it; a full layer's reaches every earlier key. With one input at every position, a full layer
    (no positional encoding) gives every earlier key the same weight, a sliding layer (RoPE) does not."""
    model = tiny_model()
    W = model.config.sliding_window
    L = 12
    ids = np.random.default_rng(2).integers(0, 64, (2, L))
    xs = model.mixer_inputs(ids)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    for layer, kind in enumerate(model.config.layer_types):
        if kind == "delta":
            continue
        H = np.asarray(model.layers[layer].mixer.as_operator(xs[layer]).materialize())
        assert H.shape == (2, model.config.num_attention_heads, L, L)
        far = (i - j >= (W if kind == "sliding" else L)) | (j > i)
        assert not H[..., far].any() and (H[..., ~far] > 0).all(), (layer, kind)
    same = np.broadcast_to(np.asarray(xs[3])[:1, :1], (1, L, model.config.hidden_size))  # one input everywhere
    full = np.asarray(model.layers[3].mixer.as_operator(same).materialize())[0]
    np.testing.assert_allclose(full[:, -1], 1.0 / L, rtol=1e-5)  # uniform over the L keys
    sliding = np.asarray(model.layers[1].mixer.as_operator(same).materialize())[0]
    assert np.ptp(sliding[:, -1, L - W:], axis=-1).min() > 1e-3


def test_transformers_state_dict_names_load_as_the_stored_form():
    """The four projections transformers' module holds (``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, rows of the stored ``in_proj`` in that order) and its ``norm``
    load into the same parameters; a partial set, or both forms at once, is a named error."""
    model = tiny_model()
    cfg = model.config
    config, tensors = lara_mini.from_params(cfg, model.params())
    a = "model.layers.0.linear_attn."
    fused = tensors[a + "in_proj.weight"]
    conv, vd, Hv = 2 * cfg.key_dim + cfg.value_dim, cfg.value_dim, cfg.linear_num_value_heads
    assert fused.shape == (conv + vd + 2 * Hv, cfg.hidden_size)
    other = dict(tensors)
    for k in ("model.layers.0.linear_attn.", "model.layers.2.linear_attn."):
        parts = np.split(other.pop(k + "in_proj.weight"), np.cumsum([conv, vd, Hv]))
        other.update({k + n: p for n, p in zip(lara_mini.checkpoint.SPLIT_PROJECTIONS, parts)})
        other[k + "norm.weight"] = other.pop(k + "out_norm.weight")
    _, params = lara_mini.to_params(config, other)
    _, again = lara_mini.from_params(cfg, params)
    assert set(again) == set(tensors)
    for k in tensors:
        np.testing.assert_array_equal(again[k], tensors[k])
    partial = {k: v for k, v in other.items() if k != a + "in_proj_b.weight"}
    with pytest.raises(CheckpointError, match=r"layer 0 has .*in_proj_qkv.weight.*either in_proj.weight or all of"):
        lara_mini.to_params(config, partial)
    with pytest.raises(CheckpointError, match=r"layer 0 has .* and in_proj.weight"):
        lara_mini.to_params(config, {**other, a + "in_proj.weight": fused})
    short = {**other, a + "in_proj_z.weight": other[a + "in_proj_z.weight"][:, :-1]}
    with pytest.raises(CheckpointError, match="must be matrices of one input width"):
        lara_mini.to_params(config, short)


def test_config_forms():
    """HF's default pattern of period 5, ``rope_parameters`` read and written, tied by default;
    a null window, another RoPE type and bad head counts are named errors."""
    cfg = lara_mini.Config.from_hf(dict(vocab_size=64, hidden_size=16, num_hidden_layers=7, head_dim=8,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert cfg.layer_types == ("delta", "sliding", "delta", "attention", "sliding", "delta", "sliding")
    assert cfg.rope_theta == 5e5 and cfg.tie_word_embeddings and cfg.window("attention") > 2 ** 30
    assert cfg.rope_frequencies("attention").shape == (0,) and cfg.rope_frequencies("sliding").shape == (4,)
    d = cfg.to_hf()
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5} and d["layer_types"][3] == "full_attention"
    assert lara_mini.Config.from_hf(d) == cfg
    for bad, match in ((dict(sliding_window=None), "sliding_window null"),
                       (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type 'yarn'"),
                       (dict(linear_num_value_heads=3), "linear_num_value_heads"),
                       (dict(num_experts_per_tok=200), "num_experts_per_tok"),
                       (dict(layer_types=["linear_attention", "mamba"] + ["full_attention"] * 5), "layer_types")):
        with pytest.raises(ValueError, match=match):
            lara_mini.Config.from_hf({**d, **bad})


def test_layers_are_causal():
    """The layer output at position t does not move when the input after t does (the window, the
    experts' routing and the DeltaNet's conv included)."""
    model = tiny_model(1)
    g = np.random.default_rng(3)
    h = g.standard_normal((1, 10, model.config.hidden_size)).astype(np.float32)
    h2 = h.copy()
    h2[:, 6:] = g.standard_normal(h2[:, 6:].shape)
    for layer in model.layers:
        a, b = np.asarray(layer(h)), np.asarray(layer(h2))
        np.testing.assert_array_equal(a[:, :6], b[:, :6])
        assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-4


def test_hf_default_config_is_lara_4_mini_and_counts_as_hf():
    """transformers' default ``LaraMiniConfig`` (Lara-4-Mini-Base's): 34 layers, 14 DeltaNet, 13
    sliding, 7 full; our shape table holds as many parameters as HF's model (7.28 B, built on the
    meta device) and the config reads back equal."""
    torch, transformers = torch_or_skip()
    hf = transformers.LaraMiniConfig()
    cfg = lara_mini.Config.from_hf(hf.to_dict())
    assert [cfg.layer_types.count(k) for k in ("delta", "sliding", "attention")] == [14, 13, 7]
    req, _ = lara_mini.expected_shapes(cfg)
    with torch.device("meta"):
        model = transformers.LaraMiniForCausalLM(hf)
    assert sum(int(np.prod(s)) for s in req.values()) == sum(p.numel() for p in model.parameters()) == 7_281_684_672
    assert lara_mini.Config.from_hf(cfg.to_hf()) == cfg
