"""The plain-torch reference of flash-linear-attention's RWKV-6 / RWKV-7 Hugging Face models
(``implicit_attn.testing.fla_rwkv``) against BlinkDL's official ``rwkv`` package (logits of
random multi-layer models, run in a subprocess), its recurrences against fla's plain-torch
reference recurrences (loaded by file path from the ``fla-core`` wheel), fla's checkpoint
layout (names, shapes, ``save_pretrained`` / ``from_pretrained``) and its refusals."""
from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from implicit_attn.testing import fla_rwkv  # noqa: E402
from implicit_attn.testing.fla_rwkv import (  # noqa: E402
    RWKV6Config, RWKV6ForCausalLM, RWKV7Config, RWKV7ForCausalLM, official_logits, official_state_dict,
    perturb_weights, rwkv6_recurrence, rwkv7_recurrence)

# Official layouts scaled down: head size 64 (2 heads), small ranks, 3 layers (v_first and the
# value-residual LoRA of layers 1-2 matter), the official GroupNorm epsilon 64e-5.
V6 = dict(hidden_size=128, num_heads=2, expand_k=1.0, expand_v=1.0, num_hidden_layers=3, proj_low_rank_dim=8,
          gate_low_rank_dim=16, intermediate_size=224, vocab_size=64, g_norm_eps=64e-5)
V7 = dict(hidden_size=128, head_dim=64, num_hidden_layers=3, decay_low_rank_dim=16, gate_low_rank_dim=24,
          a_low_rank_dim=16, v_low_rank_dim=8, intermediate_size=256, vocab_size=64, norm_eps=1e-5)
BUILD = {6: (RWKV6ForCausalLM, RWKV6Config, V6), 7: (RWKV7ForCausalLM, RWKV7Config, V7)}
TOL = 1e-4


def build(version: int, seed: int = 0, **overrides):
    cls, config_cls, kw = BUILD[version]
    torch.manual_seed(seed)
    return perturb_weights(cls(config_cls(**{**kw, **overrides})), seed=seed)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids).logits.numpy()


needs_official = pytest.mark.skipif(importlib.util.find_spec("rwkv") is None,
                                    reason=f"the official package is not installed ({fla_rwkv.OFFICIAL_PACKAGE})")


# ----------------------------------------------------------------------------- official package

@needs_official
def test_rwkv6_matches_the_official_package(ids):
    model = build(6)
    ours = logits_of(model, ids)
    ref = official_logits(model, ids.numpy())
    diff = np.abs(ours - ref).max()
    print(f"RWKV-6: logits {ours.shape}, max |logit| {np.abs(ref).max():.3g}, max diff {diff:.3g}")
    assert ours.shape == ref.shape == (2, 9, 64) and ours.dtype == np.float32
    assert 1.0 < np.abs(ref).max() < 100.0
    assert diff <= TOL
    # fla's default GroupNorm epsilon (norm_eps; all that a reloaded fla checkpoint has) is not the
    # official one: the same weights with g_norm_eps unset disagree visibly
    fla_eps = RWKV6ForCausalLM(RWKV6Config(**{**V6, "g_norm_eps": None}))
    fla_eps.load_state_dict(model.state_dict())
    assert np.abs(logits_of(fla_eps, ids) - ref).max() > 1e-2


@needs_official
def test_rwkv7_matches_the_official_package(ids):
    model = build(7)
    ours = logits_of(model, ids)
    ref = official_logits(model, ids.numpy())
    diff = np.abs(ours - ref).max()
    print(f"RWKV-7: logits {ours.shape}, max |logit| {np.abs(ref).max():.3g}, max diff {diff:.3g}")
    assert ours.shape == ref.shape == (2, 9, 64) and ours.dtype == np.float32
    assert 1.0 < np.abs(ref).max() < 100.0
    assert diff <= TOL
    # the value residual is live: without layer 1's value LoRA the logits move
    with torch.no_grad():
        model.model.layers[1].attn.v_lora.lora[2].bias.fill_(-30.0)
    assert np.abs(logits_of(model, ids) - ref).max() > 1e-2


@needs_official
def test_the_official_worker_reports_a_failure_and_serves_the_next_request(ids):
    """The package runs in one long-lived subprocess per mode: a failing request raises
    with the package's own error, the worker lives on, and its next answer is right."""
    model = build(6)
    weights = official_state_dict(model)
    broken = {k: v for k, v in weights.items() if k != "blocks.1.att.key.weight"}
    with pytest.raises(RuntimeError, match="(?s)official rwkv package failed.*blocks.1.att.key.weight"):
        fla_rwkv.run_official(broken, ids.numpy(), 6)
    worker = fla_rwkv.official_worker(False)
    assert worker.alive()
    assert np.abs(fla_rwkv.run_official(weights, ids.numpy(), 6) - logits_of(model, ids)).max() <= TOL
    assert fla_rwkv.official_worker(False) is worker


def test_official_state_dict_layout():
    sd6 = official_state_dict(build(6))
    C, R, G, H = 128, 8, 16, 2
    assert sd6["blocks.1.att.time_maa_w1"].shape == (C, 5 * R)
    assert sd6["blocks.1.att.time_maa_w2"].shape == (5, R, C)
    assert sd6["blocks.1.att.time_decay"].shape == (1, 1, C)
    assert sd6["blocks.1.att.time_decay_w1"].shape == (C, G)
    assert sd6["blocks.1.att.time_faaaa"].shape == (H, 64)
    assert "blocks.0.ln0.weight" in sd6 and "blocks.1.ln0.weight" not in sd6
    sd7 = official_state_dict(build(7))
    assert sd7["blocks.1.att.v1"].shape == (C, 8) and sd7["blocks.1.att.v0"].shape == (1, 1, C)
    assert "blocks.0.att.v1" not in sd7 and "blocks.1.att.g0" not in sd7
    assert sd7["blocks.2.att.k_k"].shape == (1, 1, C) and sd7["blocks.2.att.r_k"].shape == (H, 64)


def test_official_package_refusals(monkeypatch):
    with pytest.raises(ValueError, match="expand_k = expand_v = 1"):
        official_state_dict(build(6, expand_k=0.5))
    with pytest.raises(ValueError, match="norm_first"):
        official_state_dict(build(7, norm_first=False))
    monkeypatch.setattr(fla_rwkv.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="rwkv==0.8.32"):
        official_logits(build(7), [[1, 2]])


# ----------------------------------------------------------------------------- fla's recurrences

def test_rwkv6_recurrence_matches_fla_naive(fla_naive):
    ref_fn = fla_naive("fla/ops/rwkv6/recurrent_naive.py").naive_recurrent_rwkv6
    g = torch.Generator().manual_seed(3)
    B, T, H, K, V = 2, 13, 3, 16, 8
    r, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    log_w = -torch.exp(torch.randn(B, T, H, K, generator=g) - 1)
    u = torch.randn(H, K, generator=g)
    ours, state = rwkv6_recurrence(r, k, v, log_w, u)
    head_first = lambda t: t.transpose(1, 2)  # noqa: E731
    ref, ref_state = ref_fn(*map(head_first, (r, k, v, log_w)), u, scale=1.0, output_final_state=True)
    assert torch.allclose(ours, head_first(ref), rtol=1e-5, atol=1e-5)
    assert torch.allclose(state, ref_state, rtol=1e-5, atol=1e-5)


def test_rwkv7_recurrence_matches_fla_naive(fla_naive):
    ref_fn = fla_naive("fla/ops/generalized_delta_rule/dplr/naive.py").dplr_recurrence
    g = torch.Generator().manual_seed(4)
    B, T, H, K, V = 2, 13, 3, 16, 8
    r, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    log_w = -math.exp(-0.5) * torch.sigmoid(torch.randn(B, T, H, K, generator=g) * 3)
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    gate = torch.sigmoid(torch.randn(B, T, H, K, generator=g))
    ours, state = rwkv7_recurrence(r, log_w, k, v, -kk, kk * gate)
    head_first = lambda t: t.transpose(1, 2)  # noqa: E731
    # dplr_recurrence scales the queries by K^-1/2 inside; RWKV-7 uses scale 1
    ref, ref_state = ref_fn(head_first(r) * K ** 0.5, *map(head_first, (k, v, -kk, kk * gate, log_w)))
    assert torch.allclose(ours, head_first(ref), rtol=1e-5, atol=1e-5)
    assert torch.allclose(state, ref_state, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- checkpoints

LAYER_SHAPES = {
    6: {"attn.x_proj.0.mu": (128,), "attn.x_proj.0.linear.weight": (40, 128), "attn.x_proj.2.weight": (128, 40),
        "attn.x_bias": (5, 128), "attn.r_proj.linear.weight": (128, 128),
        "attn.w_proj.linear.lora.0.weight": (16, 128), "attn.w_proj.linear.lora.2.weight": (128, 16),
        "attn.w_proj.linear.lora.2.bias": (128,), "attn.k_proj.linear.weight": (128, 128),
        "attn.v_proj.linear.weight": (128, 128), "attn.g_proj.linear.weight": (128, 128), "attn.bonus": (2, 64),
        "attn.g_norm.weight": (128,), "attn.g_norm.bias": (128,), "attn.o_proj.weight": (128, 128),
        "attn_norm.weight": (128,), "attn_norm.bias": (128,), "ffn_norm.weight": (128,), "ffn_norm.bias": (128,),
        "ffn.key.mu": (128,), "ffn.key.linear.weight": (224, 128), "ffn.value.weight": (128, 224),
        "ffn.receptance.mu": (128,), "ffn.receptance.linear.weight": (128, 128)},
    7: {**{f"attn.x_{n}": (1, 1, 128) for n in "rwkvag"}, "attn.k_k": (128,), "attn.k_a": (128,),
        "attn.r_k": (2, 64), "attn.r_proj.weight": (128, 128), "attn.k_proj.weight": (128, 128),
        "attn.v_proj.weight": (128, 128), "attn.o_proj.weight": (128, 128),
        "attn.w_lora.lora.0.weight": (16, 128), "attn.w_lora.lora.2.weight": (128, 16),
        "attn.w_lora.lora.2.bias": (128,), "attn.v_lora.lora.0.weight": (8, 128),
        "attn.v_lora.lora.2.weight": (128, 8), "attn.v_lora.lora.2.bias": (128,),
        "attn.a_lora.lora.0.weight": (16, 128), "attn.a_lora.lora.2.weight": (128, 16),
        "attn.a_lora.lora.2.bias": (128,), "attn.g_lora.lora.0.weight": (24, 128),
        "attn.g_lora.lora.2.weight": (128, 24), "attn.g_norm.weight": (128,), "attn.g_norm.bias": (128,),
        "attn_norm.weight": (128,), "attn_norm.bias": (128,), "ffn_norm.weight": (128,), "ffn_norm.bias": (128,),
        "ffn.x_k": (128,), "ffn.key.weight": (256, 128), "ffn.value.weight": (128, 256)},
}


@pytest.mark.parametrize("version", [6, 7])
def test_fla_layout_and_round_trip(version, ids, tmp_path):
    from safetensors import safe_open

    model = build(version)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {"model.embeddings.weight": (64, 128), "model.norm.weight": (128,), "model.norm.bias": (128,),
                "lm_head.weight": (64, 128), "model.layers.0.pre_norm.weight": (128,),
                "model.layers.0.pre_norm.bias": (128,)}
    for i in range(3):
        for name, shape in LAYER_SHAPES[version].items():
            if not (version == 7 and i == 0 and "v_lora" in name):
                expected[f"model.layers.{i}.{name}"] = shape
    assert shapes == expected

    model.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == f"rwkv{version}"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(expected)
    cls = BUILD[version][0]
    loaded = cls.from_pretrained(tmp_path)
    drop = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert not loaded.training and drop(loaded.config.to_dict()) == drop(model.config.to_dict())
    assert np.array_equal(logits_of(loaded, ids), logits_of(model, ids))


def test_tied_head_round_trip(ids, tmp_path):
    model = build(7, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embeddings.weight
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = RWKV7ForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embeddings.weight
    assert np.array_equal(logits_of(loaded, ids), logits_of(model, ids))
    assert build(7).lm_head.weight is not build(7).model.embeddings.weight


def test_config_normalisation_and_defaults():
    c7 = RWKV7Config(hidden_size=256, num_hidden_layers=2)
    assert (c7.head_dim, c7.num_heads, c7.value_dim, c7.use_l2warp) == (64, 4, [256, 256], True)
    assert RWKV7Config(hidden_size=256, head_dim=None, num_heads=2, num_hidden_layers=1).head_dim == 128
    assert RWKV7Config(hidden_size=128, num_hidden_layers=2, value_dim=256).value_dim == [256, 256]
    with pytest.raises(ValueError, match="multiples of hidden_size"):
        RWKV7Config(hidden_size=128, num_hidden_layers=1, value_dim=192)
    c6 = RWKV6Config()
    assert (c6.expand_k, c6.num_heads, c6.gate_low_rank_dim, c6.g_norm_eps, c6.use_l2warp) == (0.5, 4, 64, None, False)
    # the default FFN width: hidden * ratio rounded up to a multiple of 32
    model = RWKV6ForCausalLM(RWKV6Config(**{**V6, "intermediate_size": None, "hidden_size": 80, "num_heads": 1,
                                            "num_hidden_layers": 1}))
    assert model.model.layers[0].ffn.value.weight.shape == (80, 288)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("version", [6, 7])
def test_hybrid_attention_layers_are_refused(version):
    cls, config_cls, kw = BUILD[version]
    config = config_cls(**{**kw, "attn": {"layers": [1], "num_heads": 2}})
    with pytest.raises(NotImplementedError, match="hybrid"):
        cls(config)
