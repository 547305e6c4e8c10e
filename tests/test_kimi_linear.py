"""Kimi-Linear beyond the conformance suite: Kimi-Linear-48B-A3B's layout scaled down and given in
the checkpoint's config form (``linear_attn_config``, ``first_k_dense_replace``), the ``no_delta``
approximation against the exact operator with per-dimension decays, the MLA operator against HF's
eager probabilities, and config forms and bad values."""
from __future__ import annotations

import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import kimi_linear
from conftest import torch_or_skip

# Kimi-Linear-48B-A3B: 27 layers, KDA : MLA = 3 : 1 (MLA at layers 4, 8, ... counted from 1), the
# first layer dense, 32 KDA heads of 128, MLA with a 512 latent and no q latent, 256 experts (8 per
# token) in one group, one shared expert; here 8 layers at width 64
KIMI_LINEAR_48B = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4,
                       qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=4,
                       num_local_experts=16, routed_scaling_factor=2.446, pad_token_id=None, bos_token_id=None,
                       eos_token_id=None, first_k_dense_replace=1,
                       linear_attn_config={"head_dim": 8, "num_heads": 8, "short_conv_kernel_size": 4,
                                           "full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7]})


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    cfg = kimi_linear.Config.from_hf(KIMI_LINEAR_48B)
    assert cfg.layer_types == ("delta", "delta", "delta", "attention") * 2
    assert cfg.mlp_layer_types == ("mlp",) + ("moe",) * 7 and (cfg.linear_num_heads, cfg.linear_head_dim) == (8, 8)
    ids = np.random.default_rng(1).integers(0, 64, (2, 17))
    report = assert_hf_parity("kimi_linear", KIMI_LINEAR_48B, ids)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 8
    assert max(report["exactness"]["full"]) <= 1e-5


def test_released_names_of_the_dense_layers_load(tmp_path):
    """The released Kimi-Linear files name the dense layers' MLP ``mlp.`` (Moonshot's modelling
    code: ``self.mlp`` for the first ``first_k_dense_replace`` layers), where transformers' writer
    names it ``block_sparse_moe.`` as the MoE layers' (it renames every ``mlp.`` back). Both load
    to the same model; HF's class reads the released form to the same logits, and ``ia.save``
    writes it. Before 2026-12-02 the released form failed with "missing tensors" (and ``ia.save``
    wrote transformers' form, which Moonshot's code does not read)."""
    torch, _ = torch_or_skip()
    from safetensors.numpy import load_file, save_file

    from implicit_attn.testing import build_hf_model, max_rel_error, reference_class

    build_hf_model("kimi_linear", KIMI_LINEAR_48B, path=tmp_path)
    ids = np.random.default_rng(2).integers(0, 64, (1, 13))
    want = np.asarray(ia.load(tmp_path)(ids))
    (weights,) = tmp_path.glob("*.safetensors")
    dense = "model.layers.0.block_sparse_moe."
    tensors = load_file(weights)
    assert {k for k in tensors if k.startswith(dense)} == {dense + f"{n}_proj.weight" for n in ("gate", "up", "down")}
    save_file({k.replace(dense, "model.layers.0.mlp."): v for k, v in tensors.items()}, weights,
              metadata={"format": "pt"})
    model = ia.load(tmp_path)
    np.testing.assert_array_equal(np.asarray(model(ids)), want)
    ia.save(model, tmp_path / "ours")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert {k for k in ours if k.startswith("model.layers.0.") and "_proj" in k and "attn" not in k} == \
        {f"model.layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    with torch.no_grad():
        ref = reference_class("KimiLinearForCausalLM").from_pretrained(tmp_path).eval()(torch.tensor(ids)).logits
    assert max_rel_error(want, ref.numpy()) <= 1e-5


def test_no_delta_is_far_from_the_exact_operator(tmp_path):
    """Leaving out the erasure ``(I - b k kᵀ)`` misses the KDA output by a large margin; the
    decays are per key dimension (``log_decay (B, H, L, d)``)."""
    torch_or_skip()
    from implicit_attn.testing import build_hf_model

    build_hf_model("kimi_linear", None, path=tmp_path)
    model = ia.load(tmp_path)
    ids = np.random.default_rng(2).integers(0, 64, (2, 24))
    exact = model.operators(ids, layers=[0])[0]
    assert exact.relative_error() <= 1e-5
    assert exact.core.named_factors()["log_decay"].shape == (2, 2, 24, 4)
    for variant in ("no_delta", "no_gate", "no_norm"):
        op = model.operators(ids, layers=[0], variant=variant)[0]
        assert op.relative_error() > 0.05, variant
        np.testing.assert_array_equal(np.asarray(op.output), np.asarray(exact.output))
    M = np.asarray(exact.head_matrices())
    assert M.shape == (2, 2, 24, 24) and not np.triu(M, 1).any()


@pytest.mark.parametrize("model_type", ["kimi_linear", "bailing_hybrid"])
def test_mla_operator_is_hf_eager_attention(tmp_path, model_type):
    """MLA's operator is HF's eager softmax probabilities: without RoPE (Kimi-Linear), and with
    RoPE on the shared key part, before the per-head output gate (Bailing-Hybrid)."""
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model

    tm = build_hf_model(model_type, None, path=tmp_path)
    model = ia.load(tmp_path)
    tm.set_attn_implementation("eager")
    ids = np.random.default_rng(3).integers(0, 64, (1, 9))
    with torch.no_grad():
        out = tm(torch.as_tensor(ids), output_attentions=True, use_cache=False)
    want = [a.numpy() for a in out.attentions if a is not None]
    assert len(want) == 1
    np.testing.assert_allclose(np.asarray(model.operators(ids, layers=[1])[0].materialize()), want[0], atol=1e-6)


def test_config_forms():
    """HF's attribute names and config.json names read alike (ours are the config.json ones);
    ``to_hf`` writes HF's names and reads back equal; conflicting or bad values are named."""
    cfg = kimi_linear.Config.from_hf(kimi_linear.SPEC.tiny)
    assert (cfg.num_expert_group, cfg.num_experts, cfg.num_experts_per_token) == (2, 4, 2)
    d = cfg.to_hf()
    assert d["num_expert_group"] == 2 and "n_group" not in d and d["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert kimi_linear.Config.from_hf(d) == cfg
    default = kimi_linear.Config.from_hf(dict(vocab_size=64, hidden_size=16, num_hidden_layers=6, pad_token_id=None))
    assert default.layer_types == ("delta",) * 4 + ("attention", "delta") and default.mlp_layer_types[:2] == ("mlp", "moe")
    for bad, match in ((dict(n_group=3), "n_group .* and num_expert_group .* disagree"),
                       (dict(num_key_value_heads=2), "num_key_value_heads"),
                       (dict(num_experts=5), "num_experts .* multiple of num_expert_group"),
                       (dict(layer_types=None, linear_attn_config={"full_attn_layers": [9], "kda_layers": [1, 2]}),
                        "full_attn_layers")):
        with pytest.raises(ValueError, match=match):
            kimi_linear.Config.from_hf({**d, **bad})
