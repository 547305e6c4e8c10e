"""Fine-grained FP8 checkpoints (transformers' ``quant_method: "fp8"``: each linear weight in
float8 E4M3 with one float32 scale per block, ``X.weight_scale_inv``), as NVIDIA and Qwen release
Nemotron-H, Qwen3-Next and Qwen3.5 models: dequantized on load, checked against transformers,
which dequantizes them on a CPU too, and against float64 block arithmetic."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.nn.checkpoint import dequantized_fp8, fp8_blocks, read_header
from implicit_attn.registry import FAMILIES

BLOCKS = (2, 2)  # divides every quantized width of the tiny models (transformers needs that)


def quantize(path, torch_model, blocks=BLOCKS) -> None:
    """Rewrite the checkpoint at ``path`` (saved from ``torch_model``) as a fine-grained FP8 one: every
    linear weight (and every expert's) whose shape the blocks divide becomes E4M3 values with
    per-block scales ``amax / 448``; the other linears are listed in ``modules_to_not_convert``."""
    import torch
    from safetensors.torch import load_file, save_file

    linears = {n for n, m in torch_model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    weights = path / "model.safetensors"
    tensors, out, kept = load_file(weights), {}, []
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        linear = module in linears or module.replace("backbone.", "model.", 1) in linears or ".experts." in name
        if linear and w.ndim == 2 and w.shape[0] % blocks[0] == 0 and w.shape[1] % blocks[1] == 0:
            R, C = w.shape
            scale = w.reshape(R // blocks[0], blocks[0], C // blocks[1], blocks[1]).abs().amax(dim=(1, 3)) / 448.0
            scale = scale.clamp(min=1e-12)
            full = scale.repeat_interleave(blocks[0], 0).repeat_interleave(blocks[1], 1)
            out[name], out[name + "_scale_inv"] = (w / full).to(torch.float8_e4m3fn), scale.float()
        else:
            out[name] = w
            if linear and w.ndim == 2:
                kept.append(module)
    save_file(out, weights, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(blocks), "modules_to_not_convert": ["lm_head", *kept]}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("mt", ["qwen3_next", "nemotron_h", "mamba2"])
def test_fp8_checkpoint_loads_as_transformers_dequantizes_it(mt, tmp_path):
    """Our model of the FP8 file gives transformers' logits (its CPU path dequantizes the same
    file) and exact operators; it is not the unquantized model (the weights did change). Before
    2026-12-02 such a file failed on its F8_E4M3 dtype."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # transformers' FP8 loading needs it
    from implicit_attn.testing import build_hf_model, max_rel_error, reference_class, torch_forward

    spec = FAMILIES[mt]
    tm = build_hf_model(mt, dict(spec.tiny), 0, tmp_path)
    ids = np.random.default_rng(3).integers(0, spec.tiny["vocab_size"], (2, 11))
    unquantized = np.asarray(ia.load(tmp_path)(ids))
    quantize(tmp_path, tm)
    hf = reference_class(spec.hf_class).from_pretrained(tmp_path, dtype=torch.float32).eval()
    ref = torch_forward(hf, ids)[0]
    model = ia.load(tmp_path, dtype="float32")
    got = np.asarray(model(ids))
    assert max_rel_error(got, ref) <= 1e-5
    assert max_rel_error(got, unquantized) > 1e-3
    assert max(op.relative_error() for op in model.operators(ids)) <= 1e-5
    np.testing.assert_array_equal(np.asarray(ia.load(tmp_path)(ids)), got)  # the file's other tensors: float32


def test_fp8_vision_language_checkpoint_loads_its_language_model(tmp_path):
    """The Qwen3.5 releases' type (``Qwen3_5MoeForConditionalGeneration``), FP8 with the
    quantization described in the outer config: its language model loads dequantized with
    transformers' logits on text ids."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_qwen3_5 import saved_vision_language_model

    from implicit_attn.testing import assert_loads_as_language_model

    tm, text = saved_vision_language_model("qwen3_5_moe_text", tmp_path)
    quantize(tmp_path, tm)
    scales = [n for n in read_header(tmp_path / "model.safetensors")[0] if n.endswith("_scale_inv")]
    assert any(n.startswith("model.language_model.layers.0.mlp.experts.") for n in scales)
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = np.random.default_rng(3).integers(0, text["vocab_size"], (2, 13))
    assert_loads_as_language_model(hf, tmp_path, "qwen3_5_moe_text", hf.config.tie_word_embeddings, ids)


def test_dequantization_is_the_block_products_in_float64():
    """Ragged blocks (the last ones cut by the shape) and stacked experts: each value is the FP8
    number times its block's scale, in float32, cast to the dtype asked for (or the checkpoint's)."""
    g = np.random.default_rng(0)
    w = g.standard_normal((3, 5, 7)).astype(ml_dtypes.float8_e4m3fn)
    scale = g.uniform(0.5, 2.0, (3, 3, 3)).astype(np.float32)  # ceil(5 / 2), ceil(7 / 3)
    other = np.ones(4, ml_dtypes.bfloat16)
    want = np.empty(w.shape)
    for e, i, j in np.ndindex(*w.shape):
        want[e, i, j] = float(w[e, i, j]) * float(scale[e, i // 2, j // 3])
    got = dequantized_fp8({"x.weight": w, "x.weight_scale_inv": scale, "n.weight": other}, (2, 3), "float32", "f")
    assert set(got) == {"x.weight", "n.weight"} and got["n.weight"] is other
    np.testing.assert_array_equal(got["x.weight"], want.astype(np.float32))
    default = dequantized_fp8({"x.weight": w, "x.weight_scale_inv": scale, "n.weight": other}, (2, 3), None, "f")
    assert default["x.weight"].dtype == ml_dtypes.bfloat16  # the other tensors' dtype
    np.testing.assert_array_equal(default["x.weight"], want.astype(np.float32).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("case, words", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'; only"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "activation_scheme is 'static'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size must be two"),
])
def test_other_quantizations_are_named(case, words):
    with pytest.raises(ia.CheckpointError, match=words):
        fp8_blocks(case, "c")
    assert fp8_blocks({}, "c") is None
    assert fp8_blocks({"quantization_config": {"quant_method": "fp8"}}, "c") == (128, 128)


def test_fp8_tensors_without_their_scales_are_named():
    w = np.zeros((4, 4), ml_dtypes.float8_e4m3fn)
    s = np.ones((2, 2), np.float32)
    with pytest.raises(ia.CheckpointError, match=r"FP8 tensor 'a\.weight' has no scales \('a\.weight_scale_inv'\)"):
        dequantized_fp8({"a.weight": w}, (2, 2), None, "c")
    with pytest.raises(ia.CheckpointError, match=r"tensor 'b\.weight_scale_inv' scales no FP8 tensor 'b\.weight'"):
        dequantized_fp8({"b.weight": np.zeros((4, 4), np.float32), "b.weight_scale_inv": s}, (2, 2), None, "c")
    with pytest.raises(ia.CheckpointError, match=r"needs scales of shape \(\.\.\., ceil\(R / 4\), ceil\(C / 4\)\)"):
        dequantized_fp8({"a.weight": w, "a.weight_scale_inv": s}, (4, 4), None, "c")
    with pytest.raises(ia.CheckpointError, match="must be floating point, got U8"):
        dequantized_fp8({"a.weight": w, "a.weight_scale_inv": s.astype(np.uint8)}, (2, 2), None, "c")


def test_fp8_tensors_of_a_checkpoint_without_the_fp8_config_are_named(tmp_path):
    """FP8 tensors in a checkpoint that describes no quantization (neither a quantization_config in
    config.json nor a ModelOpt hf_quant_config.json) are refused by name, saying what is read."""
    from safetensors.numpy import load_file, save_file

    spec = FAMILIES["mamba2"]
    cfg = spec.config.from_hf(dict(spec.tiny))
    ia.save(spec.lm(cfg, spec.init_params(cfg, 0)), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "backbone.layers.0.mixer.out_proj.weight"
    tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    save_file({**tensors, name.replace("weight", "weight_scale"): np.ones((), np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(ia.CheckpointError, match=rf"non-floating tensors: {name} \(F8_E4M3\) \(FP8 tensors are read "
                                                 r"from transformers' fine-grained FP8 checkpoints, .* from "
                                                 r"compressed-tensors ones, and from ModelOpt exports"):
        ia.load(tmp_path)
