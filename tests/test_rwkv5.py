"""RWKV-5 ("Eagle", the RWKV team's HF ``Rwkv5ForCausalLM``): logits against BlinkDL's official
``rwkv`` package (the same random weights under its names, run in a subprocess, with the
eval-mode rescaling active), logits and every layer's mixer against the plain-torch reference
(``implicit_attn.testing.rwkv5_reference``), exact operators, ``H`` against a float64 operator
written from the formulas, the ``no_bonus`` ablation, a long input against a float64
recurrence, checkpoint round trips in training form, and the config's refusals."""
from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import rwkv5
import test_rwkv6_7 as rwkv6_7
from conftest import torch_or_skip
from test_rwkv6_7 import head_matrices, with_attn

# Official RWKV-5.2 scaled down: heads of 64, the official group-norm eps (head_size_divisor 8),
# three blocks; R = 1 rescales only in half precision (float32 here: none, as the official package)
OFFICIAL = dict(vocab_size=64, hidden_size=128, num_hidden_layers=3, head_size=64, intermediate_size=224,
                rescale_every=1)
needs_official = pytest.mark.skipif(importlib.util.find_spec("rwkv") is None,
                                    reason="the official rwkv package (test extra) is not installed")


def torch_model(config: dict, path=None, seed: int = 0, perturb: bool = True):
    """The torch reference of HF config kwargs ``config``: realistic random weights
    (``perturb_weights``) or the family's ``hf_setup``; saved to ``path`` if given."""
    torch, _ = torch_or_skip()
    from implicit_attn.testing import rwkv5_reference as ref

    torch.manual_seed(seed)
    model = ref.Rwkv5ForCausalLM(ref.Rwkv5Config(**config))
    if perturb:
        ref.perturb_weights(model, seed)
    else:
        rwkv5.hf_setup(model, torch, seed)
    if path is not None:
        model.save_pretrained(path)
    return model


def torch_logits(tm, ids):
    import torch

    with torch.no_grad():
        return tm(torch.as_tensor(np.asarray(ids)), use_cache=False).logits.numpy()


# ----------------------------------------------------------------------------- official package

@needs_official
def test_logits_match_the_official_package(tmp_path):
    from implicit_attn.testing.fla_rwkv import run_official
    from implicit_attn.testing.rwkv5_reference import official_logits, official_state_dict

    tm = torch_model(OFFICIAL, tmp_path)
    model = ia.load(tmp_path)
    cfg = model.config
    assert cfg.group_norm_eps == pytest.approx(64e-5) and cfg.rescale_period(jnp.float32) == 0
    ids = np.random.default_rng(3).integers(0, 64, (2, 13))
    ref = official_logits(tm, ids)
    ours = np.asarray(model(ids))
    assert ours.shape == ref.shape == (2, 13, 64)
    assert 1.0 < np.abs(ref).max() < 100.0
    assert np.abs(ours - ref).max() <= 1e-4
    assert np.abs(torch_logits(tm, ids) - ref).max() <= 1e-4
    # rescaled (as float16 runs it), the official package differs by more than the tolerance
    rescaled = run_official(official_state_dict(tm), ids, 5, rescale_layer=1)
    assert np.abs(rescaled - ref).max() > 1e-4
    for op in model.operators(ids):
        assert op.relative_error() <= 1e-5


@needs_official
def test_without_the_divisor_the_official_model_differs(tmp_path):
    """``head_size_divisor: 1`` (the earlier HF port) is a group norm with eps 1e-5, not the
    official 64e-5: the reference follows the config, the official package does not."""
    from implicit_attn.testing.rwkv5_reference import official_logits

    tm = torch_model({**OFFICIAL, "head_size_divisor": 1, "num_hidden_layers": 1}, tmp_path)
    ids = np.random.default_rng(4).integers(0, 64, (1, 9))
    ours = np.asarray(ia.load(tmp_path)(ids))
    assert np.abs(ours - torch_logits(tm, ids)).max() <= 1e-4
    assert np.abs(ours - official_logits(tm, ids)).max() > 1e-2


# ----------------------------------------------------------------------------- the torch reference

# (overrides of the tiny config, realistic weights (perturb_weights) or the family's hf_setup)
CASES = {"tiny": ({}, False),  # the family's tiny config: R = 2 over 3 blocks
         "tied_R1": (dict(tie_word_embeddings=True, rescale_every=1, intermediate_size=None), True),
         "old_port_no_rescale": (dict(head_size_divisor=1, rescale_every=0, layer_norm_epsilon=1e-3), True)}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_mixers_and_exactness_match_the_torch_reference(case, tmp_path):
    """Logits (L = 11 and L = 1), every layer's mixer input and its output on torch's input, every
    layer's operator exact; the residual stream between blocks is torch's hidden states."""
    from implicit_attn.testing import assert_hf_parity

    torch, _ = torch_or_skip()
    overrides, perturb = CASES[case]
    tm = torch_model({**rwkv5.SPEC.tiny, **overrides}, tmp_path, perturb=perturb)
    model = ia.load(tmp_path)
    ids = np.random.default_rng(0).integers(0, 64, (2, 11))
    report = assert_hf_parity(tm, input_ids=ids, jax_model=model)
    assert max(report["mixers"]) <= 1e-5 and max(report["exactness"]["full"]) <= 1e-5
    assert np.abs(np.asarray(model(ids[:, :1])) - torch_logits(tm, ids[:, :1])).max() <= 1e-4
    with torch.no_grad():
        hs = tm(torch.as_tensor(ids), output_hidden_states=True).hidden_states
    cache = model.run_with_cache(ids, [f"blocks.{i}.hook_resid_post" for i in range(len(model.layers))])[1]
    for i in range(len(model.layers)):
        np.testing.assert_allclose(np.asarray(cache[f"blocks.{i}.hook_resid_post"]), hs[i].numpy(), atol=1e-5)


def test_checkpoints_stay_in_training_form(tmp_path):
    """After a forward pass the torch model saves the same (unrescaled) weights; our save loads in
    the torch reference with the same logits."""
    torch, _ = torch_or_skip()
    from implicit_attn.testing.rwkv5_reference import Rwkv5ForCausalLM

    tm = torch_model(rwkv5.SPEC.tiny, tmp_path / "a", perturb=False)
    ids = np.random.default_rng(1).integers(0, 64, (1, 7))
    want = torch_logits(tm, ids)
    tm.save_pretrained(tmp_path / "b")
    a, b = ia.load(tmp_path / "a"), ia.load(tmp_path / "b")
    ta, tb = rwkv5.from_params(a.config, a.params())[1], rwkv5.from_params(b.config, b.params())[1]
    assert sorted(ta) == sorted(tb)
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)
    ia.save(a, tmp_path / "c")
    back = Rwkv5ForCausalLM.from_pretrained(tmp_path / "c")
    assert not back.training
    np.testing.assert_allclose(torch_logits(back, ids), want, atol=1e-5)


# ----------------------------------------------------------------------------- operators

def tiny_model(seed: int = 0, **overrides):
    return rwkv6_7.tiny_model("rwkv5", seed, **overrides)


def test_operator_matches_the_float64_operator():
    model = tiny_model()
    ids = np.random.default_rng(2).integers(0, 64, (2, 9))
    xs = model.mixer_inputs(ids)
    for i, op in enumerate(model.operators(ids)):
        mixer = model.layers[i].mixer
        want = rwkv5.naive_operator(mixer.arrays(), np.asarray(xs[i]), model.config, i)
        got = np.asarray(op.materialize())
        assert got.shape == want.shape == (2, 16, 9, 9)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), i
        assert op.relative_error() <= 1e-5


def test_no_bonus_is_the_matrix_without_u():
    """``no_bonus``'s ``M_h`` is the full operator's of the same model with ``time_faaaa = 0``;
    the two full operators differ only on the diagonal; ``no_gate`` keeps the output."""
    model = tiny_model()
    ids = np.random.default_rng(0).integers(0, 64, (2, 11))
    x = model.mixer_inputs(ids, [1])[1]
    mixer = model.layers[1].mixer
    full, ablated = mixer.as_operator(x), mixer.as_operator(x, "no_bonus")
    zero_u = with_attn(model, 1, time_faaaa=jnp.zeros_like(mixer.arrays()["time_faaaa"]))
    np.testing.assert_allclose(head_matrices(ablated), head_matrices(zero_u.layers[1].mixer.as_operator(x)),
                               atol=1e-6)
    diff = np.asarray(full.materialize()) - np.asarray(ablated.materialize())
    L = diff.shape[-1]
    assert np.abs(diff[..., ~np.eye(L, dtype=bool)]).max() == 0.0 and np.abs(diff).max() > 1e-3
    assert ablated.relative_error() > 1e-3 and full.relative_error() <= 1e-5
    no_gate = mixer.as_operator(x, "no_gate")
    # each variant's operator is its own compiled program: equal up to float32 rounding
    np.testing.assert_allclose(np.asarray(no_gate.output), np.asarray(full.output), atol=1e-6, rtol=1e-6)
    assert no_gate.relative_error() > 1e-3
    with pytest.raises(ValueError, match="variant"):
        mixer.as_operator(x, "no_low_rank")


def test_long_input_is_finite_and_exact_against_float64():
    """L = 1024 in one call with strong decays (down to ``e^-20`` per step) next to slow ones:
    the block output equals a float64 step-by-step recurrence and the operator is exact."""

    L = 1024
    model = tiny_model(num_hidden_layers=1)
    S = model.config.head_size
    decay = jnp.tile(jnp.linspace(-6.0, 3.0, S), (model.config.num_heads, 1))
    model = with_attn(model, 0, time_decay=decay)
    ids = np.random.default_rng(4).integers(0, 64, (1, L))
    x = model.mixer_inputs(ids, [0])[0]
    mixer = model.layers[0].mixer
    op = mixer.as_operator(x)
    out = np.asarray(op.output)
    assert np.isfinite(out).all() and op.relative_error() <= 1e-5
    p = {k: np.asarray(v, np.float64) for k, v in mixer.arrays().items()}
    f = rwkv5.naive.naive_parts(mixer.arrays(), np.asarray(x), model.config)
    o = rwkv6_7.recurrence64(f, after=False, low_rank=False)
    want = rwkv6_7.block_output64(f, o, p["ln_x.weight"], p["ln_x.bias"], model.config.group_norm_eps)
    got = out.transpose(0, 2, 1)
    assert np.abs(got - want).max() / np.abs(want).max() <= 2e-5
    assert np.isfinite(np.asarray(op.materialize(channels=[0]))).all()


# ----------------------------------------------------------------------------- config

def test_config_defaults_and_round_trip():
    cfg = rwkv5.Config.from_hf({"vocab_size": 8, "hidden_size": 768})
    assert (cfg.num_hidden_layers, cfg.head_size, cfg.num_heads) == (24, 64, 12)
    assert (cfg.attention_hidden_size, cfg.intermediate_size, cfg.rescale_every) == (768, 2688, 6)
    assert cfg.group_norm_eps == pytest.approx(64e-5) and not cfg.tie_word_embeddings
    assert rwkv5.Config.from_hf(cfg.to_hf()) == cfg
    # fields of the HF config the forward pass does not read are ignored
    d = {**cfg.to_hf(), "num_attention_heads": 64, "context_length": 4096, "use_cache": True}
    assert rwkv5.Config.from_hf(d) == cfg
    assert rwkv5.Config.from_hf({**d, "head_size_divisor": 1}).group_norm_eps == pytest.approx(1e-5)


@pytest.mark.parametrize("bad, msg", [({"attention_hidden_size": 64}, "must equal hidden_size"),
                                      ({"head_size": 48}, "multiple of head_size"),
                                      ({"head_size_divisor": 0}, "head_size_divisor"),
                                      ({"head_size": 0}, "head_size"),
                                      ({"intermediate_size": 0}, "intermediate_size"),
                                      ({"hidden_size": 8, "head_size": 4}, "set intermediate_size"),
                                      ({"rescale_every": 1.5}, "rescale_every"),
                                      ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
                                      ({"layer_norm_epsilon": -1.0}, "layer_norm_epsilon")])
def test_config_refusals(bad, msg):
    with pytest.raises(ValueError, match=msg):
        rwkv5.Config.from_hf({"vocab_size": 8, "hidden_size": 128, **bad})


def test_reference_and_checkpoint_refusals(tmp_path):
    torch_or_skip()
    from implicit_attn.testing import rwkv5_reference as ref

    with pytest.raises(ValueError, match="must equal hidden_size"):
        ref.Rwkv5ForCausalLM(ref.Rwkv5Config(vocab_size=8, hidden_size=16, head_size=8, attention_hidden_size=8))
    with pytest.raises(ValueError, match="multiple of head_size"):
        ref.Rwkv5ForCausalLM(ref.Rwkv5Config(vocab_size=8, hidden_size=16, head_size=6))
    cfg = rwkv5.Config(**rwkv5.SPEC.tiny)
    config, tensors = rwkv5.from_params(cfg, rwkv5.init_params(cfg, 0))
    del tensors["rwkv.blocks.1.attention.time_faaaa"]
    with pytest.raises(ia.CheckpointError, match="time_faaaa"):
        rwkv5.to_params(config, tensors)
    with pytest.raises(ValueError, match="time-mix input"):
        tiny_model().layers[0].mixer(np.zeros((1, 4, 8), np.float32))


def test_rescaling_runs_in_half_precision_only(tmp_path):
    """As the RWKV team's code: in bfloat16 the residual stream leaving block ``i`` is halved
    after every ``rescale_every``-th block (here every block: ``2^-(i+1)`` of float32's), with the
    output weights divided to match; in float32 nothing is rescaled."""
    torch_model(OFFICIAL, tmp_path)
    full = ia.load(tmp_path)
    half = ia.load(tmp_path, dtype=jnp.bfloat16)
    assert full.config.rescale_period(jnp.float32) == 0 and half.config.rescale_period(jnp.bfloat16) == 1
    ids = np.random.default_rng(6).integers(0, 64, (1, 7))
    names = [f"blocks.{i}.hook_resid_post" for i in range(3)]
    a, b = full.run_with_cache(ids, names)[1], half.run_with_cache(ids, names)[1]
    for i, n in enumerate(names):
        x, y = np.asarray(a[n], np.float64), np.asarray(b[n], np.float64) * 2 ** (i + 1)
        assert np.abs(x - y).max() <= 0.05 * np.abs(x).max(), i
    logits_full, logits_half = np.asarray(full(ids)), np.asarray(half(ids))
    assert np.abs(logits_full - logits_half).max() <= 0.05 * np.abs(logits_full).max()
