"""RWKV-6 and RWKV-7 beyond the conformance suite: logits against BlinkDL's official ``rwkv``
package (the same random weights under its names, run in a subprocess), the ablations against the
operators of models with that term removed, long inputs against float64 recurrences, strong
decays, the fla layout's config forms and refusals."""
from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import rwkv6, rwkv7
from implicit_attn.operator import dispatch
from conftest import torch_or_skip

# The released layouts scaled down: heads of 64, expand 1 (RWKV-6), three layers (the value
# residual from layer 1 on), the official group-norm eps (64e-5: g_norm_eps for RWKV-6; head_dim *
# norm_eps for RWKV-7)
OFFICIAL = {"rwkv6": dict(vocab_size=64, hidden_size=128, num_heads=2, expand_k=1.0, expand_v=1.0,
                          num_hidden_layers=3, proj_low_rank_dim=8, gate_low_rank_dim=16, intermediate_size=224,
                          g_norm_eps=64e-5),
            "rwkv7": dict(vocab_size=64, hidden_size=128, head_dim=64, num_hidden_layers=3, decay_low_rank_dim=16,
                          gate_low_rank_dim=24, a_low_rank_dim=16, v_low_rank_dim=8, intermediate_size=256)}
needs_official = pytest.mark.skipif(importlib.util.find_spec("rwkv") is None,
                                    reason="the official rwkv package (test extra) is not installed")


def torch_model(model_type, config, path, seed=0):
    torch_or_skip()
    from implicit_attn.testing import build_hf_model

    return build_hf_model(model_type, config, seed, path)


@needs_official
@pytest.mark.parametrize("model_type", ["rwkv6", "rwkv7"])
def test_logits_match_the_official_package(model_type, tmp_path):
    from implicit_attn.testing.fla_rwkv import official_logits

    tm = torch_model(model_type, OFFICIAL[model_type], tmp_path)
    model = ia.load(tmp_path)
    ids = np.random.default_rng(3).integers(0, 64, (2, 13))
    ref = official_logits(tm, ids)
    ours = np.asarray(model(ids))
    assert ours.shape == ref.shape == (2, 13, 64)
    assert 1.0 < np.abs(ref).max() < 100.0
    assert np.abs(ours - ref).max() <= 1e-4
    for op in model.operators(ids):
        assert op.relative_error() <= 1e-5


# ----------------------------------------------------------------------------- ablations

def tiny_model(model_type, seed=0, **overrides):
    spec = ia.registry.family(model_type)
    cfg = spec.config(**{**spec.tiny, **overrides})
    return spec.lm(cfg, spec.init_params(cfg, seed))


def with_attn(model, layer: int, **changes):
    """The same model with layer ``layer``'s time-mix tensors replaced (under ``attn``, fla's
    name, or ``attention``, RWKV-4/5's)."""
    params = model.params()
    layers = list(params["layers"])
    key = "attn" if "attn" in layers[layer] else "attention"
    layers[layer] = {**layers[layer], key: {**layers[layer][key], **changes}}
    return type(model)(model.config, {**params, "layers": layers})


def head_matrices(op):
    return np.asarray(op.core.head_matrix(jnp.arange(op.core.num_heads)))


def test_rwkv6_no_bonus_is_the_matrix_without_u():
    """``no_bonus``'s ``M_h`` is the full operator's of the same model with ``u = 0``; the two full
    operators differ only on the diagonal."""
    model = tiny_model("rwkv6")
    ids = np.random.default_rng(0).integers(0, 64, (2, 11))
    x = model.mixer_inputs(ids, [1])[1]
    mixer = model.layers[1].mixer
    full, ablated = mixer.as_operator(x), mixer.as_operator(x, "no_bonus")
    zero_u = with_attn(model, 1, bonus=jnp.zeros_like(mixer.arrays()["bonus"])).layers[1].mixer.as_operator(x)
    np.testing.assert_allclose(head_matrices(ablated), head_matrices(zero_u), atol=1e-6)
    diff = np.asarray(full.materialize()) - np.asarray(ablated.materialize())
    L = diff.shape[-1]
    assert np.abs(diff[..., ~np.eye(L, dtype=bool)]).max() == 0.0 and np.abs(diff).max() > 1e-3
    assert ablated.relative_error() > 1e-3 and full.relative_error() <= 1e-5


def test_rwkv7_no_low_rank_is_the_matrix_without_removal():
    """``no_low_rank``'s ``M_h`` is the full operator's of the same model with ``k_k = 0`` (so the
    removal key ``kk`` is 0 and the transition is diagonal)."""
    model = tiny_model("rwkv7")
    ids = np.random.default_rng(1).integers(0, 64, (2, 11))
    x = model.mixer_inputs(ids, [2])[2]
    mixer = model.layers[2].mixer
    ablated = mixer.as_operator(x, "no_low_rank")
    no_kk = with_attn(model, 2, k_k=jnp.zeros_like(mixer.arrays()["k_k"])).layers[2].mixer.as_operator(x)
    np.testing.assert_allclose(head_matrices(ablated), head_matrices(no_kk), atol=1e-6)
    assert np.abs(head_matrices(ablated) - head_matrices(mixer.as_operator(x))).max() > 1e-3
    assert ablated.relative_error() > 1e-3


def test_rwkv7_bonus_is_a_diagonal_outside_the_norm():
    """The ``r_k`` term is ``diag(g beta)`` on the centred values: ``full - no_bonus`` is diagonal
    and equals it; ``no_gate`` keeps the output but drops ``g``."""
    model = tiny_model("rwkv7")
    ids = np.random.default_rng(2).integers(0, 64, (1, 9))
    x = model.mixer_inputs(ids, [1])[1]
    mixer = model.layers[1].mixer
    full, ablated = mixer.as_operator(x), mixer.as_operator(x, "no_bonus")
    f = rwkv7.naive.naive_parts(mixer.arrays(), np.asarray(x), model.config, 1)
    V = model.config.head_v_dim
    want = f["gate"].transpose(0, 2, 1) * np.repeat(f["beta"], V, axis=1)  # (B, V, L)
    diff = np.asarray(full.materialize()) - np.asarray(ablated.materialize())
    np.testing.assert_allclose(np.diagonal(diff, axis1=-2, axis2=-1), want, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ablated.output), np.asarray(full.output))
    assert mixer.as_operator(x, "no_gate").relative_error() > 1e-3


# ----------------------------------------------------------------------------- long inputs

def recurrence64(f: dict, after: bool, low_rank: bool):
    """Float64 ``o (B, H, L, V)`` of the per-head state recurrence, step by step."""
    r, k, v, w = f["r"], f["k"], f["v"], np.exp(f["log_w"])
    B, H, L, K = k.shape
    S = np.zeros((B, H, v.shape[-1], K))
    out = np.zeros(v.shape)
    for t in range(L):
        if not after:
            out[:, :, t] = np.einsum("bhvk,bhk->bhv", S, r[:, :, t]) + f["bonus"][:, :, t, None] * v[:, :, t]
        low = 0.0
        if low_rank:
            a, b = -f["kk"][:, :, t], f["kk"][:, :, t] * f["a"][:, :, t]
            low = np.einsum("bhvk,bhk,bhj->bhvj", S, a, b)
        S = S * w[:, :, t, None, :] + low + v[:, :, t, :, None] * k[:, :, t, None, :]
        if after:
            out[:, :, t] = np.einsum("bhvk,bhk->bhv", S, r[:, :, t])
    return out


def block_output64(f: dict, o, weight, bias, eps, beta=None):
    """``(GroupNorm(o) (+ beta v)) * gate`` in float64: ``(B, L, V)``."""
    y = (o - o.mean(-1, keepdims=True)) / np.sqrt(o.var(-1, keepdims=True) + eps)
    B, H, L, V = o.shape
    flat = lambda t: t.transpose(0, 2, 1, 3).reshape(B, L, H * V)
    out = flat(y) * weight + bias
    if beta is not None:
        out = out + flat(beta[..., None] * f["v"])
    return out * f["gate"]


@pytest.mark.parametrize("model_type", ["rwkv6", "rwkv7"])
def test_long_input_is_finite_and_exact_against_float64(model_type, monkeypatch):
    """L = 4096 in one call: the block output equals a float64 step-by-step recurrence, the
    operator is exact (``apply`` in blocks of 4 channels, half a head), and the last query's row of
    ``H`` equals the float64 row (RWKV-6 with strong decays, down to ``e^-20`` per step, next to
    slow ones)."""
    L = 4096
    # 256 MiB blocks instead of the tiny model's 16 channels (1 GiB) at once: memory a process
    # touches first costs seconds per GB on these VMs
    monkeypatch.setattr(dispatch, "APPLY_BUDGET", 4 * L * L)
    if model_type == "rwkv6":
        model = tiny_model("rwkv6", num_hidden_layers=1)
        bias = model.layers[0].mixer.arrays()["w_proj.linear.lora.2.bias"]
        model = with_attn(model, 0, **{"w_proj.linear.lora.2.bias": jnp.linspace(-6.0, 3.0, bias.shape[0])})
    else:
        model = tiny_model("rwkv7", num_hidden_layers=2)
    layer = len(model.layers) - 1
    ids = np.random.default_rng(4).integers(0, 64, (1, L))
    x = model.mixer_inputs(ids, [layer])[layer]
    mixer = model.layers[layer].mixer
    op = mixer.as_operator(x)
    out = np.asarray(op.output)
    assert np.isfinite(out).all() and op.relative_error() <= 1e-5
    p = {k: np.asarray(v, np.float64) for k, v in mixer.arrays().items()}
    cfg = model.config
    if model_type == "rwkv6":
        f = rwkv6.naive.naive_parts(mixer.arrays(), np.asarray(x), cfg)
        o = recurrence64(f, after=False, low_rank=False)
        want = block_output64(f, o, p["g_norm.weight"], p["g_norm.bias"], cfg.group_norm_eps)
    else:
        f = rwkv7.naive.naive_parts(mixer.arrays(), np.asarray(x), cfg, layer)
        o = recurrence64(f, after=True, low_rank=True)
        want = block_output64(f, o, p["g_norm.weight"], p["g_norm.bias"], cfg.group_norm_eps, f["beta"])
    got = out.transpose(0, 2, 1)
    assert np.abs(got - want).max() / np.abs(want).max() <= 2e-5
    # the last query's row of H for channel 0 against float64: M_h's row carried back through
    # every transition, times the norm-and-gate factor of that row (plus RWKV-7's r_k diagonal)
    row = np.asarray(op.materialize(channels=[0])[0, 0, L - 1])
    assert np.isfinite(row).all()
    want_row = last_row64(f, o, p["g_norm.weight"], cfg.group_norm_eps, after=model_type == "rwkv7")
    assert np.abs(row - want_row).max() / np.abs(want_row).max() <= 1e-5


def last_row64(f: dict, o, weight, eps, after: bool):
    """Float64 ``H_0[L - 1, :]`` (batch 0, channel 0, head 0): ``M_0[L - 1, j] = k_j^T P_{j+1} ... P_{L-1}
    r_{L-1}`` (after the update; before it: ``P`` is the decay alone, ending at ``L - 2``, and the bonus
    on the diagonal), times ``gate w / sigma``."""
    r, k, w = f["r"][0, 0], f["k"][0, 0], np.exp(f["log_w"][0, 0])
    L = k.shape[0]
    M = np.zeros(L)
    y = r[L - 1].copy()
    if after:
        M[L - 1] = k[L - 1] @ y
        for j in range(L - 2, -1, -1):
            kk, a = f["kk"][0, 0, j + 1], f["a"][0, 0, j + 1]
            y = w[j + 1] * y + (-kk) * ((kk * a) @ y)  # (Diag(w) + a' b'^T) y with a' = -kk, b' = kk a
            M[j] = k[j] @ y
    else:
        M[L - 1] = f["bonus"][0, 0, L - 1]
        for j in range(L - 2, -1, -1):
            M[j] = k[j] @ y
            y = w[j] * y
    sigma = np.sqrt(o[0, 0, L - 1].var() + eps)
    row = f["gate"][0, L - 1, 0] * weight[0] / sigma * M
    if after:
        row[L - 1] += f["gate"][0, L - 1, 0] * f["beta"][0, 0, L - 1]
    return row


# ----------------------------------------------------------------------------- config forms

def test_rwkv7_head_dim_and_value_dim_forms():
    cfg = rwkv7.Config.from_hf({"vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "head_dim": None,
                                "num_heads": 4})
    assert (cfg.head_dim, cfg.num_heads, cfg.value_dim) == (4, 4, (16, 16))
    cfg = rwkv7.Config.from_hf({"vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "head_dim": 8,
                                "value_dim": 32})
    assert cfg.value_dim == (32, 32) and cfg.head_v_dim == 32 // cfg.num_heads
    assert rwkv7.Config.from_hf(cfg.to_hf()) == cfg
    for bad, msg in (({"value_dim": [16, 32]}, "differs between layers"), ({"value_dim": 24}, "multiples"),
                     ({"head_dim": 5}, "multiple of head_dim"), ({"attn": {"layers": [1]}}, "attn"),
                     ({"hidden_act": "gelu"}, "hidden_act")):
        with pytest.raises(ValueError, match=msg):
            rwkv7.Config.from_hf({"vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "head_dim": 8, **bad})


def test_rwkv6_widths_and_eps():
    cfg = rwkv6.Config.from_hf({"vocab_size": 8, "hidden_size": 64})
    assert (cfg.key_dim, cfg.value_dim, cfg.num_heads, cfg.ffn_size) == (32, 64, 4, 224)
    assert cfg.group_norm_eps == 1e-5
    assert rwkv6.Config.from_hf({"vocab_size": 8, "hidden_size": 64, "g_norm_eps": 64e-5}).group_norm_eps == 64e-5
    with pytest.raises(ValueError, match="multiple of num_heads"):
        rwkv6.Config.from_hf({"vocab_size": 8, "hidden_size": 64, "num_heads": 3})


def test_rwkv7_layers_after_the_first_need_the_value_residual():
    model = tiny_model("rwkv7")
    h = np.zeros((1, 4, model.config.hidden_size), np.float32)
    model.layers[0](h)
    with pytest.raises(ValueError, match="v_first"):
        model.layers[1](h)
    ids = np.array([[1, 2, 3, 4]])
    cap = model.run_with_cache(ids, ["blocks.1.hook_resid_pre", "blocks.1.mixer.hook_in"])[1]
    v_first = np.asarray(cap["blocks.1.mixer.hook_in"])[..., model.config.hidden_size:]
    out = model.layers[1](cap["blocks.1.hook_resid_pre"], v_first=v_first)
    cap2 = model.run_with_cache(ids, ["blocks.1.hook_resid_post"])[1]
    np.testing.assert_allclose(np.asarray(out), np.asarray(cap2["blocks.1.hook_resid_post"]), atol=1e-5)


def test_rwkv7_reads_fla_first_layout_of_the_interpolations(tmp_path):
    """fla's first RWKV-7 checkpoints hold ``attn.x_x (6, C)`` (rows r, w, k, v, a, g) instead of
    ``x_r ... x_g``: read the same; both forms in one layer is an error."""
    from implicit_attn.nn.checkpoint import read_hf_dir, write_hf_dir

    model = tiny_model("rwkv7")
    ia.save(model, tmp_path / "new")
    config, tensors = read_hf_dir(tmp_path / "new")
    old = {k: np.asarray(v) for k, v in tensors.items()}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}.attn."
        old[p + "x_x"] = np.concatenate([old.pop(p + "x_" + n).reshape(1, -1) for n in "rwkvag"])
    write_hf_dir(tmp_path / "old", config, old)
    ids = np.array([[3, 1, 4, 1, 5, 9]])
    np.testing.assert_array_equal(np.asarray(ia.load(tmp_path / "old")(ids)), np.asarray(model(ids)))
    both = {**old, "model.layers.0.attn.x_r": np.asarray(tensors["model.layers.0.attn.x_r"])}
    write_hf_dir(tmp_path / "both", config, both)
    with pytest.raises(ValueError, match="two forms"):
        ia.load(tmp_path / "both")
