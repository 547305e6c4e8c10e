"""``implicit-attn convert``: PyTorch pickles (mamba_ssm's ``pytorch_model.bin`` + config, official
RWKV ``.pth``) -> our safetensors layout, read only with ``torch.load(weights_only=True)``; a
malicious pickle is refused and runs nothing; ``ia.load`` never unpickles. Round trips compare
the converted checkpoint's logits with the torch model the pickle was written from."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import implicit_attn as ia  # noqa: E402
from implicit_attn import cli  # noqa: E402
from implicit_attn.convert import convert_checkpoint, padded_vocab  # noqa: E402
from implicit_attn.testing import fla_rwkv, rwkv5_reference  # noqa: E402
from implicit_attn.testing.hf import build_hf_model, save_hf_model  # noqa: E402
from weights_convert import read_hf_dir  # noqa: E402

TOL = 1e-4
IDS = np.random.default_rng(0).integers(0, 50, (2, 9))


class Payload:
    """A pickled object whose unpickling runs a shell command creating ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_malicious(path, marker):
    torch.save({"emb.weight": torch.zeros(2, 2), "blocks.0.att.key.weight": Payload(marker)}, path)


def torch_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def max_diff(dst, ref, ids=IDS) -> float:
    ours = np.asarray(ia.load(dst)(ids))
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max())


def assert_same_as_hf_save(dst, model, tmp_path):
    """The converted checkpoint gives exactly the logits of ``model`` saved by transformers (the
    conversion only renames, transposes and reorders tensors)."""
    save_hf_model(model, tmp_path / "hf")
    assert np.array_equal(np.asarray(ia.load(dst)(IDS)), np.asarray(ia.load(tmp_path / "hf")(IDS)))


# ----------------------------------------------------------------------------- safety

def test_the_payload_is_live(tmp_path):
    """The pickle used below really runs code when fully unpickled (so the refusals mean something)."""
    marker = tmp_path / "ran"
    write_malicious(tmp_path / "x.pth", marker)
    torch.load(tmp_path / "x.pth", weights_only=False)
    assert marker.exists()


def test_a_malicious_pickle_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"
    pth = tmp_path / "rwkv.pth"
    write_malicious(pth, marker)
    with pytest.raises(ia.CheckpointError, match="refused") as e:
        convert_checkpoint(pth, tmp_path / "out")
    assert str(pth) in str(e.value) and "posix.system" in str(e.value)
    # mamba_ssm layout, through the command line
    src = tmp_path / "mamba"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"d_model": 16, "n_layer": 1, "vocab_size": 8}))
    write_malicious(src / "pytorch_model.bin", marker)
    assert cli.main(["convert", str(src), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "pytorch_model.bin" in err
    # ia.load never unpickles: a directory with only the pickle is refused, pointing at convert
    with pytest.raises(ia.CheckpointError, match="implicit-attn convert"):
        ia.load(src)
    assert not marker.exists()
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


# ----------------------------------------------------------------------------- mamba_ssm

def mamba_ssm_dir(tmp_path, hf_model, config: dict):
    """A state-spaces/mamba-* style directory: mamba_ssm names, config and pytorch_model.bin."""
    src = tmp_path / "src"
    src.mkdir()
    sd = {("backbone.embedding.weight" if k == "backbone.embeddings.weight" else k): v
          for k, v in hf_model.state_dict().items()}
    torch.save(sd, src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_padded_vocab_is_mamba_ssm_s():
    assert [padded_vocab(v, 8) for v in (50277, 50280, 1, 8)] == [50280, 50280, 8, 8]


def test_mamba_ssm_mamba1_round_trip(tmp_path):
    # vocab 50 padded to 56 by pad_vocab_size_multiple 8, tied head (mamba_ssm's default; the
    # state dict holds lm_head.weight too)
    hf = build_hf_model("mamba", {"vocab_size": 56, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 2,
                                  "conv_kernel": 4, "expand": 2, "time_step_rank": 4, "tie_word_embeddings": True})
    src = mamba_ssm_dir(tmp_path, hf, {"d_model": 16, "n_layer": 2, "vocab_size": 50,
                                       "ssm_cfg": {"d_state": 4, "d_conv": 4, "expand": 2, "dt_rank": 4},
                                       "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
                                       "pad_vocab_size_multiple": 8})
    dst = tmp_path / "dst"
    assert cli.main(["convert", str(src), str(dst)]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["model_type"] == "mamba" and cfg["vocab_size"] == 56 and cfg["tie_word_embeddings"] is True
    diff = max_diff(dst, torch_logits(hf))
    print(f"mamba_ssm Mamba-1 -> mamba: max |logit diff| {diff:.2e}")
    assert diff <= TOL
    assert_same_as_hf_save(dst, hf, tmp_path)


def test_mamba_ssm_mamba2_round_trip(tmp_path):
    hf = build_hf_model("mamba2", {"vocab_size": 64, "hidden_size": 16, "num_heads": 4, "head_dim": 8,
                                   "state_size": 4, "n_groups": 2, "num_hidden_layers": 2, "conv_kernel": 4,
                                   "expand": 2, "chunk_size": 8, "tie_word_embeddings": False})
    src = mamba_ssm_dir(tmp_path, hf, {"d_model": 16, "n_layer": 2, "vocab_size": 60, "d_intermediate": 0,
                                       "ssm_cfg": {"layer": "Mamba2", "d_state": 4, "headdim": 8, "ngroups": 2,
                                                   "chunk_size": 8, "dt_min": 0.001},
                                       "tie_embeddings": False, "pad_vocab_size_multiple": 16})
    dst = tmp_path / "dst"
    cfg = convert_checkpoint(src, dst, "mamba2")
    assert cfg["model_type"] == "mamba2" and cfg["num_heads"] == 4 and cfg["n_groups"] == 2
    diff = max_diff(dst, torch_logits(hf))
    print(f"mamba_ssm Mamba-2 -> mamba2: max |logit diff| {diff:.2e}")
    assert diff <= TOL
    assert_same_as_hf_save(dst, hf, tmp_path)


@pytest.mark.parametrize("change, key", [
    ({"rms_norm": False}, "rms_norm"), ({"d_intermediate": 32}, "d_intermediate"),
    ({"attn_layer_idx": [1]}, "attn_layer_idx"), ({"ssm_cfg": {"layer": "Mamba3"}}, "ssm_cfg.layer"),
    ({"ssm_cfg": {"layer": "Mamba2", "norm_before_gate": True}}, "norm_before_gate"),
    ({"ssm_cfg": {"layer": "Mamba2", "D_has_hdim": True}}, "D_has_hdim"),
    ({"ssm_cfg": {"d_state": 4, "surprise": 1}}, "surprise"), ({"vocab_size": 40}, "backbone.embeddings.weight"),
])
def test_mamba_ssm_settings_we_cannot_represent_are_refused(tmp_path, change, key):
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"backbone.embedding.weight": torch.zeros(8, 16)}, src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps({"d_model": 16, "n_layer": 1, "vocab_size": 8, **change}))
    with pytest.raises(ia.CheckpointError, match=key):
        convert_checkpoint(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


# ----------------------------------------------------------------------------- RWKV .pth

def save_pth(tmp_path, weights: dict):
    pth = tmp_path / "RWKV-x.pth"
    torch.save(weights, pth)
    return pth


def rwkv4_official(model) -> dict:
    """An HF ``RwkvForCausalLM``'s weights under RWKV-LM's RWKV-4 names."""
    mix = {"key": "k", "value": "v", "receptance": "r"}
    out = {}
    for k, v in model.state_dict().items():
        k = k.removeprefix("rwkv.").replace("embeddings", "emb").replace("pre_ln", "ln0")
        k = k.replace("attention.", "att.").replace("feed_forward.", "ffn.")
        for full, short in mix.items():
            k = k.replace(f"time_mix_{full}", f"time_mix_{short}")
        out[k] = v.detach().clone()
    return out


def rwkv_models(version: int):
    torch.manual_seed(0)
    if version == 4:
        return build_hf_model("rwkv", {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3,
                                       "attention_hidden_size": 32, "intermediate_size": 48, "rescale_every": 0,
                                       "tie_word_embeddings": False})
    if version == 5:
        cfg = rwkv5_reference.Rwkv5Config(vocab_size=64, hidden_size=128, num_hidden_layers=2, head_size=64,
                                          intermediate_size=96, rescale_every=0)
        return rwkv5_reference.perturb_weights(rwkv5_reference.Rwkv5ForCausalLM(cfg), seed=0).eval()
    if version == 6:
        cfg = fla_rwkv.RWKV6Config(hidden_size=128, num_heads=2, expand_k=1.0, expand_v=1.0, num_hidden_layers=2,
                                   proj_low_rank_dim=8, gate_low_rank_dim=16, intermediate_size=96, vocab_size=64,
                                   g_norm_eps=64e-5)
        return fla_rwkv.perturb_weights(fla_rwkv.RWKV6ForCausalLM(cfg), seed=0).eval()
    cfg = fla_rwkv.RWKV7Config(hidden_size=128, head_dim=64, num_hidden_layers=3, decay_low_rank_dim=16,
                               gate_low_rank_dim=24, a_low_rank_dim=16, v_low_rank_dim=8, intermediate_size=96,
                               vocab_size=64, norm_eps=1e-5, fuse_norm=False)
    return fla_rwkv.perturb_weights(fla_rwkv.RWKV7ForCausalLM(cfg), seed=0).eval()


OFFICIAL = {4: rwkv4_official, 5: rwkv5_reference.official_state_dict, 6: fla_rwkv.official_state_dict,
            7: fla_rwkv.official_state_dict}
MODEL_TYPE = {4: "rwkv", 5: "rwkv5", 6: "rwkv6", 7: "rwkv7"}


needs_official = pytest.mark.skipif(importlib.util.find_spec("rwkv") is None,
                                    reason=f"the official package is not installed ({fla_rwkv.OFFICIAL_PACKAGE})")


@pytest.mark.parametrize("version", [4, 5, 6, 7])
def test_official_rwkv_pth_round_trip(tmp_path, version):
    """Converted .pth == the torch model the weights came from (1e-4), and == the same model saved
    in HF layout by transformers (exactly: the conversion only renames, transposes and reorders)."""
    model = rwkv_models(version)
    pth = save_pth(tmp_path, OFFICIAL[version](model))
    dst = tmp_path / "dst"
    assert cli.main(["convert", str(pth), str(dst)]) == 0
    assert ia.family_of(dst) == MODEL_TYPE[version]
    diff = max_diff(dst, torch_logits(model))
    print(f"official RWKV-{version} .pth -> {MODEL_TYPE[version]}: max |logit diff| vs torch {diff:.2e}")
    assert diff <= TOL
    assert_same_as_hf_save(dst, model, tmp_path)


@needs_official
@pytest.mark.parametrize("version", [4, 5, 6, 7])
def test_converted_rwkv_matches_the_official_package(tmp_path, version):
    """The independent reference: BlinkDL's ``rwkv`` package run on the very .pth converted."""
    weights = OFFICIAL[version](rwkv_models(version))
    convert_checkpoint(save_pth(tmp_path, weights), tmp_path / "dst")
    ref = fla_rwkv.run_official(weights, IDS, version)
    diff = max_diff(tmp_path / "dst", ref)
    print(f"official RWKV-{version} .pth -> {MODEL_TYPE[version]}: max |logit diff| vs the rwkv package {diff:.2e}")
    assert diff <= TOL


def test_rwkv_generation_and_family_checks(tmp_path):
    model = rwkv_models(6)
    weights = fla_rwkv.official_state_dict(model)
    pth = save_pth(tmp_path, weights)
    with pytest.raises(ia.CheckpointError, match="--family rwkv7 given, but the tensors are an official rwkv6"):
        convert_checkpoint(pth, tmp_path / "dst", "rwkv7")
    with pytest.raises(ia.CheckpointError, match="cannot be written as mamba"):
        convert_checkpoint(pth, tmp_path / "dst", "mamba")
    extra = save_pth(tmp_path, {**weights, "blocks.0.att.surprise": torch.zeros(3)})
    with pytest.raises(ia.CheckpointError, match="blocks.0.att.surprise"):
        convert_checkpoint(extra, tmp_path / "dst")
    del weights["blocks.1.att.time_decay_w1"]
    with pytest.raises(ia.CheckpointError, match="missing tensor blocks.1.att.time_decay_w1"):
        convert_checkpoint(save_pth(tmp_path, weights), tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_without_torch_the_error_says_what_to_install(tmp_path, monkeypatch):
    pth = save_pth(tmp_path, {"emb.weight": torch.zeros(2, 2)})
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(ImportError, match=r"implicit-attn\[convert\]"):
        convert_checkpoint(pth, tmp_path / "dst")


def test_hugging_face_pickles_single_and_sharded(tmp_path):
    """transformers' own layout as pickles (e.g. RWKV/rwkv-4-*-pile): one pytorch_model.bin, or
    shards + pytorch_model.bin.index.json; written as they are."""
    hf = rwkv_models(4)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    ref = torch_logits(hf)
    one = tmp_path / "one"
    hf.config.save_pretrained(one)
    torch.save(sd, one / "pytorch_model.bin")
    assert cli.main(["convert", str(one), str(tmp_path / "dst1"), "--family", "rwkv"]) == 0
    sharded = tmp_path / "sharded"
    hf.config.save_pretrained(sharded)
    names = sorted(sd)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for shard, keys in halves.items():
        torch.save({k: sd[k] for k in keys}, sharded / shard)
    index = {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    convert_checkpoint(sharded, tmp_path / "dst2")
    for dst in ("dst1", "dst2"):
        diff = max_diff(tmp_path / dst, ref)
        print(f"HF pickle ({dst}) -> rwkv: max |logit diff| {diff:.2e}")
        assert diff <= TOL
    with pytest.raises(ia.CheckpointError, match="--family rwkv5 given, but config.json has model_type 'rwkv'"):
        convert_checkpoint(one, tmp_path / "dst3", "rwkv5")
    index["weight_map"]["head.weight"] = "../elsewhere.bin"
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(ia.CheckpointError, match="not a file name inside"):
        convert_checkpoint(sharded, tmp_path / "dst3")
    with pytest.raises(ia.CheckpointError, match="destination is the source"):
        convert_checkpoint(one, one)


def test_bfloat16_weights_stay_bfloat16(tmp_path):
    """Released RWKV-7 .pth files are bfloat16: converted without a float32 detour."""
    weights = {k: v.to(torch.bfloat16) for k, v in OFFICIAL[7](rwkv_models(7)).items()}
    convert_checkpoint(save_pth(tmp_path, weights), tmp_path / "dst")
    _, tensors = read_hf_dir(tmp_path / "dst")
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
    got = np.asarray(tensors["model.layers.1.attn.w_lora.lora.0.weight"], np.float32)
    assert np.array_equal(got, weights["blocks.1.att.w1"].float().numpy().T)
