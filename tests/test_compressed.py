"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``: llm-compressor's FP8,
INT4/INT8 and NVFP4 releases), dequantized on load. The checkpoints are written by the
``compressed-tensors`` package itself (its quantization config, scales and compressors), and
checked against transformers, which dequantizes them on a CPU, and against the package's own
decompressors."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.nn.checkpoint import CheckpointError, fp8_blocks, read_hf_dir
from implicit_attn.nn.compressed import (WeightScheme, compressed_schemes, dequantized_compressed, unpacked_fp4,
                                         unpacked_ints)
from implicit_attn.registry import FAMILIES, family_checkpoint

# name: (the package's weight arguments, storage format, input activations)
SCHEMES = {
    "fp8_channel": (dict(num_bits=8, type="float", strategy="channel"), "float-quantized",
                    dict(num_bits=8, type="float", strategy="token", dynamic=True)),
    "fp8_block": (dict(num_bits=8, type="float", strategy="block", block_structure=[4, 4]), "float-quantized", None),
    "fp8_tensor": (dict(num_bits=8, type="float", strategy="tensor"), "float-quantized",
                   dict(num_bits=8, type="float", strategy="tensor", dynamic=False)),
    "int4_group": (dict(num_bits=4, type="int", strategy="group", group_size=8), "pack-quantized", None),
    "int8_channel": (dict(num_bits=8, type="int", strategy="channel"), "int-quantized", None),
    "nvfp4": (dict(num_bits=4, type="float", strategy="tensor_group", group_size=16), "nvfp4-pack-quantized", None),
}


def calibrate(module, args) -> None:
    """Set a quantized module's scales (and NVFP4's global scale) from its weight's range, as a
    min-max observer would, with the package's own ``calculate_qparams``."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = module.weight.data
    if args.strategy == "tensor":
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "block":
        (b0, b1), (R, C) = args.block_structure, w.shape
        blocks = w.reshape(R // b0, b0, C // b1, b1)
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        groups = w.unflatten(-1, (-1, args.group_size))
        lo, hi = groups.amin(-1), groups.amax(-1)
    gs = None
    if args.strategy == "tensor_group":
        gs = generate_gparam(w.min(), w.max())
        module.weight_global_scale.data.copy_(gs)
    if hasattr(module, "input_scale"):  # static activation scales: a coarse grid, which would show if applied
        module.input_scale.data.fill_(0.05)
    scale, zero = calculate_qparams(lo, hi, args, global_scale=gs)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)


def write_compressed(path, torch_model, name, ignore=("lm_head",)) -> None:
    """Quantize every ``nn.Linear`` of ``torch_model`` but ``ignore`` with scheme ``SCHEMES[name]``
    and save it compressed to ``path``, config included, with the compressed-tensors package."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    weights, fmt, inputs = SCHEMES[name]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=None if inputs is None else QuantizationArgs(**inputs))
    apply_quantization_config(torch_model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    for module in torch_model.modules():
        if hasattr(module, "weight_scale"):
            calibrate(module, module.quantization_scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(torch_model, quantization_format=fmt)
    compressor.compress_model(torch_model)
    torch_model.save_pretrained(path)
    compressor.update_config(path)


def hf_dequantized(spec, path):
    """transformers' model of the compressed checkpoint at ``path``, dequantized on load (float32)."""
    import torch
    from transformers import CompressedTensorsConfig

    from implicit_attn.testing import reference_class

    return reference_class(spec.hf_class).from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()


@pytest.mark.parametrize("mt,name", [
    ("qwen3_5_text", "fp8_channel"), ("qwen3_5_text", "int4_group"), ("mamba2", "int8_channel"),
    pytest.param("qwen3_5_text", "fp8_block", marks=pytest.mark.deep),
    pytest.param("nemotron_h", "fp8_tensor", marks=pytest.mark.deep),
])
def test_compressed_checkpoint_loads_as_transformers_dequantizes_it(mt, name, tmp_path):
    """Our model of the compressed file gives transformers' logits (its dequantizing load of the
    same file) and exact operators, and it is not the unquantized model. FP8 with dynamic
    per-token and with static activation scales included: neither side quantizes activations."""
    pytest.importorskip("compressed_tensors")  # imported here: 2.5 s at collection otherwise
    from implicit_attn.testing import build_hf_model, max_rel_error, torch_forward

    spec = FAMILIES[mt]
    tm = build_hf_model(mt, dict(spec.tiny), 0, tmp_path)
    ids = np.random.default_rng(3).integers(0, spec.tiny["vocab_size"], (2, 11))
    unquantized = np.asarray(ia.load(tmp_path)(ids))
    write_compressed(tmp_path, tm, name)
    header = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert header["quant_method"] == "compressed-tensors" and header["format"] == SCHEMES[name][1]
    static = SCHEMES[name][2] is not None and not SCHEMES[name][2].get("dynamic")
    names = read_hf_dir(tmp_path)[1]
    assert any(n.endswith(".input_scale") for n in names) == static  # static activation scales are in the file
    ref = torch_forward(hf_dequantized(spec, tmp_path), ids)[0]
    model = ia.load(tmp_path, dtype="float32")
    got = np.asarray(model(ids))
    assert max_rel_error(got, ref) <= 1e-5
    assert max_rel_error(got, unquantized) > 1e-3
    assert max(op.relative_error() for op in model.operators(ids)) <= 1e-5


def test_nvfp4_weights_are_the_packages_values(tmp_path):
    """NVFP4 (FP4 E2M1 values, FP8 scales per 16 inputs, a global scale): each weight equals the
    compressed-tensors decompression bit for bit once rounded to bfloat16 (the package's
    decompressor gives bfloat16 values; ours keeps float32), and the logits follow."""
    pytest.importorskip("compressed_tensors")  # imported here: 2.5 s at collection otherwise
    import torch

    from implicit_attn.testing import build_hf_model, max_rel_error, torch_forward

    spec = FAMILIES["qwen3_5_text"]
    tm = build_hf_model("qwen3_5_text", dict(spec.tiny), 0, tmp_path)
    write_compressed(tmp_path, tm, "nvfp4", ignore=("lm_head", "re:.*out_proj$"))  # out_proj: 24 inputs
    hf = hf_dequantized(spec, tmp_path)
    config, tensors = read_hf_dir(tmp_path)
    assert any(t.dtype == np.uint8 for t in tensors.values())
    _, _, ours = family_checkpoint(config, tensors, "nvfp4", "float32")
    state = hf.state_dict()
    packed = [n.removesuffix("_packed") for n in tensors if n.endswith(".weight_packed")]
    assert len(packed) >= 8
    for n in packed:
        want = state[n].to(torch.float32).numpy()
        np.testing.assert_array_equal(ours[n].astype(ml_dtypes.bfloat16).astype(np.float32), want, err_msg=n)
    ids = np.random.default_rng(3).integers(0, spec.tiny["vocab_size"], (2, 11))
    assert max_rel_error(np.asarray(ia.load(tmp_path, dtype="float32")(ids)), torch_forward(hf, ids)[0]) <= 1e-2


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpacking_is_the_packages_packing_reversed(bits):
    """Any bit width, values crossing int32 words (3 bits), and the zero points packed along rows."""
    pytest.importorskip("compressed_tensors")  # imported here: 2.5 s at collection otherwise
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = np.random.default_rng(bits).integers(lo, hi + 1, (5, 37)).astype(np.int8)
    packed = pack_to_int32(torch.tensor(q), bits).numpy()
    np.testing.assert_array_equal(unpacked_ints(packed, bits, 37, "w"), q)
    by_rows = pack_to_int32(torch.tensor(q), bits, packed_dim=0).numpy()
    np.testing.assert_array_equal(unpacked_ints(by_rows.T, bits, 5, "z").T, q)
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    fp4 = unpacked_fp4(codes, "n")
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    want = unpack_fp4_from_uint8(torch.tensor(codes), 8, 64, dtype=torch.float32).numpy()
    np.testing.assert_array_equal(fp4, want)


def test_asymmetric_groups_and_group_order_match_float64():
    """Asymmetric int4 groups with zero points, packed by the package's compressor (neither
    transformers nor the package's decompressor unpacks those zero points: the reference is float64
    arithmetic), then a ``weight_g_idx`` group order."""
    pytest.importorskip("compressed_tensors")  # imported here: 2.5 s at collection otherwise
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    g = np.random.default_rng(0)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=8, symmetric=False)
    q = g.integers(-8, 8, (6, 24)).astype(np.int8)
    scale = g.uniform(0.01, 0.1, (6, 3)).astype(np.float32)
    zero = g.integers(-8, 8, (6, 3)).astype(np.int8)
    w = (torch.tensor(q, dtype=torch.float32) - torch.tensor(zero, dtype=torch.float32).repeat_interleave(8, 1)) \
        * torch.tensor(scale).repeat_interleave(8, 1)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": torch.tensor(scale), "weight_zero_point": torch.tensor(zero)}, scheme)
    assert state["weight_zero_point"].shape == (1, 3)  # 6 rows of 4 bits in one int32 word per group
    want = ((q.astype(np.float64) - np.repeat(zero, 8, 1)) * np.repeat(scale.astype(np.float64), 8, 1))
    tensors = {f"m.{k}": v.numpy() for k, v in state.items()}
    ws = WeightScheme("pack-quantized", 4, "int", "group", 8, None, False, ("Linear",))
    got = dequantized_compressed({**tensors, "n.weight": np.ones(2, np.float32)}, (ws,), None, "c")
    assert set(got) == {"m.weight", "n.weight"}
    np.testing.assert_array_equal(got["m.weight"], want.astype(np.float32))

    order = g.permutation(np.repeat(np.arange(3), 8))
    sym = WeightScheme("int-quantized", 8, "int", "group", 8, None, True, ("Linear",))
    tensors = {"m.weight": q, "m.weight_scale": scale, "m.weight_g_idx": order}
    expect = q.astype(np.float64) * scale.astype(np.float64)[:, order]
    np.testing.assert_array_equal(dequantized_compressed(tensors, (sym,), "float32", "c")["m.weight"],
                                  expect.astype(np.float32))


def config_with(**q):
    base = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                         "strategy": "channel"}}}}
    return {"quantization_config": {**base, **q}}


def test_what_is_not_read_is_named():
    """Fake-quantized (not compressed) checkpoints, sparsity, rotations, other formats and
    strategies, and tensors that do not fit are ``CheckpointError``s naming the problem."""
    assert compressed_schemes({}, "c") is None
    assert compressed_schemes({"quantization_config": {"quant_method": "fp8"}}, "c") is None
    (s,) = compressed_schemes(config_with(), "c")
    assert (s.format, s.strategy, s.num_bits, s.symmetric) == ("float-quantized", "channel", 8, True)
    # the layout of llm-compressor's older FP8 releases: 'frozen', FP8 weights as 'naive-quantized'
    (old,) = compressed_schemes(config_with(quantization_status="frozen", format="naive-quantized"), "c")
    w8 = np.full((2, 3), 1.5, ml_dtypes.float8_e4m3fn)
    got = dequantized_compressed({"m.weight": w8, "m.weight_scale": np.array([2.0, 4.0], np.float32).reshape(2, 1),
                                  "m.input_scale": np.ones(1, np.float32)}, (old,), "float32", "c")
    np.testing.assert_array_equal(got["m.weight"], [[3.0] * 3, [6.0] * 3])
    assert set(got) == {"m.weight"}  # the activation scale is dropped
    cases = [
        (config_with(quantization_status="calibration"), "quantization_status is 'calibration'"),
        (config_with(format="dense"), "format 'dense'"),
        (config_with(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
        (config_with(transform_config={"config_groups": {"u": {}}}), "transform_config"),
        (config_with(format="mxfp4-pack-quantized"), "format 'mxfp4-pack-quantized'"),
        (config_with(config_groups={"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "attn_head"}}}),
         "strategy 'attn_head'"),
        (config_with(config_groups={"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor"}}}),
         "does not store 4-bit float"),
        (config_with(config_groups={"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}),
         "without a positive group_size"),
        (config_with(config_groups={}), "no config_groups"),
    ]
    for config, match in cases:
        with pytest.raises(CheckpointError, match=match):
            compressed_schemes(config, "c")
    (s,) = compressed_schemes(config_with(), "c")
    w = np.ones((4, 6), ml_dtypes.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"'m.weight_scale' of shape \(3, 1\) does not fit a weight of shape"):
        dequantized_compressed({"m.weight": w, "m.weight_scale": np.ones((3, 1), np.float32)}, (s,), None, "c")
    with pytest.raises(CheckpointError, match="must be an FP8 matrix"):
        dequantized_compressed({"m.weight": w.astype(np.float32), "m.weight_scale": np.ones((4, 1), np.float32)},
                               (s,), None, "c")
    with pytest.raises(CheckpointError, match="belongs to no quantized weight"):
        dequantized_compressed({"m.weight_packed": np.ones((4, 1), np.int32)}, (s,), None, "c")
    two = (s, WeightScheme("float-quantized", 8, "float", "tensor", None, None, True, ("Linear",)))
    with pytest.raises(CheckpointError, match="several compressed-tensors config groups target 'm'"):
        dequantized_compressed({"m.weight": w, "m.weight_scale": np.ones((4, 1), np.float32)}, two, None, "c")
    only = (WeightScheme("float-quantized", 8, "float", "channel", None, None, True, ("re:.*mlp.*",)),)
    with pytest.raises(CheckpointError, match="quantized tensors of 'm', which no compressed-tensors config group targets"):
        dequantized_compressed({"m.weight": w, "m.weight_scale": np.ones((4, 1), np.float32)}, only, None, "c")
    with pytest.raises(CheckpointError, match=r"quant_method 'awq'; only .*\('fp8'\), compressed-tensors .* and ModelOpt exports"):
        fp8_blocks({"quantization_config": {"quant_method": "awq"}}, "c")


def test_mixture_of_experts_releases_with_each_expert_quantized(tmp_path):
    """llm-compressor's MoE releases quantize each expert's linears under the names on disk
    (``mlp.experts.{e}.gate_proj``): int4 groups packed by the package's compressor, module by
    module. Reference: transformers' model of a plain file holding the package's decompressed
    weights."""
    pytest.importorskip("compressed_tensors")  # imported here: 2.5 s at collection otherwise
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file, save_file

    from implicit_attn.testing import build_hf_model, max_rel_error, reference_class, torch_forward

    spec = FAMILIES["qwen3_next"]
    build_hf_model("qwen3_next", dict(spec.tiny), 0, tmp_path)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=8)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors, plain, packed = load_file(tmp_path / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not (".experts." in name or name.endswith("_proj.weight")) or w.ndim != 2 or w.shape[1] % 8:
            plain[name] = packed[name] = w
            continue
        groups = w.unflatten(-1, (-1, 8))
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        state = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        packed.update({f"{module}.{k}": v for k, v in state.items()})
        plain[name] = PackedQuantizationCompressor.decompress(dict(state), scheme)["weight"].to(torch.float32)
    assert any(".experts.0.gate_proj.weight_packed" in n for n in packed)
    config = json.loads((tmp_path / "config.json").read_text())
    save_file(plain, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = reference_class(spec.hf_class).from_pretrained(tmp_path, dtype=torch.float32).eval()
    save_file(packed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump()}},
        "ignore": ["lm_head", "re:.*mlp.gate$"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = np.random.default_rng(3).integers(0, spec.tiny["vocab_size"], (2, 11))
    model = ia.load(tmp_path, dtype="float32")
    assert max_rel_error(np.asarray(model(ids)), torch_forward(hf, ids)[0]) <= 1e-5
