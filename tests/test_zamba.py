"""Zamba (v1) beyond the conformance suite: the multi-head Mamba mixer (HF's interleaved
``in_proj``, per-head ``x_proj`` / ``dt_proj``) equals HF's per head and its operator puts the
heads side by side; Zamba-7B-v1's layout scaled down (HF's default pattern from
``attn_layer_period`` / ``offset``); the one shared block is used by every hybrid layer; bad
config values are named (the attention operator against HF's: ``test_zamba2.py``)."""
from __future__ import annotations

import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import mamba, zamba
from implicit_attn.operator import ParallelCore
from conftest import torch_or_skip

# Zamba-7B-v1's ratios scaled down: HF's default layer pattern (76 layers there, 13 here:
# hybrids at 2, 7, 13 - 1), two Mamba heads, MLP 4x wide, MHA
ZAMBA_7B = dict(vocab_size=64, hidden_size=32, intermediate_size=128, num_hidden_layers=13, num_attention_heads=4,
                num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)


def test_default_layer_pattern_is_hfs():
    torch, transformers = torch_or_skip()
    cfg = zamba.Config.from_hf(ZAMBA_7B)
    hf = transformers.ZambaConfig(**ZAMBA_7B)
    assert [{"mamba": "linear_attention"}.get(t, t) for t in cfg.layers_block_type] == list(hf.layers_block_type)
    assert cfg.layers_block_type[:3] == ("mamba", "mamba", "hybrid") and cfg.hybrid_layer_ids == (2, 7)
    assert cfg.mamba_dt_rank == 2 and cfg.head_dim == 16 and cfg.attention_scale == 8 ** -0.5


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(1).integers(0, 64, (2, 17))
    report = assert_hf_parity("zamba", ZAMBA_7B, ids)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 15
    assert max(report["exactness"]["full"]) <= 1e-5 and max(report["exactness"]["no_conv"]) <= 1e-5


def test_heads_are_mamba_mixers_side_by_side(tmp_path):
    """Each head's block of the operator is a Mamba-1 operator with the head's own B and C:
    the heads' operators differ, and the layer's is theirs in order (``ParallelCore``)."""
    torch_or_skip()
    from implicit_attn.testing import build_hf_model

    build_hf_model("zamba", None, path=tmp_path)
    model = ia.load(tmp_path)
    ids = np.random.default_rng(2).integers(0, 64, (1, 10))
    op = model.operators(ids, layers=[0])[0]
    assert isinstance(op.core, ParallelCore) and len(op.core.parts) == 2 and op.shape == (1, 32, 10, 10)
    H = np.asarray(op.materialize())
    mc = model.config.mixer_config
    x = model.mixer_inputs(ids, layers=[0])[0]
    for k in range(2):
        own = mamba.mixer_operator(zamba.head_params(model.layers[0].mixer.arrays(), mc, k), x, mc.head_config)
        np.testing.assert_allclose(H[:, 16 * k:16 * (k + 1)], np.asarray(own.materialize()), atol=1e-6)
    assert not np.allclose(H[:, :16], H[:, 16:])
    # the gate and per-state log decay of every channel, head by head
    gate = op.core.named_factors()["gate"]
    assert gate.shape == (1, 32, 10) and op.core.named_factors()["log_decay"].shape == (1, 32, 10, 4)
    np.testing.assert_allclose(np.asarray(op.materialize(channels=[3, 20, 5])), H[:, [3, 20, 5]], atol=1e-6)


def test_one_shared_block_serves_every_hybrid_layer(tmp_path):
    torch_or_skip()
    from implicit_attn.testing import build_hf_model

    build_hf_model("zamba", None, path=tmp_path)
    model = ia.load(tmp_path)
    assert len(model.shared_blocks) == 1 and model.config.layer_types == ("mamba", "attention", "mamba",
                                                                          "attention", "mamba")
    assert model.layers[1].block is model.layers[3].block is model.shared_blocks[0]


@pytest.mark.parametrize("bad, msg", [
    (dict(num_hidden_layers=4), r"num_hidden_layers \(4\) must equal the number of layers_block_type entries \(3\)"),
    (dict(layers_block_type=None, num_hidden_layers=2), r"num_hidden_layers \(2\) must equal"),
    (dict(layers_block_type=["mamba", "attention", "hybrid"]), "layers_block_type"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(attention_hidden_size=24), "attention_hidden_size"),
    (dict(n_mamba_heads=3), "n_mamba_heads"),
    (dict(hidden_act="silu"), "hidden_act"),
    (dict(hidden_mamba_act="gelu"), "hidden_mamba_act"),
    (dict(attn_layer_period=0), "attn_layer_period"),
])
def test_bad_config_values_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        zamba.Config.from_hf({**zamba.SPEC.tiny, **bad})
