"""ModelOpt exports (NVIDIA's FP8 and NVFP4 releases: ``hf_quant_config.json``, and
``quantization_config`` with ``"quant_method": "modelopt"`` in newer ones), dequantized on load:
against transformers' model of the dequantized weights (float64 arithmetic of the format) and the
error cases."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import implicit_attn as ia
from implicit_attn.nn.checkpoint import CheckpointError
from implicit_attn.nn.modelopt import (ModelOptScheme, dequantized_modelopt, modelopt_scheme, quant_config_section,
                                       with_hf_quant_config)
from implicit_attn.registry import FAMILIES

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def fp4_codes(w: np.ndarray, per_group: np.ndarray) -> np.ndarray:
    """The nearest E2M1 code of each ``w / per_group`` (``w (R, C)``, ``per_group (R, C / 16)``)."""
    x = w / np.repeat(per_group, 16, axis=1)
    return np.abs(x[..., None] - E2M1[:8] * np.sign(x)[..., None]).argmin(-1) + 8 * (x < 0)


def quantized(w: np.ndarray, algo: str) -> tuple[dict, np.ndarray]:
    """``(tensors of linear "X" as ModelOpt stores it, its value)`` for weight ``w (R, C)``: in float64,
    but for NVFP4 in ModelOpt's float32 order (the group scale times the second-level scale, then
    times the E2M1 value)."""
    if algo == "FP8":
        s = np.float32(np.abs(w).max() / 448)
        q = (w / s).astype(ml_dtypes.float8_e4m3fn)
        return {"X.weight": q, "X.weight_scale": np.array(s, np.float32),
                "X.input_scale": np.array(0.1, np.float32)}, q.astype(np.float64) * np.float64(s)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        s = (np.abs(w).max(1) / 448).astype(np.float32)
        q = (w / s[:, None]).astype(ml_dtypes.float8_e4m3fn)
        return {"X.weight": q, "X.weight_scale": s}, q.astype(np.float64) * s.astype(np.float64)[:, None]
    R, C = w.shape
    second = np.float32(np.abs(w).max() / (6 * 448))
    block = (np.abs(w).reshape(R, C // 16, 16).max(-1) / (6 * second)).astype(ml_dtypes.float8_e4m3fn)
    per_group = block.astype(np.float32) * second
    codes = fp4_codes(w, per_group.astype(np.float64)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # the low nibble first
    value = E2M1[codes].astype(np.float32) * np.repeat(per_group, 16, axis=1)
    return {"X.weight": packed, "X.weight_scale": block, "X.weight_scale_2": np.array([second], np.float32),
            "X.input_scale": np.array([0.1], np.float32)}, value


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4", "W4A16_NVFP4"])
def test_dequantization_is_the_format_in_float64(algo):
    """Each algorithm's weight is its values times its scales (NVFP4: E2M1 code x FP8 group scale x
    the second-level scale, the nibbles low first), computed in float32: the FP8 ones equal to the
    float64 value rounded once; the activation scales are dropped and the other tensors kept."""
    g = np.random.default_rng(0)
    w = g.standard_normal((6, 32)).astype(np.float32)
    tensors, want = quantized(w, algo.removeprefix("W4A16_"))
    other = np.ones(3, ml_dtypes.bfloat16)
    got = dequantized_modelopt({**tensors, "n.weight": other}, ModelOptScheme(algo), "float32", "c")
    assert set(got) == {"X.weight", "n.weight"} and got["n.weight"] is other
    np.testing.assert_array_equal(got["X.weight"], want.astype(np.float32))
    assert np.abs(want - w).max() < 0.3 * np.abs(w).max()  # the codes are the weight's (a sanity check)
    default = dequantized_modelopt({**tensors, "n.weight": other}, ModelOptScheme(algo), None, "c")
    assert default["X.weight"].dtype == ml_dtypes.bfloat16  # the checkpoint's other tensors' dtype


def write_modelopt(path, torch_model, algos, in_config: bool, under: str = "") -> None:
    """Rewrite the checkpoint at ``path`` (saved from ``torch_model``) as a ModelOpt export: every
    ``nn.Linear`` but the head quantized with ``algos[i % len(algos)]`` (a mixed-precision export
    when several; only those whose names start with ``under``), described in
    ``hf_quant_config.json`` and, with ``in_config``, in ``config.json`` too. The plain file of the
    dequantized weights is written to ``path/reference``."""
    import torch
    from safetensors.torch import load_file, save_file
    from safetensors.numpy import save_file as save_numpy

    linears = [n for n, m in torch_model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head" and n.startswith(under)]
    tensors = {k: v.numpy() for k, v in load_file(path / "model.safetensors").items()}
    layers, plain = {}, dict(tensors)
    for i, module in enumerate(linears):
        name = f"{module}.weight" if f"{module}.weight" in tensors else f"{module.replace('model.', 'backbone.', 1)}.weight"
        w = tensors.pop(name)
        algo = algos[i % len(algos)]
        if "NVFP4" in algo and w.shape[1] % 16:
            tensors[name] = w
            continue
        parts, value = quantized(w, algo.removeprefix("W4A16_"))
        tensors.update({k.replace("X", name.removesuffix(".weight"), 1): v for k, v in parts.items()})
        plain[name] = value.astype(np.float32)
        layers[name.removesuffix(".weight")] = {"quant_algo": algo, **({"group_size": 16} if "NVFP4" in algo else {})}
    assert {layer["quant_algo"] for layer in layers.values()} == set(algos)
    save_numpy(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "reference").mkdir()
    save_file({k: torch.tensor(v) for k, v in plain.items()}, path / "reference" / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "reference" / "config.json").write_text(json.dumps(config))
    section = ({"quant_algo": algos[0]} if len(algos) == 1 else
               {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers})
    hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {**section, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
    (path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    if in_config:
        config["quantization_config"] = quant_config_section(hf_quant, "c")
        (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("mt,algos,in_config", [
    ("nemotron_h", ("FP8",), False), ("nemotron_h", ("NVFP4", "FP8"), True),
    pytest.param("qwen3_next", ("FP8_PER_CHANNEL_PER_TOKEN",), True, marks=pytest.mark.deep),
])
def test_export_loads_as_its_dequantized_weights(mt, algos, in_config, tmp_path):
    """A ModelOpt export (older ones: ``hf_quant_config.json`` only; newer: the config too; one
    algorithm or mixed precision) gives the logits transformers computes from the dequantized
    weights, with exact operators, and not the unquantized model's."""
    import torch

    from implicit_attn.testing import build_hf_model, max_rel_error, reference_class, torch_forward

    spec = FAMILIES[mt]
    tm = build_hf_model(mt, dict(spec.tiny), 0, tmp_path)
    ids = np.random.default_rng(3).integers(0, spec.tiny["vocab_size"], (2, 11))
    unquantized = np.asarray(ia.load(tmp_path)(ids))
    write_modelopt(tmp_path, tm, algos, in_config)
    hf = reference_class(spec.hf_class).from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()
    model = ia.load(tmp_path, dtype="float32")
    got = np.asarray(model(ids))
    assert max_rel_error(got, torch_forward(hf, ids)[0]) <= 1e-5
    assert max_rel_error(got, unquantized) > 1e-3
    assert max(op.relative_error() for op in model.operators(ids)) <= 1e-5


def test_vision_language_export_names_its_layers_as_the_file_does(tmp_path):
    """The layout of NVIDIA's Qwen3.6 NVFP4 releases: a ``Qwen3_5ForConditionalGeneration``
    checkpoint, ``MIXED_PRECISION`` of FP8 and W4A16_NVFP4 in ``config.json``, its
    ``quantized_layers`` named as in the file (``model.language_model.``): the language model loads
    with the logits transformers computes from the dequantized weights, and exact operators."""
    import torch
    import transformers
    from test_qwen3_5 import saved_vision_language_model

    from implicit_attn.testing import assert_loads_as_language_model

    tm, text = saved_vision_language_model("qwen3_5_text", tmp_path)
    write_modelopt(tmp_path, tm, ("W4A16_NVFP4", "FP8"), True, under="model.language_model.")
    quantized_layers = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quantized_layers"]
    assert all(n.startswith("model.language_model.layers.") for n in quantized_layers)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "reference",
                                                                      dtype=torch.float32).eval()
    ids = np.random.default_rng(3).integers(0, text["vocab_size"], (2, 13))
    assert_loads_as_language_model(hf, tmp_path, "qwen3_5_text", hf.config.tie_word_embeddings, ids)


def test_what_is_not_read_is_named(tmp_path):
    """Other algorithms (AWQ, MXFP8, ...), AWQ's input smoothing scales, NVFP4 groups other than
    16, a quantized weight without scales or of the wrong dtype, scales of the wrong shape, a
    mixed-precision layer not listed, and an ``hf_quant_config.json`` of another producer."""
    assert modelopt_scheme({}, "c") is None
    assert modelopt_scheme({"quantization_config": {"quant_method": "fp8"}}, "c") is None
    cases = [({"quant_algo": "W4A16_AWQ"}, "quant_algo 'W4A16_AWQ'; read: FP8"),
             ({"quant_algo": "NVFP4", "group_size": 32}, "NVFP4 groups of 32"),
             ({"quant_algo": "MIXED_PRECISION"}, "MIXED_PRECISION has no quantized_layers"),
             ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": {"quant_algo": "MXFP8"}}},
              "layer 'a' has quant_algo 'MXFP8'")]
    for section, match in cases:
        with pytest.raises(CheckpointError, match=match):
            modelopt_scheme({"quantization_config": {"quant_method": "modelopt", **section}}, "c")
    with pytest.raises(CheckpointError, match="is not a ModelOpt export .producer 'other'"):
        quant_config_section({"producer": {"name": "other"}, "quantization": {}}, "c")
    with pytest.raises(CheckpointError, match="no quantization section"):
        quant_config_section({"producer": {"name": "modelopt"}}, "c")
    # the quantization section alone (as copies of the released files hold it) is read
    assert quant_config_section({"quantization": {"quant_algo": "FP8"}}, "c") == {"quant_algo": "FP8",
                                                                                 "quant_method": "modelopt"}
    g = np.random.default_rng(0)
    w = g.standard_normal((4, 32)).astype(np.float32)
    fp8, _ = quantized(w, "FP8")
    nvfp4, _ = quantized(w, "NVFP4")
    scheme = ModelOptScheme("FP8")
    with pytest.raises(CheckpointError, match="AWQ input scale"):
        dequantized_modelopt({**fp8, "X.pre_quant_scale": np.ones(32, np.float32)}, scheme, None, "c")
    with pytest.raises(CheckpointError, match=r"quantized weight 'X.weight' has no scales"):
        dequantized_modelopt({"X.weight": fp8["X.weight"]}, scheme, None, "c")
    with pytest.raises(CheckpointError, match=r"'X.weight_scale' of shape \(4,\) does not fit a weight of shape \(4, 32\) with strategy 'tensor'"):
        dequantized_modelopt({**fp8, "X.weight_scale": np.ones(4, np.float32)}, scheme, None, "c")
    with pytest.raises(CheckpointError, match="FP8 weight 'X.weight' must be an FP8 matrix"):
        dequantized_modelopt(nvfp4, scheme, None, "c")
    with pytest.raises(CheckpointError, match=r"'X.weight_scale' of shape \(4, 1\) does not fit .* \(expected \(4, 2\)"):
        dequantized_modelopt({**nvfp4, "X.weight_scale": np.ones((4, 1), ml_dtypes.float8_e4m3fn)},
                             ModelOptScheme("NVFP4"), None, "c")
    with pytest.raises(CheckpointError, match="NVFP4 scales 'X.weight_scale' must be FP8, got float32"):
        dequantized_modelopt({**nvfp4, "X.weight_scale": np.ones((4, 2), np.float32)}, ModelOptScheme("NVFP4"), None, "c")
    with pytest.raises(CheckpointError, match="needs one float 'X.weight_scale_2'"):
        dequantized_modelopt({k: v for k, v in nvfp4.items() if k != "X.weight_scale_2"}, ModelOptScheme("NVFP4"),
                             None, "c")
    with pytest.raises(CheckpointError, match="'X' holds quantized tensors but is not among"):
        dequantized_modelopt(fp8, ModelOptScheme("MIXED_PRECISION", (("Y", "FP8"),)), None, "c")
    config = {"model_type": "mamba"}
    assert with_hf_quant_config(config, tmp_path) is config  # no such file
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="hf_quant_config.json: not valid JSON"):
        with_hf_quant_config(config, tmp_path)
    given = {**config, "quantization_config": {"quant_method": "fp8"}}
    assert with_hf_quant_config(given, tmp_path) is given  # config.json's own description wins


def test_values_are_modelopts_own():
    """The packed values and scales ModelOpt's exporter writes (``to_quantized_weight``, the
    NVFP4 scales of ``NVFP4QTensor``), dequantized here, equal ModelOpt's own dequantization bit
    for bit: FP8 per tensor and per row, and NVFP4 (nibble order, group and second-level scales)."""
    pytest.importorskip("modelopt")
    import torch
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    def as_numpy(t):
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn) if t.dtype == torch.float8_e4m3fn else t.numpy()

    torch.manual_seed(0)
    w = torch.randn(6, 48)
    second = NVFP4QTensor.get_weights_scaling_factor_2(w)
    block, second = NVFP4QTensor.get_weights_scaling_factor(w, 16, second)
    packed = to_quantized_weight(w, block, "nvfp4", second, 16)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (6, 24)
    want = NVFP4QTensor(w.shape, torch.float32, packed).dequantize(scale=block, double_scale=second,
                                                                   block_sizes={-1: 16})
    tensors = {"X.weight": as_numpy(packed), "X.weight_scale": as_numpy(block),
               "X.weight_scale_2": as_numpy(second.reshape(1))}
    got = dequantized_modelopt(tensors, ModelOptScheme("NVFP4"), "float32", "c")["X.weight"]
    np.testing.assert_array_equal(got, want.numpy())
    assert (got != 0).mean() > 0.5

    for algo, scale in [("FP8", w.abs().max() / 448), ("FP8_PER_CHANNEL_PER_TOKEN", w.abs().amax(1) / 448)]:
        q = to_quantized_weight(w, scale, "fp8" if algo == "FP8" else "fp8_pc_pt")
        want = FP8QTensor(w.shape, torch.float32, q).dequantize(scale=scale if algo == "FP8" else scale[:, None])
        got = dequantized_modelopt({"X.weight": as_numpy(q), "X.weight_scale": as_numpy(scale)}, ModelOptScheme(algo),
                                   "float32", "c")["X.weight"]
        np.testing.assert_array_equal(got, want.numpy(), err_msg=algo)
