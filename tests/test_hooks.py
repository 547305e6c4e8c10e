"""Hooks, caches, gradients and attention interventions, on every registered family.

References: the HF torch model (hidden states and input-embedding gradients), the float64
operator of each family's ``naive.py`` (the exact change of a knockout), and the model's own
clean run (patching a whole activation from another input must give that input's logits).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn import AttentionEdit
from implicit_attn.registry import FAMILIES

from hf_build import build_hf

L = 11
FAMILY_IDS = sorted(FAMILIES)
# The cache's run and the plain forward are separately compiled programs: equal up to float32
# rounding, which differs by CPU (xLSTM's logits 1.4e-6 apart on an AVX2-only EPYC, within 1e-6 on
# AVX-512 Xeons).
SEPARATELY_COMPILED = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=FAMILY_IDS)
def fam(request, tmp_path_factory):
    spec = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    tm = build_hf(spec.model_type, path, num_hidden_layers=3)
    model = ia.load(path)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, L))
    logits, cache = model.run_with_cache(ids)
    return spec, tm, model, ids, logits, cache


def test_cache_has_every_documented_name_and_the_forward_values(fam):
    spec, tm, model, ids, logits, cache = fam
    n = len(model.layers)
    forward = model.hook_names(operator_points=False)
    assert forward[0] == "hook_embed" and set(forward) <= set(cache)
    assert not any(k.endswith("hook_pattern") for k in cache)  # only by name
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model(ids)), **SEPARATELY_COMPILED)
    xs = model.mixer_inputs(ids)
    ops = model.operators(ids)
    for i in range(n):
        np.testing.assert_allclose(np.asarray(cache[f"blocks.{i}.mixer.hook_in"]), np.asarray(xs[i]), **SEPARATELY_COMPILED)
        np.testing.assert_allclose(np.asarray(cache[f"blocks.{i}.mixer.hook_out"]), np.asarray(ops[i].output),
                                   **SEPARATELY_COMPILED)
        np.testing.assert_allclose(np.asarray(cache[f"blocks.{i}.mixer.hook_values"]), np.asarray(ops[i].values),
                                   **SEPARATELY_COMPILED)
        if i + 1 < n:
            np.testing.assert_array_equal(np.asarray(cache[f"blocks.{i}.hook_resid_post"]),
                                          np.asarray(cache[f"blocks.{i + 1}.hook_resid_pre"]))
    # every implicit layer exposes its gate and log decay (a short convolution has no decay)
    kinds = [type(op.core).__name__ for op in ops]
    for i, k in enumerate(kinds):
        if k != "AttentionCore":
            points = {"hook_gate"} | (set() if k == "ShortConvCore" else {"hook_log_decay"})
            assert {f"blocks.{i}.mixer.{p}" for p in points} <= set(cache), k


def test_residual_stream_equals_torch_hidden_states(fam):
    torch = pytest.importorskip("torch")
    spec, tm, model, ids, logits, cache = fam
    with torch.no_grad():
        hs = tm(torch.tensor(ids), output_hidden_states=True, use_cache=False).hidden_states
    # HF families index hidden_states differently (before or after each layer; the last
    # one may be normed): every residual stream between two layers must be one of them
    hs = [h.numpy() for h in hs]
    for i in range(len(model.layers) - 1):
        ours = np.asarray(cache[f"blocks.{i}.hook_resid_post"], np.float32)
        err = min(float(np.abs(ours - h).max()) if h.shape == ours.shape else np.inf for h in hs)
        assert err <= 1e-5 * max(1.0, np.abs(ours).max()), (i, err)


def test_pattern_by_name_and_predicates(fam):
    spec, tm, model, ids, logits, cache = fam
    _, c = model.run_with_cache(ids, names=["blocks.0.mixer.hook_pattern", "blocks.1.hook_resid_pre"])
    assert set(c) == {"blocks.0.mixer.hook_pattern", "blocks.1.hook_resid_pre"}
    np.testing.assert_allclose(np.asarray(c["blocks.0.mixer.hook_pattern"]),
                               np.asarray(model.operators(ids, [0])[0].materialize()), atol=1e-6)
    _, c = model.run_with_cache(ids, names=lambda n: n.endswith("mixer.hook_in"))
    assert sorted(c) == [f"blocks.{i}.mixer.hook_in" for i in range(len(model.layers))]
    with pytest.raises(ValueError, match="unknown hook name"):
        model.run_with_cache(ids, names=["blocks.0.hook_nothing"])
    with pytest.raises(ValueError, match="unknown forward hook"):
        model.run_with_hooks(ids, adds={f"blocks.{len(model.layers)}.hook_resid_pre": np.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        model.run_with_hooks(ids, adds={"blocks.0.mixer.hook_out": np.zeros((2, 1, L), np.float32)})


def test_patching_a_whole_activation_gives_the_other_inputs_logits(fam):
    spec, tm, model, ids, logits, cache = fam
    other = (ids + 1) % model.config.vocab_size
    want = np.asarray(model(other))
    _, oc = model.run_with_cache(other)  # same names as the fixture's run: no new compile
    # the embeddings too: Zamba2's shared blocks read them besides the residual stream
    names = ("hook_embed", "blocks.1.hook_resid_pre")
    got = model.run_with_hooks(ids, sets={n: oc[n] for n in names})
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # patching only the last position changes only the last position's logits
    part = {n: jnp.asarray(cache[n]).at[:, -1].set(oc[n][:, -1]) for n in names}
    got = np.asarray(model.run_with_hooks(ids, sets=part))
    np.testing.assert_allclose(got[:, :-1], np.asarray(logits)[:, :-1], atol=1e-5, rtol=1e-5)
    assert np.abs(got[:, -1] - np.asarray(logits)[:, -1]).max() > 1e-4


def test_embedding_gradients_equal_torch(fam):
    torch = pytest.importorskip("torch")
    spec, tm, model, ids, logits, cache = fam
    t = int(ids[0, -1])
    g = model.gradients(ids, lambda lg: lg[0, -1, t] - lg[1, -2, t], ["hook_embed", "blocks.1.mixer.hook_out"])
    assert g["blocks.1.mixer.hook_out"].shape == cache["blocks.1.mixer.hook_out"].shape
    # the gradient at the embedding module's output in torch's own forward from ids (HF
    # Falcon-H1 multiplies the embeddings only when given ids, not inputs_embeds)
    kept = {}

    def keep(module, args, out):
        out.retain_grad()
        kept["emb"] = out

    handle = tm.get_input_embeddings().register_forward_hook(keep)
    try:
        out = tm(torch.tensor(ids), use_cache=False).logits
    finally:
        handle.remove()
    (out[0, -1, t] - out[1, -2, t]).backward()
    tm.zero_grad()
    ref = kept["emb"].grad.numpy()
    np.testing.assert_allclose(np.asarray(g["hook_embed"]), ref, atol=1e-5 * np.abs(ref).max(), rtol=1e-4)
    assert np.abs(ref).max() > 0


def test_knockout_changes_the_mixer_output_by_minus_h_v(fam):
    spec, tm, model, ids, logits, cache = fam
    layer, j = 1, 4
    x = np.asarray(cache[f"blocks.{layer}.mixer.hook_in"])
    H = spec.naive_operator(model.layers[layer].mixer.arrays(), x, model.config, layer)  # float64 (B, C, L, L)
    v = np.asarray(cache[f"blocks.{layer}.mixer.hook_values"], np.float64)
    C = H.shape[1]
    chans = [0, C - 1]
    adds = model.attention_edits(ids, [AttentionEdit(layer, keys=[j], channels=chans)])
    _, edited = model.run_with_cache(ids, names=[f"blocks.{layer}.mixer.hook_out"], adds=adds)
    change = np.asarray(edited[f"blocks.{layer}.mixer.hook_out"], np.float64) - \
        np.asarray(cache[f"blocks.{layer}.mixer.hook_out"], np.float64)
    want = np.zeros_like(change)
    Hj, vj = H[:, chans][:, :, :, j], v[:, chans][:, :, j]  # (B, 2, L), (B, 2) or (B, 2, d)
    if v.ndim == 3:
        want[:, chans] = -Hj * vj[:, :, None]
    else:  # attention heads: values (B, H, L, d)
        want[:, chans] = -Hj[..., None] * vj[:, :, None, :]
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(change, want, atol=2e-5 * np.abs(want).max())
    # the logits: unchanged before the key, changed after; scale 1 changes nothing
    ko = np.asarray(model.knockout(ids, layer, keys=j, channels=chans))
    np.testing.assert_allclose(ko[:, :j], np.asarray(logits)[:, :j], atol=1e-5)
    assert np.abs(ko[:, j:] - np.asarray(logits)[:, j:]).max() > 1e-5
    same = model.scale_attention(ids, [AttentionEdit(layer, keys=j, scale=1.0)])
    np.testing.assert_allclose(np.asarray(same), np.asarray(logits), atol=1e-5)


def test_knocking_out_every_entry_leaves_the_offset(fam):
    spec, tm, model, ids, logits, cache = fam
    # layer 1 as in the knockout test: the same compiled forward passes are reused
    adds = model.attention_edits(ids, [AttentionEdit(1)])
    _, c = model.run_with_cache(ids, names=["blocks.1.mixer.hook_out"], adds=adds)
    np.testing.assert_allclose(np.asarray(c["blocks.1.mixer.hook_out"]),
                               np.asarray(cache["blocks.1.mixer.hook_offset"]), atol=1e-5)
    # two edits on one layer multiply: 0.5 twice == 0.25 once
    a = model.scale_attention(ids, [AttentionEdit(1, keys=[1, 3], scale=0.5), AttentionEdit(1, keys=[1, 3], scale=0.5)])
    b = model.scale_attention(ids, [AttentionEdit(1, keys=[1, 3], scale=0.25)])
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_bad_edits_are_named(fam):
    spec, tm, model, ids, logits, cache = fam
    for edit, msg in [(AttentionEdit(0, entries=[(2, 5)]), "above the diagonal"),
                      (AttentionEdit(0, keys=[L]), "out of range"),
                      (AttentionEdit(0, keys=[1], entries=[(2, 1)]), "not both"),
                      (AttentionEdit(0, channels=[0, 0]), "twice"),
                      (AttentionEdit(0, scale=float("nan")), "finite"),
                      (AttentionEdit(len(model.layers)), "out of range")]:
        with pytest.raises(ValueError, match=msg):
            model.scale_attention(ids, [edit])
