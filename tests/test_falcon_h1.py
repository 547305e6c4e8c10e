"""Falcon-H1 beyond the conformance suite: the layout of the released Falcon-H1 models
(Mamba width 1.5x the model width, GQA 4:1, head_dim 64, one Mamba group, muP multipliers)
scaled down; the Mamba path without its output norm and with the norm after the gate; the
layer operator holds both paths (its first channels are the Mamba-2 operator of the Mamba
path alone, the others HF's attention probabilities, and projecting its output gives the
layer's mixer output); bad config values are named."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import falcon_h1, mamba2
from conftest import torch_or_skip

RELEASED_RATIOS = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16, mamba_d_ssm=96, mamba_n_heads=6,
                       mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=False,
                       mamba_norm_before_gate=False, rope_theta=1e11, embedding_multiplier=5.6,
                       lm_head_multiplier=0.04, key_multiplier=0.4, attention_in_multiplier=1.0,
                       attention_out_multiplier=0.9, ssm_in_multiplier=1.25, ssm_out_multiplier=0.24,
                       mlp_multipliers=[0.88, 0.59], ssm_multipliers=[0.35, 0.25, 0.51, 0.49, 0.24])


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(1).integers(0, 64, (2, 17))
    report = assert_hf_parity("falcon_h1", RELEASED_RATIOS, ids)
    assert report["logits"] <= 1e-4
    assert max(report["exactness"]["full"]) <= 1e-5 and max(report["exactness"]["no_conv"]) <= 1e-5


@pytest.mark.parametrize("norm", [dict(mamba_rms_norm=False), dict(mamba_rms_norm=True, mamba_norm_before_gate=False)],
                         ids=["no_norm", "gate_then_norm"])
def test_mamba_output_norm_settings_match_torch(norm):
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(2).integers(0, 64, (2, 9))
    report = assert_hf_parity("falcon_h1", {**falcon_h1.SPEC.tiny, **norm}, ids)
    assert report["logits"] <= 1e-4 and max(report["exactness"]["full"]) <= 1e-5


def test_layer_operator_holds_both_paths(tmp_path):
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model

    tm = build_hf_model("falcon_h1", None, path=tmp_path)
    model = ia.load(tmp_path)
    cfg = model.config
    C, H, d = cfg.mamba_channels, cfg.num_attention_heads, cfg.head_dim
    ids = np.random.default_rng(3).integers(0, 64, (1, 9))
    x = model.mixer_inputs(ids, layers=[1])[1]
    op = model.operators(ids, layers=[1])[0]
    assert op.shape == (1, C + H * d, 9, 9) and op.relative_error() <= 1e-5
    params = model.layers[1].mixer.arrays()
    mamba = {k[len("mamba."):]: v for k, v in params.items() if k.startswith("mamba.")}
    alone = mamba2.block.mixer_operator(mamba, x, cfg.mixer_config)
    dense = np.asarray(op.materialize())
    np.testing.assert_allclose(dense[:, :C], np.asarray(alone.materialize()), atol=1e-6)
    # the attention channels: HF's eager probabilities, head h repeated over its d value features
    tm.set_attn_implementation("eager")
    with torch.no_grad():
        probs = tm(torch.as_tensor(ids), output_attentions=True, use_cache=False).attentions[1].numpy()
    np.testing.assert_allclose(dense[:, C:], np.repeat(probs, d, axis=1), atol=1e-6)
    # a selection across both paths, out of order; concrete and traced (blocked reductions, jit)
    # (reduce against materialize: the conformance suite's deep tier)
    mixed = [C - 1, C, C + d + 3, 0]
    np.testing.assert_allclose(np.asarray(op.materialize(channels=mixed)), dense[:, mixed], atol=1e-6)
    traced = jax.jit(lambda core, i: core.dense(i))(op.core, jnp.asarray(mixed))
    np.testing.assert_allclose(np.asarray(traced), dense[:, mixed], atol=1e-6)
    # the mixer output is the sum of the two paths' projections of the operator output
    y = np.asarray(op.apply())[0]  # (C + H d, L)
    heads = y[C:].reshape(H, d, 9).transpose(2, 0, 1).reshape(9, H * d)  # channel C + h d + k -> (t, h d + k)
    out = (cfg.ssm_out_multiplier * y[:C].T @ np.asarray(params["mamba.out_proj.weight"]).T
           + cfg.attention_out_multiplier * heads @ np.asarray(params["self_attn.o_proj.weight"]).T)
    np.testing.assert_allclose(out, np.asarray(model.layers[1].mixer(x))[0], atol=1e-5)


@pytest.mark.parametrize("bad, msg", [
    (dict(mlp_multipliers=[1.0]), "mlp_multipliers"),
    (dict(ssm_multipliers=[1.0, 1.0, 1.0, 1.0, float("nan")]), "ssm_multipliers"),
    (dict(mamba_d_head=5), "mamba_d_head"),
    (dict(mamba_n_groups=3), "mamba_n_groups"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(time_step_limit=[0.5, 0.1]), "time_step_limit"),
])
def test_bad_config_values_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        falcon_h1.Config.from_hf({**falcon_h1.SPEC.tiny, **bad})
