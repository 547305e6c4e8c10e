"""MiniMax beyond the conformance suite: the decay rates against HF's buffers (one layer included),
the lightning attention against HF's block-wise computation at lengths around and past its
``block_size``, the norm and gate as left diagonals of the operator (from torch's own
intermediates), the stored decay tables, the softmax attention's sliding window, and the config
fields HF ignores, refused where they would change the math."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import minimax
from implicit_attn.families.minimax import naive
from weights_convert import CheckpointError, read_hf_dir, write_hf_dir

from conftest import torch_or_skip

TINY = minimax.SPEC.tiny


@pytest.mark.parametrize("heads,layers", [(4, 1), (4, 3), (6, 5), (3, 2), (64, 80)])
def test_slopes_are_hf_buffers(heads, layers):
    """``slope_rates`` and the float64 reference's ``naive.slopes`` against the ``slope_rate``
    buffer HF builds for every layer, to float32 rounding (HF takes the powers in float32; with one
    layer HF's factor is ``1 + 1e-5``, not 1; the last layer of several decays at about ``1e-5`` of
    the first's rate)."""
    torch, transformers = torch_or_skip()
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    cfg = transformers.MiniMaxConfig(vocab_size=8, hidden_size=heads * 2, num_attention_heads=heads,
                                     num_key_value_heads=heads, num_hidden_layers=layers, block_size=4,
                                     layer_types=["linear_attention"] * layers)
    ours_cfg = minimax.Config.from_hf({**cfg.to_dict(), "model_type": "minimax"})
    for i in sorted({0, layers // 2, layers - 1}):
        want = MiniMaxLightningAttention(cfg, i).slope_rate.reshape(-1).numpy()
        np.testing.assert_allclose(minimax.slope_rates(heads, i, layers), want, rtol=1e-6, atol=0)
        np.testing.assert_allclose(naive.slopes(ours_cfg, i), want, rtol=1e-6, atol=0)
    if layers == 1:
        base = 2.0 ** (-8.0 / heads * np.arange(1, heads + 1))
        np.testing.assert_allclose(minimax.slope_rates(heads, 0, 1), base * (1 + 1e-5), rtol=1e-7)
    else:
        assert minimax.slope_rates(heads, layers - 1, layers)[0] < 1e-4 * minimax.slope_rates(heads, 0, layers)[0]


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_lightning_matches_hf_blocks_at_every_length(tmp_path, block_size):
    """HF computes the lightning attention in blocks of ``block_size`` (decayed inter-block state,
    masked intra-block products); ours (chunks of 64) and the operator agree with it at lengths
    below, at and past one block, not multiples of it, and over several blocks."""
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model, max_rel_error

    tm = build_hf_model("minimax", {**TINY, "block_size": block_size}, path=tmp_path)
    model = ia.load(tmp_path)
    g = np.random.default_rng(block_size)
    for L in (1, 4, 5, 9, 17):
        x = g.standard_normal((2, L, TINY["hidden_size"])).astype(np.float32)
        for i in (0, 2):  # the two lightning layers (different slopes)
            with torch.no_grad():
                want = tm.model.layers[i].self_attn(torch.as_tensor(x), None, None)[0].numpy()
            mixer = model.layers[i].mixer
            assert max_rel_error(mixer(x), want) <= 1e-5, (L, i)
            op = mixer.as_operator(x)
            assert op.relative_error() <= 1e-5, (L, i)
            ref = minimax.SPEC.naive_operator(mixer.arrays(), x, model.config, i)
            assert max_rel_error(op.materialize(), ref) <= 1e-5, (L, i)


def test_norm_and_gate_are_left_diagonals_from_torch(tmp_path):
    """The operator's left factor is ``w sigmoid(g) / rms(o)`` with ``o`` and ``g`` torch's own (the
    input of HF's ``norm`` and the output of ``output_gate``), its right factor ``sigmoid(v')``, and
    its output the input of HF's ``out_proj``; ``no_gate`` / ``no_norm`` drop one factor and are
    not exact."""
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model, max_rel_error

    tm = build_hf_model("minimax", None, path=tmp_path)
    model = ia.load(tmp_path)
    attn = tm.model.layers[0].self_attn
    seen = {}
    hooks = [attn.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("o", a[0].numpy().copy())),
             attn.output_gate.register_forward_hook(lambda m, a, o: seen.__setitem__("g", o.numpy().copy())),
             attn.out_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("y", a[0].numpy().copy()))]
    x = np.random.default_rng(5).standard_normal((2, 11, TINY["hidden_size"])).astype(np.float32)
    try:
        with torch.no_grad():
            attn(torch.as_tensor(x), None, None)
    finally:
        for h in hooks:
            h.remove()
    w = attn.norm.weight.detach().numpy().astype(np.float64)
    o, gate = seen["o"].astype(np.float64), 1.0 / (1.0 + np.exp(-seen["g"].astype(np.float64)))
    inv = 1.0 / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-6)
    T = lambda a: np.swapaxes(a, 1, 2)
    op = model.layers[0].mixer.as_operator(x)
    assert max_rel_error(op.core.left, T(w * gate * inv)) <= 1e-5
    assert max_rel_error(op.output, T(seen["y"])) <= 1e-5
    d = TINY["head_dim"]
    with torch.no_grad():
        v_pre = attn.qkv_proj(torch.as_tensor(x)).numpy().reshape(2, 11, 4, 3 * d)[..., 2 * d:].reshape(2, 11, -1)
    assert max_rel_error(op.core.right, T(1.0 / (1.0 + np.exp(-v_pre)))) <= 1e-5
    assert max_rel_error(op.values, T(v_pre)) <= 1e-5
    for variant, left in (("no_gate", w * inv), ("no_norm", gate)):
        ab = model.layers[0].mixer.as_operator(x, variant)
        assert max_rel_error(ab.core.left, T(np.broadcast_to(left, o.shape))) <= 1e-5, variant
        assert ab.relative_error() > 1e-2, variant
    M = np.asarray(op.head_matrices())  # one matrix per head: (q_i . k_j) exp(-s_h (i - j))
    assert M.shape == (2, 4, 11, 11) and not np.triu(M, 1).any()


def test_stored_decay_tables(tmp_path):
    """HF saves ``slope_rate`` and three decay tables per lightning layer: a checkpoint without them
    loads the same model (slopes from HF's formula); a table that is not its slopes' is refused;
    ours keep ``slope_rate`` only, which HF reads back."""
    torch_or_skip()
    from implicit_attn.testing import build_hf_model

    build_hf_model("minimax", None, path=tmp_path / "hf")
    config, tensors = read_hf_dir(tmp_path / "hf")
    assert {"model.layers.0.self_attn.slope_rate", "model.layers.0.self_attn.diagonal_decay"} <= set(tensors)
    ids = np.random.default_rng(6).integers(0, 64, (2, 11))
    want = np.asarray(ia.load(tmp_path / "hf")(ids))
    bare = {k: v for k, v in tensors.items() if not k.endswith(("_decay", "slope_rate"))}
    write_hf_dir(tmp_path / "bare", config, bare)
    np.testing.assert_array_equal(np.asarray(ia.load(tmp_path / "bare")(ids)), want)
    bad = dict(tensors)
    bad["model.layers.2.self_attn.diagonal_decay"] = np.asarray(bad["model.layers.2.self_attn.diagonal_decay"]) * 1.01
    write_hf_dir(tmp_path / "bad", config, bad)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.diagonal_decay"):
        ia.load(tmp_path / "bad")
    ia.save(ia.load(tmp_path / "bare"), tmp_path / "ours")
    _, ours = read_hf_dir(tmp_path / "ours")
    assert "model.layers.0.self_attn.slope_rate" in ours and "model.layers.0.self_attn.query_decay" not in ours


@pytest.mark.parametrize("overrides", [dict(sliding_window=3, tie_word_embeddings=True),
                                       dict(num_hidden_layers=1, layer_types=["linear_attention"], head_dim=None),
                                       dict(layer_types=None, num_hidden_layers=2)],
                         ids=["window_tied", "one_layer", "hf_default_layers"])
def test_other_configs_match_torch(overrides):
    """A sliding window on the softmax attention with tied embeddings; a one-layer model (HF's slope
    factor ``1 + 1e-5``) with ``head_dim`` from ``hidden_size``; HF's default layer kinds."""
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(7).integers(0, 64, (2, 11))
    report = assert_hf_parity("minimax", {**TINY, **overrides}, ids)
    assert report["logits"] <= 1e-4 and max(report["exactness"]["full"]) <= 1e-5


def test_config_fields_hf_ignores_are_refused_where_they_change_the_math():
    base = {**TINY, "model_type": "minimax"}
    cfg = minimax.Config.from_hf(base)
    assert cfg.layer_types == ("lightning", "attention", "lightning") and cfg.head_dim == 6
    assert minimax.Config.from_hf(cfg.to_hf()) == cfg
    assert minimax.Config.from_hf({**base, "num_local_experts": None, "num_experts": 3}).num_local_experts == 3
    default = minimax.Config.from_hf({"vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 3,
                                       "num_attention_heads": 2, "num_key_value_heads": 1})
    assert default.layer_types == ("attention", "lightning", "attention")  # HF: softmax attention on even layers
    ok = {**base, "attn_type_list": [0, 1, 0], "postnorm": True, "layernorm_mlp_alpha": 1.3,
          "shared_intermediate_size": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}}
    assert minimax.Config.from_hf(ok).rope_theta == 1e7
    with pytest.warns(UserWarning, match="rotary_dim 2 is ignored"):
        minimax.Config.from_hf({**base, "rotary_dim": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minimax.Config.from_hf({**base, "rotary_dim": 6})
    bad = [({"postnorm": False}, "postnorm false"),
           ({"shared_intermediate_size": 16}, "shared expert"),
           ({"attn_type_list": [1, 1, 0]}, "attn_type_list"),
           ({"attn_type_list": [0, 1]}, "attn_type_list"),
           ({"layernorm_full_attention_alpha": 3.5}, "layernorm_full_attention_alpha"),
           ({"hidden_act": "gelu"}, "hidden_act"),
           ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
           ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
           ({"block_size": 0}, "block_size"),
           ({"sliding_window": 0}, "sliding_window"),
           ({"layer_types": ["linear_attention"] * 2}, "layer_types"),
           ({"mlp_beta_factor": "1"}, "mlp_beta_factor")]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            minimax.Config.from_hf({**base, **change})
    assert json.loads(json.dumps(cfg.to_hf()))["layer_types"] == TINY["layer_types"]


def test_long_input_past_hf_default_block_is_finite_and_exact(tmp_path):
    """HF's default ``block_size`` 256 and 16 heads (rates up to ``2^-0.5``: decays far below float32's
    range across the sequence) at ``L = 261``: the mixer equals HF's, ``H`` is finite, exact, and its
    rows equal the float64 formula."""
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model, max_rel_error

    config = {**TINY, "block_size": 256, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 2}
    tm = build_hf_model("minimax", config, path=tmp_path)
    model = ia.load(tmp_path)
    x = np.random.default_rng(8).standard_normal((1, 261, TINY["hidden_size"])).astype(np.float32)
    with torch.no_grad():
        want = tm.model.layers[0].self_attn(torch.as_tensor(x), None, None)[0].numpy()
    mixer = model.layers[0].mixer
    assert max_rel_error(mixer(x), want) <= 1e-5
    op = mixer.as_operator(x)
    H = np.asarray(op.materialize())
    assert np.isfinite(H).all() and op.relative_error() <= 1e-5
    ref = minimax.SPEC.naive_operator(mixer.arrays(), x, model.config, 0)
    rows = [0, 100, 255, 256, 260]
    assert max_rel_error(H[:, :, rows], ref[:, :, rows]) <= 1e-5
