"""Zamba2 beyond the conformance suite: the tie cycle of several shared blocks (hybrid ``k``
uses block ``k % num_mem_blocks`` with adapters of its own), HF's untied form (no
``tie_word_embeddings``: a block per hybrid layer), Zamba2-2.7B's layout scaled down, the
tied copies a checkpoint may hold, our layers against HF's (a hybrid layer is two of ours)
called one by one, the attention operator against HF's eager attention probabilities, and
bad config values named."""
from __future__ import annotations

import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.families import zamba2
from implicit_attn.nn import CheckpointError
from weights_convert import read_hf_dir, write_hf_dir
from conftest import torch_or_skip

# three hybrid layers over two shared blocks: hybrids 0 and 2 share block 0
CYCLE = {**zamba2.SPEC.tiny, "num_hidden_layers": 5, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
         "num_mem_blocks": 2}
# Zamba2-2.7B's pattern (a hybrid layer every sixth, two shared blocks, 32 heads, Mamba head
# width 64, state 64) scaled down; HF's defaults: no q/k/v adapters, no RoPE
ZAMBA2_2_7B = dict(vocab_size=64, hidden_size=64, num_hidden_layers=13,
                   layers_block_type=list(zamba2.config.DEFAULT_LAYERS[:13]), num_attention_heads=32,
                   n_mamba_heads=4, mamba_d_state=16, mamba_ngroups=1, chunk_size=8, num_mem_blocks=2)


def test_tie_cycle_matches_torch_and_uses_the_right_block(tmp_path):
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity, build_hf_model

    tm = build_hf_model("zamba2", CYCLE, path=tmp_path)
    model = ia.load(tmp_path)
    c = model.config
    assert c.layer_types == ("mamba", "attention", "mamba", "mamba", "attention", "mamba", "attention", "mamba")
    assert c.hf_layers == (0, 1, 1, 2, 3, 3, 4, 4) and c.shared_block_index[1::3] == (0, 1, 0)
    assert len(model.shared_blocks) == 2
    assert model.layers[1].block is model.shared_blocks[0] and model.layers[6].block is model.shared_blocks[0]
    assert model.layers[4].block is model.shared_blocks[1]
    # hybrids 0 and 2 read the same q_proj with different adapters
    a, b = model.layers[1].mixer.arrays(), model.layers[6].mixer.arrays()
    assert a["q_proj.weight"] is b["q_proj.weight"] or np.array_equal(a["q_proj.weight"], b["q_proj.weight"])
    assert not np.array_equal(a["q_proj.lora_a"], b["q_proj.lora_a"])
    ids = np.random.default_rng(1).integers(0, 64, (2, 13))
    report = assert_hf_parity(tm, input_ids=ids, jax_model=model)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 8


def test_untied_model_has_a_block_per_hybrid_layer(tmp_path):
    """Without ``tie_word_embeddings`` HF ties no shared block either: each hybrid layer's is
    its own, and holds the adapters of the other slots of its residue too (never used)."""
    torch, transformers = torch_or_skip()
    from implicit_attn.testing import assert_hf_parity, build_hf_model

    config = {**CYCLE, "tie_word_embeddings": False}
    tm = build_hf_model("zamba2", config, path=tmp_path / "hf")
    model = ia.load(tmp_path / "hf")
    assert model.config.num_shared_blocks == 3 and model.config.shared_block_index[1::3] == (0, 1, 2)
    assert not np.array_equal(model.shared_blocks[0].params()["input_layernorm"],
                              model.shared_blocks[2].params()["input_layernorm"])
    _, tensors = read_hf_dir(tmp_path / "hf")
    unused = "model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.2.0.weight"
    assert unused in tensors  # slot 2 of hybrid 0's block: HF builds and saves it, hybrid 2 uses its own
    ids = np.random.default_rng(2).integers(0, 64, (2, 9))
    assert_hf_parity(tm, input_ids=ids, jax_model=model)
    ia.save(model, tmp_path / "ours")
    back = transformers.Zamba2ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        ref = back(torch.as_tensor(ids), use_cache=False).logits.numpy()
    assert np.max(np.abs(np.asarray(model(ids)) - ref)) <= 1e-4


def test_released_layout_matches_torch_and_is_exact():
    torch_or_skip()
    from implicit_attn.testing import assert_hf_parity

    ids = np.random.default_rng(3).integers(0, 64, (2, 17))
    report = assert_hf_parity("zamba2", ZAMBA2_2_7B, ids)
    assert report["logits"] <= 1e-4 and len(report["mixers"]) == 15
    assert max(report["exactness"]["full"]) <= 1e-5 and max(report["exactness"]["no_conv"]) <= 1e-5


def test_tied_copies_load_when_equal_and_are_named_when_not(tmp_path):
    """``save_pretrained`` writes each shared block once; a checkpoint holding the tied copies
    too (a saved ``state_dict``) loads when they equal the first, and names the first that
    differs otherwise."""
    cfg = zamba2.Config.from_hf(CYCLE)
    model = zamba2.LM(cfg, zamba2.init_params(cfg, 0))
    config, tensors = zamba2.from_params(cfg, model.params())
    first, copy = "model.layers.1.shared_transformer.", "model.layers.4.shared_transformer."
    assert not any(k.startswith(copy) for k in tensors)
    full = {**tensors, **{copy + k[len(first):]: v for k, v in tensors.items() if k.startswith(first)}}
    write_hf_dir(tmp_path / "a", config, full)
    ids = np.array([[3, 1, 4, 1, 5, 9]])
    np.testing.assert_array_equal(np.asarray(ia.load(tmp_path / "a")(ids)), np.asarray(model(ids)))
    bad = dict(full)
    bad[copy + "pre_ff_layernorm.weight"] = bad[copy + "pre_ff_layernorm.weight"] + 1.0
    write_hf_dir(tmp_path / "b", config, bad)
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.shared_transformer\.pre_ff_layernorm\.weight "
                                              r"differs from model\.layers\.1\."):
        ia.load(tmp_path / "b")


def test_layers_called_one_by_one_give_the_residual_stream(tmp_path):
    """A shared-attention layer's output (its block's ``t``) fed to the next Mamba layer gives
    the LM's residual stream; the residual stream passes the attention layer unchanged."""
    cfg = zamba2.Config.from_hf(CYCLE)
    model = zamba2.LM(cfg, zamba2.init_params(cfg, 1))
    ids = np.random.default_rng(4).integers(0, 64, (2, 7))
    _, cache = model.run_with_cache(ids, names=lambda n: "resid" in n or n == "hook_embed")
    emb, h, shared = cache["hook_embed"], cache["hook_embed"], None
    for i, layer in enumerate(model.layers):
        np.testing.assert_allclose(np.asarray(h), np.asarray(cache[f"blocks.{i}.hook_resid_pre"]), atol=1e-5)
        if layer.kind == "attention":
            shared = layer(h, emb)
        else:
            h, shared = layer(h, shared), None
    np.testing.assert_allclose(np.asarray(h), np.asarray(cache[f"blocks.{len(model.layers) - 1}.hook_resid_post"]),
                               atol=1e-5)
    assert model.hook_shape("blocks.1.mixer.hook_in", 2, 7) == (2, 7, 32)
    with pytest.raises(ValueError, match="shared attention input"):
        model.layers[1].mixer(np.zeros((2, 7, 16), np.float32))
    with pytest.raises(ValueError, match="embeddings must have the layer input's shape"):
        model.layers[1](np.zeros((2, 7, 16), np.float32), np.zeros((1, 7, 16), np.float32))


@pytest.mark.parametrize("model_type, shared", [("zamba2", "shared_transformer"), ("zamba", "shared_transf")])
def test_attention_operator_is_hf_eager_attention(model_type, shared, tmp_path):
    """Zamba2's (adapters, RoPE) and Zamba's (GQA) shared attention operators are HF's eager
    attention probabilities."""
    torch, _ = torch_or_skip()
    from implicit_attn.testing import build_hf_model

    tm = build_hf_model(model_type, None, path=tmp_path)
    model = ia.load(tmp_path)
    tm.set_attn_implementation("eager")  # the path that returns the probabilities
    ids = np.random.default_rng(5).integers(0, 64, (1, 9))
    seen = []
    hooks = [getattr(l, shared).self_attn.register_forward_hook(lambda m, a, out: seen.append(out[1].numpy()))
             for l in tm.model.layers if hasattr(l, shared)]
    try:
        with torch.no_grad():
            tm(torch.as_tensor(ids), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for op, want in zip(model.operators(ids, layers=[1, 3]), seen, strict=True):
        H = np.asarray(op.materialize())
        np.testing.assert_allclose(H.sum(-1), 1.0, atol=1e-6)
        np.testing.assert_allclose(H, want, atol=1e-6)


def test_hub_config_forms_load():
    """``layer_types`` (HF's alias) and the legacy ``"mamba"`` name give the same config;
    ``to_hf`` writes HF's names; without ``use_mem_rope`` the rope parameters are not read,
    and a ``partial_rotary_factor`` (HF ignores it) is not kept."""
    tiny = {k: v for k, v in zamba2.SPEC.tiny.items() if k != "layers_block_type"}
    cfg = zamba2.Config.from_hf({**tiny, "layer_types": ["linear_attention", "hybrid", "hybrid"]})
    assert cfg == zamba2.Config.from_hf(zamba2.SPEC.tiny) and cfg.layers_block_type == ("mamba", "hybrid", "hybrid")
    assert cfg.to_hf()["layers_block_type"] == ["linear_attention", "hybrid", "hybrid"]
    assert zamba2.Config.from_hf(cfg.to_hf()) == cfg
    rope = zamba2.Config.from_hf({**zamba2.SPEC.tiny, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                                         "partial_rotary_factor": 0.5}})
    assert rope.rope_theta == 500.0 and rope.rotary_dim == rope.head_dim == 8
    off = zamba2.Config.from_hf({**zamba2.SPEC.tiny, "use_mem_rope": False, "rope_parameters": {"rope_type": "yarn"}})
    assert off.rotary_dim == 0
    assert zamba2.Config.from_hf({"vocab_size": 8, "hidden_size": 64}).layer_types.count("attention") == 9


@pytest.mark.parametrize("bad, msg", [
    (dict(num_hidden_layers=4), r"num_hidden_layers \(4\) must equal the number of layers_block_type entries \(3\)"),
    (dict(layers_block_type=["mamba", "attention", "hybrid"]), "layers_block_type"),
    (dict(num_key_value_heads=2), "use_shared_attention_adapter needs num_key_value_heads == num_attention_heads"),
    (dict(num_attention_heads=3), "use_shared_attention_adapter needs"),
    (dict(num_attention_heads=6, use_shared_attention_adapter=False, use_mem_rope=True), "even head_dim"),
    (dict(num_attention_heads=64, use_shared_attention_adapter=False), "exceeds 2 \\* hidden_size"),
    (dict(n_mamba_heads=5), "n_mamba_heads"),
    (dict(mamba_ngroups=3), "n_groups|mamba_ngroups"),
    (dict(hidden_act="silu"), "hidden_act"),
    (dict(time_step_min=-1.0), "time_step_min"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type"),
])
def test_bad_config_values_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        zamba2.Config.from_hf({**zamba2.SPEC.tiny, **bad})
