"""The conformance suite: every check below runs on every family in the registry.

A tiny random HF torch model of each family (``FamilySpec.tiny``, prepared by its
``hf_setup``) is saved and loaded with ``ia.load``; then: logits and every layer's mixer
output against torch, exactness of the exact variants, the float64 reference operator,
reduce == materialize for every reduction, channel selection, jit/vmap/grad, taps,
causality, bad inputs, converter errors, save/load round trip, kernels vs XLA.
Per-family test files keep only what is specific to a family.
"""
from __future__ import annotations

import copy
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import implicit_attn as ia
from implicit_attn.families.mamba.block import rms_norm
from implicit_attn.kernels import pallas
from implicit_attn.operator import AttentionOperator, HeadMatrixCore, ImplicitOperator, Mamba2Core, Mamba2Operator
from implicit_attn.registry import FAMILIES
from weights_convert import CheckpointError, convert, read_hf_dir, write_hf_dir

from bad_inputs import BAD_BLOCK_INPUTS
from hf_build import build_hf

testing = pytest.importorskip("implicit_attn.testing")  # torch parity helpers (test extra)
import torch  # noqa: E402  (present once the helpers import)
rel = testing.max_rel_error

L = 11  # odd, not a multiple of any chunk or tile
FAMILY_IDS = sorted(FAMILIES)


@pytest.fixture(scope="module", params=FAMILY_IDS)
def fam(request, tmp_path_factory):
    """``(spec, torch model, our model, checkpoint dir)`` of one family."""
    spec = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    tm = build_hf(spec.model_type, path)
    return spec, tm, ia.load(path), path


def ids_for(model, B=2, seed=0, length=L):
    """Random ``(B, L)`` ids; the tests share one shape, so compiled functions are reused."""
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, (B, length))


# ----------------------------------------------------------------------------- torch parity

def test_parity_with_torch_and_exact_operators(fam):
    """Logits and every layer's mixer input and output against torch, and every exact
    variant's operator exact on every layer (``implicit_attn.testing.assert_hf_parity``)."""
    spec, tm, model, _ = fam
    ids = ids_for(model, B=2)
    assert np.asarray(model(ids)).dtype == np.float32
    r = testing.assert_hf_parity(tm, input_ids=ids, jax_model=model, atol=1e-4, rtol=1e-5, exact_tol=1e-5)
    assert len(r["mixers"]) == len(model.layers)
    assert set(r["exactness"]) == set(spec.exact_variants)
    assert all(len(errs) == len(model.layers) for errs in r["exactness"].values())


# ----------------------------------------------------------------------------- operators

def test_full_operator_equals_the_float64_reference(fam):
    spec, _, model, _ = fam
    ids = ids_for(model, B=2, seed=1)
    xs = model.mixer_inputs(ids)
    for i, layer in enumerate(model.layers):
        H = np.asarray(layer.mixer.as_operator(xs[i]).materialize())
        ref = spec.naive_operator(layer.mixer.arrays(), np.asarray(xs[i]), model.config, i)
        assert ref.dtype == np.float64 and ref.shape == H.shape
        assert rel(H, ref) <= 1e-5, (spec.model_type, i)
        assert not np.triu(H, 1).any()  # exact zeros above the diagonal


def test_reduce_equals_materialize_for_every_reduction(fam):
    spec, _, model, _ = fam
    ids = ids_for(model, B=2, seed=2)
    g = np.random.default_rng(3)
    for op in model.operators(ids):
        H = np.asarray(op.materialize(), np.float64)
        C = H.shape[1]
        sel = sorted({0, C - 1, C // 2})
        for how, f in (("mean", lambda a: a), ("abs_mean", np.abs), ("pos_mean", lambda a: np.maximum(a, 0))):
            np.testing.assert_allclose(op.reduce(how), f(H).mean(1), atol=1e-6, rtol=1e-5)
            np.testing.assert_allclose(op.reduce(how, channels=sel, block_channels=2), f(H[:, sel]).mean(1),
                                       atol=1e-6, rtol=1e-5)
        w = g.standard_normal((2, C, L)).astype(np.float32)
        kw = g.standard_normal((C,)).astype(np.float32)
        want = np.einsum("bci,bcij,cj->bij", w, H, np.broadcast_to(kw[:, None], (C, L)))
        np.testing.assert_allclose(op.reduce("weighted", weights=w, key_weights=kw), want, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(op.materialize(channels=sel), H[:, sel], atol=1e-6, rtol=1e-5)


def test_kernels_agree_with_xla(fam):
    spec, _, model, _ = fam
    ids = ids_for(model, seed=4)
    for op in model.operators(ids):
        ref = np.asarray(op.materialize(impl="xla"))
        np.testing.assert_allclose(op.materialize(impl="auto"), ref, atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(op.reduce("abs_mean", impl="auto"), op.reduce("abs_mean", impl="xla"),
                                   atol=1e-6, rtol=1e-5)
        # XLA's loop over blocks of a few channels (a head core's: only their heads' matrices formed first)
        sel = sorted({1 % ref.shape[1], ref.shape[1] // 2, ref.shape[1] - 1})
        np.testing.assert_allclose(op.reduce("abs_mean", channels=sel, block_channels=2, impl="xla"),
                                   np.abs(ref[:, sel].astype(np.float64)).mean(1), atol=1e-6, rtol=1e-5)
        if pallas.has_kernel(op.core):
            np.testing.assert_allclose(op.materialize(channels=[0, 1], impl="pallas"), ref[:, :2],
                                       atol=1e-6, rtol=1e-5)
        else:
            with pytest.raises(TypeError, match=type(op.core).__name__):
                op.materialize(impl="pallas")


def test_jit_vmap_and_grad(fam):
    spec, _, model, _ = fam
    mixer = model.layers[0].mixer
    x = model.mixer_inputs(ids_for(model, B=2, seed=5), [0])[0]
    f = lambda x: mixer.as_operator(x).reduce("mean")
    loss = lambda x: jnp.sum(jnp.tanh(f(x)))
    eager = np.asarray(f(x))
    np.testing.assert_allclose(jax.vmap(lambda xb: f(xb[None])[0])(x), eager, atol=1e-6, rtol=1e-5)
    # one compilation checks jit and grad together
    (_, jitted), g = jax.jit(jax.value_and_grad(lambda x: (loss(x), f(x)), has_aux=True))(x)
    np.testing.assert_allclose(jitted, eager, atol=1e-6, rtol=1e-5)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0
    d = np.random.default_rng(6).standard_normal(x.shape).astype(np.float32)
    eps = 1e-2
    fd = (loss(x + eps * d) - loss(x - eps * d)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.sum(g * d)), float(fd), rtol=5e-2, atol=1e-3)


def test_vmap_over_examples_equals_the_batch(fam):
    """``jax.vmap`` of the forward over examples gives the batched forward's logits (the
    mixture-of-experts layers fold the mapped axis into their tokens: ``ops.batched_as_tokens``),
    and per-example gradients (``vmap`` of ``grad``, under ``jit``) of a logit w.r.t. a tap on the
    first layer, through every later layer, are the batched gradient's rows."""
    spec, _, model, _ = fam
    ids = jnp.asarray(ids_for(model, seed=8), jnp.int32)
    one = lambda i: model(i[None])[0]
    np.testing.assert_allclose(np.asarray(jax.vmap(one)(ids)), np.asarray(model(ids)), atol=1e-5, rtol=1e-5)
    tap = jnp.zeros(model.tap_shape(0, *ids.shape)[0], jnp.float32)
    logit = lambda i, t: model.tapped_logits(i[None], {0: t[None]})[0, -1, 1]
    each = jax.jit(jax.vmap(jax.grad(logit, argnums=1)))(ids, tap)
    batched = jax.grad(lambda t: jnp.sum(model.tapped_logits(ids, {0: t})[:, -1, 1]))(tap)
    scale = float(np.abs(np.asarray(batched)).max())  # one example's path may round apart (kernel thresholds)
    assert scale > 0
    np.testing.assert_allclose(np.asarray(each), np.asarray(batched), atol=1e-5 * scale, rtol=1e-4)


def test_zero_taps_keep_the_logits_and_give_gradients(fam):
    spec, _, model, _ = fam
    ids = ids_for(model, seed=7)
    B, Lx = ids.shape
    taps = {i: jnp.zeros(model.tap_shape(i, B, Lx)[0], jnp.float32) for i in range(len(model.layers))}
    np.testing.assert_allclose(model.tapped_logits(ids, taps), model(ids), atol=1e-6)
    g = jax.grad(lambda t: model.tapped_logits(ids, t)[0, -1, 0])(taps)
    assert all(g[i].shape == taps[i].shape for i in taps)
    assert any(np.abs(np.asarray(g[i])).max() > 0 for i in taps)
    with pytest.raises(ValueError, match="shape"):
        model.tapped_logits(ids, {0: jnp.zeros((B, 1, Lx))})


def test_outputs_before_t_do_not_depend_on_inputs_after_t(fam):
    spec, _, model, _ = fam
    ids = ids_for(model, seed=8)
    t = 6
    other = ids.copy()
    other[0, t:] = (other[0, t:] + 1) % model.config.vocab_size
    np.testing.assert_array_equal(np.asarray(model(ids))[:, :t], np.asarray(model(other))[:, :t])
    a, b = model.operators(ids), model.operators(other)
    for oa, ob in zip(a, b):
        np.testing.assert_array_equal(np.asarray(oa.materialize())[:, :, :t], np.asarray(ob.materialize())[:, :, :t])


# ----------------------------------------------------------------------------- bad input

def test_bad_inputs_fail_with_named_errors(fam):
    spec, _, model, _ = fam
    V = model.config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(np.array([[0, V]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(np.array([[-1, 0]]))
    with pytest.raises(TypeError, match="integers"):
        model(np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="batch"):
        model(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="variant"):
        model.operators(np.array([[1, 2]]), variant="no_such_variant")
    with pytest.raises(ValueError, match="layer"):
        model.operators(np.array([[1, 2]]), layers=[len(model.layers)])
    D = mixer_width(model)
    with pytest.raises(ValueError, match="last dimension"):
        model.layers[0].mixer.as_operator(np.zeros((1, 3, D + 1), np.float32))
    with pytest.raises(ValueError, match="floating"):
        model.layers[0].mixer.as_operator(np.zeros((1, 3, D), np.int32))
    if not model.takes_segment_pos:
        with pytest.raises(ValueError, match="segment_pos"):
            model(np.array([[1, 2]]), segment_pos=np.array([[0, 1]]))
    with pytest.raises(ValueError, match="non-empty"):
        model([[]])
    op = model.operators(ids_for(model))[0]  # every layer at the shared shape: compiled already
    if not hasattr(op.core, "num_heads"):  # Mamba-2 operators have head matrices
        with pytest.raises(TypeError, match="head_matrices needs a Mamba-2 operator"):
            op.head_matrices()


def test_out_of_range_ids_under_jit_give_nan_logits(fam):
    """Under jit the range cannot be checked: a bad id makes its logits NaN, never the
    logits of a clamped, valid token; earlier positions keep their logits (NaN is causal)."""
    spec, _, model, _ = fam
    V = model.config.vocab_size
    f = jax.jit(lambda ids: model(ids))
    good = np.asarray(f(jnp.array([[1, 2, V - 1, 3]])))
    assert not np.any(np.isnan(good))
    for bad in (V, V + 7, -5):
        out = np.asarray(f(jnp.array([[1, 2, bad, 3]])))
        assert np.all(np.isnan(out[0, 2:])), bad
        np.testing.assert_allclose(out[0, :2], good[0, :2], atol=1e-5, err_msg=str(bad))


# torch's own modules of these refuse bfloat16 on CPU ("mixed dtype", "same dtype" errors)
NO_TORCH_BFLOAT16 = ("rwkv6", "rwkv7", "xlstm")


def test_bfloat16_mixer_input_is_torchs_bit_for_bit(fam):
    """In bfloat16, layer 0's mixer input (the embeddings, scaled, through the first norm) equals
    HF's bit for bit: each norm applies its weight before or after the cast back as HF's does,
    LayerNorm's affine is float32 with one rounding, and a scaled embedding is rounded where HF
    stores it (XLA would otherwise keep float32 into the norm)."""
    spec, tm, _, path = fam
    half = copy.deepcopy(tm).to(torch.bfloat16)
    ids = ids_for(tm, B=2)
    if spec.model_type in NO_TORCH_BFLOAT16:
        with pytest.raises(RuntimeError, match="dtype"):
            testing.torch_forward(half, ids)
        return
    _, io = testing.torch_forward(half, ids)
    model = ia.load(path, dtype="bfloat16")
    _, cache = model.run_with_cache(ids, names=["blocks.0.mixer.hook_in"])
    ours = cache["blocks.0.mixer.hook_in"]
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours, np.float32), io[0][0])


# HF's plain RMSNorm of each family whose norms are ``mamba.block.rms_norm`` under its config's
# ``norm_weight_in_float32`` (the residual, final and attention q/k norms of Bamba's layer and
# LM functions and of LFM2's attention): (transformers module, class)
HF_RMS_NORMS = {"bamba": ("bamba", "BambaRMSNorm"), "falcon_h1": ("falcon_h1", "FalconH1RMSNorm"),
                "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridRMSNorm"),
                "jamba": ("jamba", "JambaRMSNorm"), "kimi_linear": ("kimi_linear", "KimiLinearRMSNorm"),
                "lara_mini": ("lara_mini", "LaraMiniRMSNorm"), "lfm2": ("lfm2", "Lfm2RMSNorm"),
                "lfm2_moe": ("lfm2_moe", "Lfm2MoeRMSNorm"), "lfm3": ("lfm3", "Lfm3RMSNorm"),
                "minimax": ("minimax", "MiniMaxRMSNorm"), "nemotron_h": ("nemotron_h", "NemotronHRMSNorm"),
                "olmo_hybrid": ("olmo_hybrid", "OlmoHybridRMSNorm")}


@pytest.mark.parametrize("model_type", sorted(HF_RMS_NORMS))
def test_rms_norms_round_like_hf_in_bfloat16(model_type):
    """Each config's ``norm_weight_in_float32`` is HF's choice: ``mamba.block.rms_norm`` under it
    equals the family's HF RMSNorm bit for bit in bfloat16, and the other choice does not (one
    rounding apart on a good share of the entries)."""
    folder, name = HF_RMS_NORMS[model_type]
    hf_norm = getattr(importlib.import_module(f"transformers.models.{folder}.modeling_{folder}"), name)(64, eps=1e-6)
    g = np.random.default_rng(0)
    with torch.no_grad():
        hf_norm.weight.copy_(torch.tensor(1 + 0.3 * g.standard_normal(64)))
        hf_norm = hf_norm.to(torch.bfloat16)
        x = torch.tensor(3 * g.standard_normal((8, 16, 64))).to(torch.bfloat16)
        ref = hf_norm(x).float().numpy()
    xj, wj = (jnp.asarray(t.detach().float().numpy()).astype(jnp.bfloat16) for t in (x, hf_norm.weight))
    flag = FAMILIES[model_type].config.norm_weight_in_float32
    ours = jax.jit(rms_norm, static_argnums=(2, 3))(xj, wj, 1e-6, flag)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours, np.float32), ref)
    other = np.asarray(jax.jit(rms_norm, static_argnums=(2, 3))(xj, wj, 1e-6, not flag), np.float32)
    assert np.mean(other != ref) > 0.05


def test_low_precision_models_warn_that_operators_are_not_exact(fam):
    spec, _, model, _ = fam
    cast = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x
    half = spec.lm(model.config, jax.tree.map(cast, model.params()))
    with pytest.warns(UserWarning, match="dtype='float32'"):
        half.operators(np.array([[1, 2, 3, 4]]), layers=[0])


def mixer_width(model) -> int:
    """The width of layer 0's mixer input (``d_model``; RWKV-7's ``[x, v_first]`` is wider)."""
    return model.hook_shape("blocks.0.mixer.hook_in", 1, 1)[-1]


@pytest.mark.parametrize("case", list(BAD_BLOCK_INPUTS))
def test_bad_block_input(fam, case):
    spec, _, model, _ = fam
    shape, dtype, msg = BAD_BLOCK_INPUTS[case]
    layer = model.layers[0]
    for fn, D in ((layer.mixer.as_operator, mixer_width(model)), (layer.mixer, mixer_width(model)),
                  (layer, model.config.hidden_size)):
        with pytest.raises(ValueError, match=msg):
            fn(np.zeros(shape(D), dtype))


def test_bad_taps(fam):
    spec, _, model, _ = fam
    B, Lx, n = 2, 5, len(model.layers)
    ids = np.zeros((B, Lx), np.int64)
    shape, axes = model.tap_shape(0, B, Lx)
    zeros = lambda s, dtype=np.float32: np.zeros(s, dtype)  # numpy: no program per shape
    wrong = (B, shape[1] + 1) + shape[2:]
    cases = [({0: zeros((1,) + shape[1:])}, "taps[0] must have the shape of layer 0's operator"),
             ({0: zeros(wrong)}, f"got {wrong}"),
             ({0: zeros(shape[:2] + (Lx - 1,) + shape[3:])}, f"{axes} = {shape}"),
             ({-n - 1: zeros(shape)}, f"layer {-n - 1} out of range"),
             ({0: zeros(shape), -n: zeros(shape)}, "layer 0 given twice"),
             ({0: zeros(shape, np.int32)}, "must be floating point"),
             ([zeros(shape)], "taps must be a dict")]
    for taps, msg in cases:
        with pytest.raises(ValueError) as e:
            model.tapped_logits(ids, taps)
        assert msg in str(e.value), (msg, str(e.value))
    # a bad tap on a single layer call names the layer's operator output
    with pytest.raises(ValueError, match="tap must have the shape"):
        model.layers[0](np.zeros((B, Lx, model.config.hidden_size), np.float32), tap=zeros((1,) + shape[1:]))
    # a negative layer counts from the end
    ids = ids_for(model, seed=10)
    last = model.tap_shape(n - 1, *ids.shape)[0]
    tap = jnp.asarray(np.random.default_rng(0).standard_normal(last), jnp.float32)
    np.testing.assert_array_equal(np.asarray(model.tapped_logits(ids, {-1: tap})),
                                  np.asarray(model.tapped_logits(ids, {n - 1: tap})))


def test_converter_errors_name_the_problem(fam, tmp_path):
    spec, _, model, path = fam
    config, tensors = read_hf_dir(path)
    name = sorted(spec.expected_shapes(model.config)[0])[0]

    def write(cfg, t):
        d = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        write_hf_dir(d, cfg, t)
        return d

    missing = dict(tensors)
    del missing[name]
    with pytest.raises(CheckpointError, match="missing tensors: " + name.replace(".", r"\.")):
        ia.load(write(config, missing))
    with pytest.raises(CheckpointError, match="unexpected tensors: extra.weight"):
        ia.load(write(config, {**tensors, "extra.weight": np.zeros((2,), np.float32)}))
    bad = dict(tensors)
    bad[name] = np.zeros(tuple(s + 1 for s in bad[name].shape), bad[name].dtype)
    with pytest.raises(CheckpointError, match="has shape"):
        ia.load(write(config, bad))
    d = write(config, tensors)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="truncated"):
        ia.load(d)
    with pytest.raises(ValueError, match="unknown model_type"):
        ia.load(write({**config, "model_type": "no_such_model"}, tensors))


def test_save_load_round_trip_and_torch_reads_ours(fam, tmp_path):
    import torch

    spec, _, model, _ = fam
    ia.save(model, tmp_path / "a")
    ia.save(model, tmp_path / "b", max_shard_bytes=4096)
    ids = ids_for(model, seed=9)
    want = np.asarray(model(ids))
    for d in ("a", "b"):
        back = ia.load(tmp_path / d)
        assert type(back) is type(model) and back.config == model.config
        np.testing.assert_array_equal(np.asarray(back(ids)), want)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == spec.model_type
    tm = testing.reference_class(spec.hf_class).from_pretrained(tmp_path / "b").eval()
    with torch.no_grad():
        ref = tm(torch.tensor(ids), use_cache=False).logits.numpy()
    assert np.max(np.abs(want - ref)) <= 1e-4


def test_a_file_of_the_torch_state_dict_loads_as_the_saved_form(fam, tmp_path):
    """A checkpoint written from the torch model itself (``safetensors.torch.save_model``: the
    names of transformers' ``state_dict()``, with fused experts and renamed modules, and one
    name of each tied pair, ``lm_head.weight`` where it sorts first) loads to the logits of the
    checkpoint ``save_pretrained`` wrote, and HF's class reads it to its own. Before 2026-12-02
    the families with a ``StateDictNames`` refused such files by name, and tied LFM2 and
    RecurrentGemma missed their embeddings."""
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_model

    spec, _, model, path = fam
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    # a torch model that has not run: HF's RWKV rescales its weights in place on its first forward
    tm = testing.reference_class(spec.hf_class).from_pretrained(path).eval()
    for p in tm.parameters():  # parameters split from one stored tensor (LaraMini's in_proj) share its storage
        p.data = p.data.clone()
    save_model(tm, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    names = set(load_file(tmp_path / "model.safetensors"))
    saved = set(load_file(path / "model.safetensors"))
    if spec.state_dict_names is not None:  # (OLMo-Hybrid's and LaraMini's own standard_form read their other names)
        assert names - saved - {"lm_head.weight"}
    ids = ids_for(model, seed=5)
    np.testing.assert_array_equal(np.asarray(ia.load(tmp_path)(ids)), np.asarray(model(ids)))
    if spec.state_dict_names is not None:  # the public converter reads the same form
        assert convert(tmp_path)[0] == model.config
    hf = testing.reference_class(spec.hf_class).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids), use_cache=False).logits.numpy()
    assert rel(np.asarray(model(ids)), ref) <= 1e-5


def test_init_params_follow_the_shape_table(fam):
    spec, _, model, _ = fam
    params = spec.init_params(model.config, 0)
    _, tensors = spec.from_params(model.config, params)  # checks every name and shape
    req, opt = spec.expected_shapes(model.config)
    assert set(req) <= set(tensors) <= set(req) | set(opt)
    again = spec.init_params(model.config, jax.random.PRNGKey(0))
    fresh = spec.lm(model.config, again)
    assert np.isfinite(np.asarray(fresh(ids_for(model)))).all()


def test_params_hold_the_current_weights(fam):
    """``params()``, what every forward takes, holds the very arrays the model's NNX parameters
    hold (read without NNX's value hooks: ``nn.held``), and a weight set anew shows at once."""
    _, _, model, _ = fam
    params = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    assert {id(x) for x in jax.tree.leaves(model.params())} == {id(v[...]) for v in params}
    first, old = params[0], params[0][...]
    try:
        first.set_value(old + 1.0)
        assert any(x is first[...] for x in jax.tree.leaves(model.params()))
        assert not any(x is old for x in jax.tree.leaves(model.params()))
    finally:
        first.set_value(old)


def test_info_and_registry_entry(fam):
    spec, _, model, _ = fam
    info = model.info()
    assert info["family"] == spec.model_type == model.family
    assert info["layers"] == len(model.layers) and info["parameters"] == model.num_params
    assert ia.family(spec.model_type) is spec and spec.lm is type(model)
    assert "full" in spec.exact_variants and set(spec.exact_variants) <= set(spec.variants)
    assert spec.variants == model.variants
    ops = model.operators(ids_for(model))
    assert spec.has_heads == any(isinstance(op, Mamba2Operator) for op in ops)
    for op in ops:  # the uniform mixer interface: every operator has these, with these shapes
        B, C, Lq, Lk = op.shape
        assert op.values.shape[:3] == op.output.shape[:3] == op.offset.shape[:3] == (B, C, Lq)
        assert isinstance(op, (ImplicitOperator, AttentionOperator))
        for core in getattr(op.core, "parts", (op.core,)):  # the head layout channel_heads relies on
            if isinstance(core, (Mamba2Core, HeadMatrixCore)):
                C, H = core.num_channels, core.num_heads
                assert C % H == 0 and np.array_equal(np.asarray(core.head), np.arange(C) // (C // H))
