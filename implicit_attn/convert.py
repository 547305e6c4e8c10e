"""Converting PyTorch-pickle checkpoints into the safetensors layout ``load`` reads
(``implicit-attn convert SRC DST``).

Sources:

- a ``state-spaces/mamba-*`` repository (``mamba_ssm``'s ``MambaLMHeadModel``): a directory with
  ``config.json`` in ``mamba_ssm``'s format (``d_model``, ``n_layer``, ``vocab_size``, ``ssm_cfg``,
  ...) and ``pytorch_model.bin``; written as our ``mamba`` (``ssm_cfg.layer`` absent or
  ``"Mamba1"``) or ``mamba2`` (``"Mamba2"``) family in Hugging Face names;
- an official RWKV ``.pth`` (BlinkDL's RWKV-LM names: ``emb.weight``, ``blocks.{i}.att.*``, ...):
  the generation (RWKV-4, RWKV-5.2, RWKV-6, RWKV-7) is told from the tensor names and shapes and
  the config is read off the shapes; written as ``rwkv`` / ``rwkv5`` / ``rwkv6`` / ``rwkv7``;
- an official Vision Mamba ``.pth`` (``hustvl/Vim``: a dict whose ``"model"`` entry holds
  ``patch_embed.proj.weight``, ``layers.{i}.mixer.conv1d_b.weight``, ...; told from the tensor
  names): the config is read off the shapes, except what the weights do not show (the CLS
  position and ``if_devide_out``: ``vim_cls`` / ``vim_divide_out``, default the released models'
  middle CLS and 1/2); written as our ``vim`` model (``models.vim``, official tensor names);
- a Hugging Face checkpoint saved as pickles (``config.json`` with a registered ``model_type``
  and ``pytorch_model.bin``, or shards listed in ``pytorch_model.bin.index.json``, e.g. the
  ``RWKV/rwkv-4-*-pile`` repositories): the tensors are written as they are.

Pickles are read only with ``torch.load(path, map_location="cpu", weights_only=True)``: a
pickle that holds anything but tensors and plain containers (a pickled object whose loading
would run code) is refused before anything of it runs. A training checkpoint's dict
(``{"model": {...}, "epoch": ...}``) is read for its ``"model"`` entry; ``argparse.Namespace`` (the training arguments DeiT-style
checkpoints carry) is the one class let through, its loading only sets attributes. ``torch`` is imported only when a pickle
is read (it is an optional dependency). ``load`` itself never unpickles anything.

Whatever our families cannot represent is refused with an error naming the config key or
tensor; every converted checkpoint is checked against the family's shape table before it is
written.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from .families.rwkv6.checkpoint import MIX_GROUPS, OFFICIAL_MIX_GROUPS
from .io import TOKENIZER
from .models import vim
from .nn.checkpoint import CheckpointError, check_tensors, write_hf_dir
from .registry import family, model_types

PICKLE_WEIGHTS = "pytorch_model.bin"  # mamba_ssm's and transformers' single file
PICKLE_INDEX = "pytorch_model.bin.index.json"  # transformers' shards
# the families written, by source (a Hugging Face pickle: its own model_type)
MAMBA_FAMILIES = ("mamba", "mamba2")
RWKV_FAMILIES = ("rwkv", "rwkv5", "rwkv6", "rwkv7")
FAMILY_CHOICES = tuple(model_types()) + (vim.MODEL_TYPE,)

# mamba_ssm's MambaConfig: every field and its default
MAMBA_SSM_DEFAULTS = {"d_intermediate": 0, "ssm_cfg": {}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
                      "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
                      "tie_embeddings": True}
MAMBA_SSM_REQUIRED = ("d_model", "n_layer", "vocab_size")
# ssm_cfg keys of mamba_ssm's Mamba / Mamba2 layers: those the forward pass reads (with their
# defaults) and those that only initialise weights or pick kernels (ignored)
MAMBA1_SSM = {"d_state": 16, "d_conv": 4, "expand": 2, "dt_rank": "auto", "conv_bias": True, "bias": False}
MAMBA2_SSM = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "d_ssm": None, "ngroups": 1,
              "D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False, "dt_limit": (0.0, math.inf),
              "bias": False, "conv_bias": True, "chunk_size": 256}
INIT_ONLY_SSM = {"layer", "dt_min", "dt_max", "dt_init", "dt_scale", "dt_init_floor", "A_init_range", "conv_init",
                 "use_fast_path", "use_mem_eff_path"}
MAMBA_SSM_NORM_EPS = 1e-5  # mamba_ssm's norm_epsilon (not in its config)

RWKV_NORM_EPS = 1e-5  # every layer norm of the official RWKV models
RWKV_GROUP_NORM_EPS = 64e-5  # the official ln_x (GroupNorm) eps of RWKV-5/6/7
RWKV5_HEAD_SIZE_DIVISOR = 8  # the rwkv5 family's ln_x eps is 1e-5 * divisor ** 2 = 64e-5


# ----------------------------------------------------------------------------- reading pickles

def torch_module():
    """``torch``, imported on first use (an optional dependency: only conversion needs it)."""
    try:
        import torch
    except ImportError:
        raise ImportError("reading PyTorch checkpoints (.bin/.pth) needs torch, an optional dependency: "
                          "pip install 'implicit-attn[convert]' (or torch)") from None
    return torch


def tensor_to_numpy(torch, name: str, t, where) -> np.ndarray:
    """A floating torch tensor as numpy in its own dtype (bfloat16 through ``ml_dtypes``), sharing
    its memory (no second copy of the checkpoint)."""
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{where}: {name} is a {type(t).__name__}, not a tensor")
    if not t.is_floating_point():
        raise CheckpointError(f"{where}: {name} has dtype {t.dtype}; only floating-point weights are converted")
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def load_failure(e: BaseException) -> str:
    """The informative line of a ``torch.load`` error: the one naming the refused global (torch's
    message starts with advice to load the file unsafely, which is not repeated here), else the
    first line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln or "nsupported" in ln]
    return (named or lines or [type(e).__name__])[0]


def read_pickle(path) -> dict[str, np.ndarray]:
    """The tensors of a PyTorch checkpoint (a ``name -> tensor`` dict), read with
    ``torch.load(path, map_location="cpu", weights_only=True)`` only.

    Raises ``CheckpointError`` naming the file if it is refused (anything that is not tensors
    and plain containers: nothing of it runs), unreadable, or not a flat dict of floating
    tensors; ``ImportError`` without torch."""
    torch = torch_module()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise CheckpointError(f"{path}: refused: torch.load(weights_only=True) cannot read it as plain tensors "
                              f"({type(e).__name__}: {load_failure(e)}); pickled code is never run") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):  # a training checkpoint
        obj = obj["model"]
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path}: expected a non-empty dict of tensor names to tensors, got "
                              f"{type(obj).__name__}")
    out = {}
    for name, t in obj.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{path}: tensor name {name!r} is not a string")
        out[name] = tensor_to_numpy(torch, name, t, path)
    return out


# ----------------------------------------------------------------------------- mamba_ssm

def padded_vocab(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple``, as ``MambaLMHeadModel`` does."""
    if vocab_size % multiple:
        vocab_size += multiple - vocab_size % multiple
    return vocab_size


def check_keys(d: dict, known, where: str) -> None:
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise CheckpointError(f"{where}: unknown key(s) {unknown}; mamba_ssm's config has no such field, so the "
                              "model cannot be converted faithfully")


def int_field(d: dict, key: str, where: str, low: int = 1) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise CheckpointError(f"{where}: {key} must be an integer >= {low}, got {v!r}")
    return v


def refuse(where: str, key: str, value, why: str):
    raise CheckpointError(f"{where}: {key} = {value!r} is not supported: {why}")


def mamba_ssm_config(raw: dict, where: str) -> dict:
    """Our family's HF ``config.json`` dict (``mamba`` or ``mamba2``) for a ``mamba_ssm``
    ``config.json`` dict ``raw``; ``CheckpointError`` naming any key we cannot represent."""
    check_keys(raw, set(MAMBA_SSM_DEFAULTS) | set(MAMBA_SSM_REQUIRED), where)
    missing = [k for k in MAMBA_SSM_REQUIRED if k not in raw]
    if missing:
        raise CheckpointError(f"{where}: missing {missing}")
    c = {**MAMBA_SSM_DEFAULTS, **raw}
    for key in ("rms_norm", "residual_in_fp32", "fused_add_norm", "tie_embeddings"):
        if not isinstance(c[key], bool):
            raise CheckpointError(f"{where}: {key} must be true or false, got {c[key]!r}")
    if not c["rms_norm"]:
        refuse(where, "rms_norm", False, "LayerNorm blocks; the mamba and mamba2 families use RMSNorm")
    if c["attn_layer_idx"]:
        refuse(where, "attn_layer_idx", c["attn_layer_idx"], "attention layers in the stack (mamba_ssm's hybrid)")
    if c["d_intermediate"]:
        refuse(where, "d_intermediate", c["d_intermediate"], "an MLP after every mixer")
    ssm = {} if c["ssm_cfg"] is None else c["ssm_cfg"]  # create_block's reading of null
    if not isinstance(ssm, dict):
        raise CheckpointError(f"{where}: ssm_cfg must be a dict, got {ssm!r}")
    layer = ssm.get("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        refuse(where, "ssm_cfg.layer", layer, "only Mamba1 and Mamba2 layers are converted")
    table = MAMBA1_SSM if layer == "Mamba1" else MAMBA2_SSM
    check_keys(ssm, set(table) | INIT_ONLY_SSM, f"{where} ssm_cfg")
    s = {**table, **{k: v for k, v in ssm.items() if k in table}}
    D = int_field(c, "d_model", where)
    V = padded_vocab(int_field(c, "vocab_size", where), int_field(c, "pad_vocab_size_multiple", where))
    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=int_field(c, "n_layer", where),
                  state_size=int_field(s, "d_state", f"{where} ssm_cfg"),
                  conv_kernel=int_field(s, "d_conv", f"{where} ssm_cfg"),
                  use_bias=s["bias"], use_conv_bias=s["conv_bias"], residual_in_fp32=c["residual_in_fp32"],
                  tie_word_embeddings=c["tie_embeddings"], layer_norm_epsilon=MAMBA_SSM_NORM_EPS)
    expand = s["expand"]
    if isinstance(expand, float) and expand.is_integer():
        expand = int(expand)
    if isinstance(expand, bool) or not isinstance(expand, int) or expand < 1:
        refuse(where, "ssm_cfg.expand", s["expand"], "the families take an integer expand")
    if layer == "Mamba1":
        rank = s["dt_rank"]
        rank = math.ceil(D / 16) if rank == "auto" else int_field(s, "dt_rank", f"{where} ssm_cfg")
        fields = dict(common, expand=expand, intermediate_size=expand * D, time_step_rank=rank)
        model_type = "mamba"
    else:
        for key, ok in (("D_has_hdim", False), ("rmsnorm", True), ("norm_before_gate", False)):
            if s[key] is not ok:
                refuse(where, f"ssm_cfg.{key}", s[key], f"the mamba2 family has {key} = {ok}")
        head = int_field(s, "headdim", f"{where} ssm_cfg")
        d_ssm = expand * D if s["d_ssm"] is None else int_field(s, "d_ssm", f"{where} ssm_cfg")
        if d_ssm % head:
            refuse(where, "ssm_cfg.d_ssm", d_ssm, f"not a multiple of headdim ({head})")
        lim = s["dt_limit"]
        if not isinstance(lim, (list, tuple)) or len(lim) != 2:
            refuse(where, "ssm_cfg.dt_limit", lim, "expected a pair (low, high)")
        fields = dict(common, expand=expand, num_heads=d_ssm // head, head_dim=head,
                      n_groups=int_field(s, "ngroups", f"{where} ssm_cfg"),
                      chunk_size=int_field(s, "chunk_size", f"{where} ssm_cfg"), time_step_limit=tuple(lim))
        model_type = "mamba2"
    try:
        return family(model_type).config(**fields).to_hf()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


def mamba_ssm_tensors(tensors: dict, config: dict, where) -> dict:
    """``mamba_ssm`` tensor names -> Hugging Face ones (``backbone.embedding`` ->
    ``backbone.embeddings``); a tied head is dropped (refused if it differs from the embeddings)."""
    out = {("backbone.embeddings.weight" if k == "backbone.embedding.weight" else k): v for k, v in tensors.items()}
    if config["tie_word_embeddings"] and "lm_head.weight" in out:
        head, emb = out.pop("lm_head.weight"), out.get("backbone.embeddings.weight")
        if emb is None or head.shape != emb.shape or not np.array_equal(head, emb):
            raise CheckpointError(f"{where}: tie_embeddings is true but lm_head.weight differs from "
                                  "backbone.embedding.weight")
    return out


# ----------------------------------------------------------------------------- RWKV (official .pth)

def rwkv_generation(tensors: dict, where) -> str:
    """Our family of an official RWKV checkpoint, from its names and shapes: ``"rwkv7"``
    (``att.r_k``), ``"rwkv6"`` (``att.time_maa_x``), ``"rwkv5"`` (RWKV-5.2: ``att.time_faaaa``,
    ``att.gate``, ``att.time_decay (H, S)``), ``"rwkv"`` (RWKV-4: ``att.time_first``)."""
    b = "blocks.0.att."
    if "emb.weight" not in tensors or b + "output.weight" not in tensors:
        raise CheckpointError(f"{where}: not an official RWKV checkpoint (no emb.weight / blocks.0.att.output.weight)")
    if b + "r_k" in tensors:
        return "rwkv7"
    if b + "time_maa_x" in tensors:
        return "rwkv6"
    if b + "time_faaaa" in tensors:
        decay = tensors[b + "time_decay"] if b + "time_decay" in tensors else None
        if b + "gate.weight" not in tensors or decay is None or decay.ndim != 2 or decay.shape[1] < 2:
            raise CheckpointError(f"{where}: an RWKV-5.0/5.1 checkpoint (blocks.0.att.time_decay "
                                  f"{None if decay is None else tuple(decay.shape)}, gate "
                                  f"{'present' if b + 'gate.weight' in tensors else 'absent'}); only RWKV-5.2 "
                                  "(time_decay (H, S) and a gate) is converted")
        return "rwkv5"
    if b + "time_first" in tensors:
        return "rwkv"
    raise CheckpointError(f"{where}: RWKV generation not recognised from blocks.0.att.* "
                          f"({sorted(k for k in tensors if k.startswith(b))})")


class Taker:
    """Takes tensors out of an official checkpoint by name; what is never taken is an error."""

    def __init__(self, tensors: dict, where):
        self.left, self.where = dict(tensors), where

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.left:
            raise CheckpointError(f"{self.where}: missing tensor {name}")
        return self.left.pop(name)

    def shape(self, name: str) -> tuple:
        if name not in self.left:
            raise CheckpointError(f"{self.where}: missing tensor {name}")
        return tuple(self.left[name].shape)

    def drop(self, *names: str) -> None:
        for n in names:
            self.left.pop(n, None)

    def done(self) -> None:
        if self.left:
            raise CheckpointError(f"{self.where}: unexpected tensor(s) {sorted(self.left)[:8]} for this RWKV "
                                  "generation")


def num_blocks(tensors: dict, where) -> int:
    ids = {int(m.group(1)) for k in tensors for m in [re.match(r"blocks\.(\d+)\.", k)] if m}
    if not ids or ids != set(range(max(ids) + 1)):
        raise CheckpointError(f"{where}: block indices {sorted(ids)[:8]}... are not 0..n-1")
    return max(ids) + 1


def flat(t: np.ndarray) -> np.ndarray:
    return t.reshape(-1)


def transposed(t: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(t.T)


# official -> HF time-mix names of RWKV-4/5 (RWKV-5 adds the gate)
RWKV4_MIX = {"k": "key", "v": "value", "r": "receptance", "g": "gate"}


def rwkv45_tensors(take: Taker, n: int, five: bool) -> dict:
    """RWKV-4 / RWKV-5.2 official names -> the transformers / RWKV team's HF layout."""
    out = {"rwkv.embeddings.weight": take("emb.weight"), "head.weight": take("head.weight")}
    for part in ("weight", "bias"):
        out[f"rwkv.ln_out.{part}"] = take(f"ln_out.{part}")
    for i in range(n):
        b, p = f"blocks.{i}.", f"rwkv.blocks.{i}."
        norms = (("ln0", "pre_ln"),) if i == 0 else ()
        norms += (("ln1", "ln1"), ("ln2", "ln2")) + ((("att.ln_x", "attention.ln_x"),) if five else ())
        for official, ours in norms:
            for part in ("weight", "bias"):
                out[f"{p}{ours}.{part}"] = take(f"{b}{official}.{part}")
        for short in ("kvrg" if five else "kvr"):
            out[f"{p}attention.time_mix_{RWKV4_MIX[short]}"] = take(f"{b}att.time_mix_{short}")
        extra = ("time_decay", "time_faaaa", "gate.weight") if five else ("time_decay", "time_first")
        for name in extra + ("key.weight", "value.weight", "receptance.weight", "output.weight"):
            out[f"{p}attention.{name}"] = take(f"{b}att.{name}")
        for short in "kr":
            out[f"{p}feed_forward.time_mix_{RWKV4_MIX[short]}"] = take(f"{b}ffn.time_mix_{short}")
        for name in ("key.weight", "receptance.weight", "value.weight"):
            out[f"{p}feed_forward.{name}"] = take(f"{b}ffn.{name}")
    return out


def fla_common(take: Taker, i: int, out: dict) -> None:
    """The norms and output projection every fla RWKV-6/7 layer has, official -> fla names."""
    b, p = f"blocks.{i}.", f"model.layers.{i}."
    norms = (("ln0", "pre_norm"),) if i == 0 else ()
    for official, ours in norms + (("ln1", "attn_norm"), ("ln2", "ffn_norm"), ("att.ln_x", "attn.g_norm")):
        for part in ("weight", "bias"):
            out[f"{p}{ours}.{part}"] = take(f"{b}{official}.{part}")
    out[p + "attn.o_proj.weight"] = take(b + "att.output.weight")


def rwkv6_tensors(take: Taker, n: int) -> dict:
    """RWKV-6 official names -> fla's (the inverse of its converter: the LoRA groups of
    ``time_maa_w1/w2`` reordered from ``OFFICIAL_MIX_GROUPS`` to ``MIX_GROUPS``)."""
    out = {}
    order = [OFFICIAL_MIX_GROUPS.index(g) for g in MIX_GROUPS]
    for i in range(n):
        b, a, f = f"blocks.{i}.att.", f"model.layers.{i}.attn.", f"model.layers.{i}.ffn."
        fla_common(take, i, out)
        out[a + "x_proj.0.mu"] = flat(take(b + "time_maa_x"))
        w1 = take(b + "time_maa_w1")  # (C, 5R), groups in the official order
        C, R = w1.shape[0], w1.shape[1] // len(MIX_GROUPS)
        out[a + "x_proj.0.linear.weight"] = transposed(w1.reshape(C, len(MIX_GROUPS), R)[:, order].reshape(C, -1))
        w2 = take(b + "time_maa_w2")  # (5, R, C)
        out[a + "x_proj.2.weight"] = transposed(w2[order].reshape(-1, w2.shape[-1]))
        out[a + "x_bias"] = np.stack([flat(take(b + f"time_maa_{g}")) for g in MIX_GROUPS])
        out[a + "w_proj.linear.lora.2.bias"] = flat(take(b + "time_decay"))
        out[a + "w_proj.linear.lora.0.weight"] = transposed(take(b + "time_decay_w1"))
        out[a + "w_proj.linear.lora.2.weight"] = transposed(take(b + "time_decay_w2"))
        out[a + "bonus"] = take(b + "time_faaaa")
        for official, ours in (("receptance", "r"), ("key", "k"), ("value", "v"), ("gate", "g")):
            out[a + f"{ours}_proj.linear.weight"] = take(b + f"{official}.weight")
        out[f + "key.mu"] = flat(take(f"blocks.{i}.ffn.time_maa_k"))
        out[f + "receptance.mu"] = flat(take(f"blocks.{i}.ffn.time_maa_r"))
        out[f + "key.linear.weight"] = take(f"blocks.{i}.ffn.key.weight")
        out[f + "receptance.linear.weight"] = take(f"blocks.{i}.ffn.receptance.weight")
        out[f + "value.weight"] = take(f"blocks.{i}.ffn.value.weight")
    return out


def rwkv7_tensors(take: Taker, n: int) -> dict:
    """RWKV-7 official names -> fla's (LoRAs ``{n}1 (C, r)``, ``{n}2 (r, C)``, ``{n}0 (1, 1, C)``
    -> ``{n}_lora.lora.0.weight``, ``.2.weight``, ``.2.bias``; layer 0 has no value LoRA)."""
    out = {}
    for i in range(n):
        b, a, f = f"blocks.{i}.att.", f"model.layers.{i}.attn.", f"model.layers.{i}.ffn."
        fla_common(take, i, out)
        for m in "rwkvag":
            out[a + f"x_{m}"] = take(b + f"x_{m}")
        out[a + "k_k"] = flat(take(b + "k_k"))
        out[a + "k_a"] = flat(take(b + "k_a"))
        out[a + "r_k"] = take(b + "r_k")
        for official, ours in (("receptance", "r"), ("key", "k"), ("value", "v")):
            out[a + f"{ours}_proj.weight"] = take(b + f"{official}.weight")
        if i == 0:  # unused by layer 0 (its values are the value residual); training code may store them
            take.drop(b + "v0", b + "v1", b + "v2")
        for m in ("wavg" if i else "wag"):
            lora = a + f"{m}_lora.lora."
            out[lora + "0.weight"] = transposed(take(b + f"{m}1"))
            out[lora + "2.weight"] = transposed(take(b + f"{m}2"))
            if m != "g":
                out[lora + "2.bias"] = flat(take(b + f"{m}0"))
        out[f + "x_k"] = flat(take(f"blocks.{i}.ffn.x_k"))
        out[f + "key.weight"] = take(f"blocks.{i}.ffn.key.weight")
        out[f + "value.weight"] = take(f"blocks.{i}.ffn.value.weight")
    return out


def rwkv_official(tensors: dict, where, model_type: str | None = None) -> tuple[dict, dict]:
    """Our ``(config.json dict, tensors)`` of an official RWKV checkpoint: the generation from
    the names (``rwkv_generation``; ``model_type``, if given, must agree), the config from the
    shapes."""
    found = rwkv_generation(tensors, where)
    if model_type is not None and model_type != found:
        raise CheckpointError(f"{where}: --family {model_type} given, but the tensors are an official {found} "
                              "checkpoint")
    take = Taker(tensors, where)
    n = num_blocks(tensors, where)
    V, C = take.shape("emb.weight")
    if "blocks.0.ln0.weight" not in tensors:
        raise CheckpointError(f"{where}: missing tensor blocks.0.ln0.weight (the norm of the embeddings)")
    b = "blocks.0."
    F = take.shape(b + "ffn.key.weight")[0]
    common = dict(vocab_size=V, hidden_size=C, num_hidden_layers=n, intermediate_size=F, tie_word_embeddings=False)
    if found in ("rwkv", "rwkv5"):
        # the official weights are the training form; rescale_every 0: no eval-time halving
        # (the official package in float32)
        fields = dict(common, layer_norm_epsilon=RWKV_NORM_EPS, rescale_every=0)
        if found == "rwkv":
            fields["attention_hidden_size"] = take.shape(b + "att.key.weight")[0]
        else:
            fields.update(head_size=take.shape(b + "att.time_decay")[1],
                          head_size_divisor=RWKV5_HEAD_SIZE_DIVISOR)
        out = rwkv45_tensors(take, n, five=found == "rwkv5")
    elif found == "rwkv6":
        H = take.shape(b + "att.time_faaaa")[0]
        fields = dict(common, num_heads=H, expand_k=1.0, expand_v=1.0,
                      proj_low_rank_dim=take.shape(b + "att.time_maa_w1")[1] // len(MIX_GROUPS),
                      gate_low_rank_dim=take.shape(b + "att.time_decay_w1")[1], norm_eps=RWKV_NORM_EPS,
                      g_norm_eps=RWKV_GROUP_NORM_EPS)
        out = rwkv6_tensors(take, n)
    else:
        head = take.shape(b + "att.r_k")[1]
        if head * RWKV_NORM_EPS != RWKV_GROUP_NORM_EPS:
            raise CheckpointError(f"{where}: blocks.0.att.r_k has head size {head}: the rwkv7 family's ln_x eps is "
                                  f"head_dim x norm_eps, which equals the official {RWKV_GROUP_NORM_EPS} with the "
                                  "layer norms' 1e-5 only for heads of 64")
        v_rank = take.shape("blocks.1.att.v1")[1] if n > 1 else 16
        fields = dict(common, head_dim=head, decay_low_rank_dim=take.shape(b + "att.w1")[1],
                      a_low_rank_dim=take.shape(b + "att.a1")[1], v_low_rank_dim=v_rank,
                      gate_low_rank_dim=take.shape(b + "att.g1")[1], norm_eps=RWKV_NORM_EPS, fuse_norm=False)
        out = rwkv7_tensors(take, n)
    if found in ("rwkv6", "rwkv7"):
        out["model.embeddings.weight"] = take("emb.weight")
        out["lm_head.weight"] = take("head.weight")
        for part in ("weight", "bias"):
            out[f"model.norm.{part}"] = take(f"ln_out.{part}")
    take.done()
    try:
        config = family(found).config(**fields).to_hf()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    return config, out


# ----------------------------------------------------------------------------- Vision Mamba

def is_vim(tensors: dict) -> bool:
    """Whether the tensor names are an official ViM checkpoint's."""
    return "patch_embed.proj.weight" in tensors and "layers.0.mixer.conv1d_b.weight" in tensors


def vim_official(tensors: dict, where, cls_position: str = "middle", divide_out: bool = True) -> tuple[dict, dict]:
    """Our ``(config.json dict, tensors)`` of an official ViM checkpoint (``bimamba_type="v2"``,
    RMSNorm, a CLS token, absolute position embeddings): the sizes from the shapes, the names
    kept; ``cls_position`` / ``divide_out`` as given (the weights do not show them). Anything
    else (a LayerNorm model's biases, RoPE, two CLS tokens, ...) is refused naming the tensor."""
    take = Taker(tensors, where)
    D, chans, P, P2 = take.shape("patch_embed.proj.weight")
    n_tok = take.shape("pos_embed")[1]
    grid = math.isqrt(n_tok - 1)
    if P != P2 or grid * grid != n_tok - 1:
        raise CheckpointError(f"{where}: patch_embed.proj.weight {(D, chans, P, P2)} and pos_embed of {n_tok} "
                              "positions are not square patches on a square grid plus one CLS token")
    ids = {int(m.group(1)) for k in tensors for m in [re.match(r"layers\.(\d+)\.", k)] if m}
    if not ids or ids != set(range(max(ids) + 1)):
        raise CheckpointError(f"{where}: layer indices {sorted(ids)[:8]} are not 0..n-1")
    inner, state = take.shape("layers.0.mixer.A_log")
    if inner % D:
        raise CheckpointError(f"{where}: layers.0.mixer.A_log has {inner} channels, not a multiple of the width {D}")
    fields = dict(image_size=grid * P, patch_size=P, hidden_size=D, num_labels=take.shape("head.weight")[0],
                  num_channels=chans, num_hidden_layers=max(ids) + 1, state_size=state,
                  conv_kernel=take.shape("layers.0.mixer.conv1d.weight")[2], expand=inner // D,
                  time_step_rank=take.shape("layers.0.mixer.dt_proj.weight")[1], cls_position=cls_position,
                  divide_out=divide_out)
    try:
        cfg = vim.Config(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    check_tensors(tensors, vim.expected_shapes(cfg), where=str(where))
    return cfg.to_hf(), dict(tensors)


# ----------------------------------------------------------------------------- Hugging Face pickles

def read_pickle_shards(directory: Path) -> dict[str, np.ndarray]:
    """The tensors of a transformers pickle checkpoint: ``pytorch_model.bin``, else the shards
    named in ``pytorch_model.bin.index.json`` (each a plain file name inside ``directory``)."""
    if (directory / PICKLE_WEIGHTS).is_file():
        return read_pickle(directory / PICKLE_WEIGHTS)
    index = directory / PICKLE_INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a readable shard index with a weight_map ({e})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard files")
    out = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
            raise CheckpointError(f"{index}: shard {shard!r} is not a file name inside {directory}")
        tensors = read_pickle(directory / shard)
        clash = sorted(set(tensors) & set(out))
        if clash:
            raise CheckpointError(f"{directory / shard}: tensor {clash[0]} is also in another shard")
        out.update(tensors)
    return out


# ----------------------------------------------------------------------------- the command

def find_source(src: Path) -> tuple[str, Path, dict | None]:
    """``(kind, weights file or directory, config.json dict or None)`` of a source:
    ``"mamba_ssm"`` for a directory (or its ``pytorch_model.bin``) with a ``mamba_ssm``
    ``config.json``; ``"hf"`` for a directory whose ``config.json`` has a registered
    ``model_type`` (its pickles: ``pytorch_model.bin`` or shards); ``"rwkv"`` for a ``.pth`` file
    (or a directory holding exactly one)."""
    directory = src if src.is_dir() else src.parent
    weights = src if src.is_file() else None
    cfg_path = directory / "config.json"
    if cfg_path.is_file() and (weights is None or weights.suffix != ".pth"):
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{cfg_path}: not readable JSON ({e})") from None
        if isinstance(raw, dict) and "d_model" in raw:
            weights = weights or directory / PICKLE_WEIGHTS
            if not weights.is_file():
                shards = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
                raise CheckpointError(f"{directory}: mamba_ssm config.json but no {PICKLE_WEIGHTS}"
                                      + (f" (sharded {shards} are not supported)" if shards else ""))
            return "mamba_ssm", weights, raw
        if isinstance(raw, dict) and "model_type" in raw:
            family(raw["model_type"])  # an unknown model_type fails here, naming the supported ones
            if not ((directory / PICKLE_WEIGHTS).is_file() or (directory / PICKLE_INDEX).is_file()):
                raise CheckpointError(f"{directory}: config.json has model_type {raw['model_type']!r} but there is "
                                      f"no {PICKLE_WEIGHTS} or {PICKLE_INDEX} to convert")
            return "hf", directory, raw
    if weights is None:
        pths = sorted(directory.glob("*.pth"))
        if len(pths) != 1:
            raise CheckpointError(f"{directory}: neither a mamba_ssm checkpoint (config.json with d_model + "
                                  f"{PICKLE_WEIGHTS}) nor a directory with one RWKV or ViM .pth "
                                  f"(found {[p.name for p in pths]}); pass the file itself")
        weights = pths[0]
    return "rwkv", weights, None


def convert_checkpoint(src, dst, model_type: str | None = None, vim_cls: str = "middle",
                       vim_divide_out: bool = True) -> dict:
    """Convert a PyTorch-pickle checkpoint ``src`` (see the module docstring) into a Hugging Face
    safetensors directory ``dst`` that ``load`` reads.

    Args:
      src: a ``mamba_ssm`` directory (``config.json`` + ``pytorch_model.bin``), an official
        RWKV ``.pth`` file (or a directory holding one), or a Hugging Face directory with pickled
        weights (``pytorch_model.bin`` or shards + ``pytorch_model.bin.index.json``).
      dst: the output directory (created; must not be ``src``'s directory).
      model_type: optional family to insist on (a registered ``model_type`` or ``"vim"``); an
        error if the source is another.
      vim_cls, vim_divide_out: an official ViM checkpoint's CLS position (``"middle"``,
        ``"start"``, ``"end"``) and ``if_devide_out`` (``models.vim.Config``).
    Returns:
      The ``config.json`` dict written.
    Raises:
      ``CheckpointError`` naming the file, tensor or config key that is refused (a malicious or
      non-tensor pickle included), ``ImportError`` without torch, ``ValueError`` for a bad
      ``model_type``.
    """
    if model_type is not None and model_type not in FAMILY_CHOICES:
        raise ValueError(f"family {model_type!r} is not a registered model_type; choose one of {FAMILY_CHOICES}")
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or directory")
    kind, weights, raw = find_source(src)
    src_dir = weights if kind == "hf" else weights.parent
    if dst.exists() and dst.resolve() == src_dir.resolve():
        raise CheckpointError(f"{dst}: the destination is the source directory; write to another directory")
    tensors = read_pickle_shards(src_dir) if kind == "hf" else read_pickle(weights)
    if kind == "hf":
        config = raw
        if model_type is not None and model_type != config["model_type"]:
            raise CheckpointError(f"{src_dir}: --family {model_type} given, but config.json has model_type "
                                  f"{config['model_type']!r}")
    elif kind == "mamba_ssm":
        config = mamba_ssm_config(raw, str(src_dir / "config.json"))
        if model_type is not None and model_type != config["model_type"]:
            raise CheckpointError(f"{src_dir}: --family {model_type} given, but its ssm_cfg makes it "
                                  f"{config['model_type']}")
        tensors = mamba_ssm_tensors(tensors, config, weights)
    elif is_vim(tensors):
        if model_type not in (None, vim.MODEL_TYPE):
            raise CheckpointError(f"{weights}: --family {model_type} given, but the tensors are an official ViM "
                                  "checkpoint")
        config, tensors = vim_official(tensors, weights, vim_cls, vim_divide_out)
    else:
        if model_type is not None and model_type not in RWKV_FAMILIES:
            raise CheckpointError(f"{weights}: an RWKV .pth cannot be written as {model_type}")
        config, tensors = rwkv_official(tensors, weights, model_type)
    if config["model_type"] != vim.MODEL_TYPE:  # vim_official checked every name and shape
        family(config["model_type"]).to_params(config, tensors)  # every name and shape, before writing
    write_hf_dir(dst, config, tensors)
    tok = src_dir / TOKENIZER
    if tok.is_file():
        shutil.copyfile(tok, dst / TOKENIZER)
    return config


__all__ = ["convert_checkpoint", "read_pickle", "mamba_ssm_config", "mamba_ssm_tensors", "rwkv_generation",
           "rwkv_official", "is_vim", "vim_official", "padded_vocab", "FAMILY_CHOICES"]
