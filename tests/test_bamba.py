"""Bamba beyond the conformance suite: the layout of the released Bamba-9B (a few attention
layers among Mamba-2 layers, GQA 4:1, one Mamba group, Mamba expand 2, MLP 3.5x, untied)
scaled down (4 layers, attention at layer 2, 8 Mamba heads of width d/4) on an input
spanning several chunks; and the attention layers' operator is
the softmax attention HF computes (rows sum to 1, half-width RoPE)."""
from __future__ import annotations

import numpy as np

import implicit_attn as ia
from implicit_attn.families import bamba
from conftest import torch_or_skip

RELEASED_RATIOS = dict(vocab_size=64, hidden_size=64, intermediate_size=224, num_hidden_layers=4,
                       attn_layer_indices=[2], num_attention_heads=4, num_key_value_heads=1, mamba_n_heads=8,
                       mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                       tie_word_embeddings=False)


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(1).integers(0, 64, (2, 19))
    report = assert_hf_parity("bamba", RELEASED_RATIOS, ids)
    assert report["logits"] <= 1e-4
    assert max(report["exactness"]["full"]) <= 1e-5 and max(report["exactness"]["no_conv"]) <= 1e-5


def test_attention_layer_operator_is_the_softmax_attention(tmp_path):
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model

    tm = build_hf_model("bamba", None, path=tmp_path)
    model = ia.load(tmp_path)
    assert isinstance(model, bamba.LM) and model.config.layer_types == ("mamba", "attention", "mamba")
    assert model.config.rotary_dim == model.config.head_dim // 2
    ids = np.random.default_rng(3).integers(0, 64, (1, 9))
    tm.set_attn_implementation("eager")  # the path that returns the probabilities
    with torch.no_grad():
        out = tm(torch.as_tensor(ids), output_attentions=True, use_cache=False)
    (want,) = [a.numpy() for a in out.attentions if a is not None]  # the one attention layer
    op = model.operators(ids, layers=[1])[0]
    H = np.asarray(op.materialize())
    assert H.shape == (1, 2, 9, 9)
    np.testing.assert_allclose(H.sum(-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(H, want, atol=1e-6)
