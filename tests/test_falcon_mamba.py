"""Falcon-Mamba beyond the conformance suite: the layout of the released checkpoint
(falcon-mamba-7b: untied embeddings, no projection biases, conv bias, ``d_inner = 2 d``,
``dt`` rank ``d / 16``, state 16, conv 4, ``mixer_rms_eps`` 1e-6) scaled down, and a check
that the weightless norms on ``dt``, ``B`` and ``C`` are what makes our model match torch."""
from __future__ import annotations

import dataclasses

import numpy as np

import implicit_attn as ia
from implicit_attn.families import falcon_mamba, mamba
from conftest import torch_or_skip

D = 32
RELEASED_RATIOS = dict(vocab_size=64, hidden_size=D, expand=2, time_step_rank=D // 16, state_size=16, conv_kernel=4,
                       num_hidden_layers=2, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
                       mixer_rms_eps=1e-6, layer_norm_epsilon=1e-5)


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(1).integers(0, 64, (2, 13))
    report = assert_hf_parity("falcon_mamba", RELEASED_RATIOS, ids)
    assert report["logits"] <= 1e-4
    assert max(report["exactness"]["full"]) <= 1e-5 and max(report["exactness"]["no_conv"]) <= 1e-5


def test_the_norms_on_dt_b_c_are_needed_to_match_torch(tmp_path):
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model

    tm = build_hf_model("falcon_mamba", RELEASED_RATIOS, path=tmp_path)
    model = ia.load(tmp_path)
    assert isinstance(model, falcon_mamba.LM) and model.config.bcdt_norm_eps == 1e-6
    ids = np.random.default_rng(2).integers(0, 64, (1, 9))
    with torch.no_grad():
        want = tm(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), want, atol=1e-4)
    # The same weights through plain Mamba (no norms) are far from torch: the parity checks
    # of the conformance suite would see a missing norm.
    fields = {f.name: getattr(model.config, f.name) for f in dataclasses.fields(mamba.Config)}
    plain = mamba.LM(mamba.Config(**fields), model.params())
    assert np.abs(np.asarray(plain(ids)) - want).max() > 1e-2
