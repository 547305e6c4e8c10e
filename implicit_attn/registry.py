"""The one place families are listed: ``model_type -> FamilySpec``. ``io``, the CLI,
``explain``, ``weights_convert``, the tests and the benchmarks all read it.

Adding an architecture: a folder under ``families/`` whose ``__init__`` defines ``SPEC``,
and one line in ``_SPECS`` below (see the README, "Adding an architecture").
"""
from __future__ import annotations

import warnings

import numpy as np

from .families import (bailing_hybrid, bamba, falcon_h1, falcon_mamba, granite, griffin, jamba, kimi_linear,
                       lara_mini, lfm2, mamba, mamba2, minimax, nemotron_h, olmo_hybrid, qwen3_5, qwen3_next, rwkv,
                       rwkv5, rwkv6, rwkv7, xlstm, zamba, zamba2)
from .nn import FamilySpec
from .nn.checkpoint import dequantized_fp8, fp8_blocks, read_hf_dir, with_prefixes, without_unread
from .nn.compressed import compressed_schemes, dequantized_compressed
from .nn.modelopt import dequantized_modelopt, modelopt_scheme, with_hf_quant_config

_SPECS = (mamba.SPEC, mamba2.SPEC, griffin.SPEC, rwkv.SPEC, falcon_mamba.SPEC, bamba.SPEC, granite.SPEC, jamba.SPEC,
          nemotron_h.SPEC, falcon_h1.SPEC, zamba2.SPEC, zamba.SPEC, qwen3_next.SPEC,
          qwen3_5.SPEC, qwen3_5.MOE_SPEC, olmo_hybrid.SPEC, lara_mini.SPEC, kimi_linear.SPEC,
          bailing_hybrid.SPEC, minimax.SPEC, rwkv5.SPEC, rwkv6.SPEC, rwkv7.SPEC, lfm2.SPEC, lfm2.MOE_SPEC,
          lfm2.LFM3_SPEC, xlstm.SPEC)

FAMILIES: dict[str, FamilySpec] = {s.model_type: s for s in _SPECS}
# checkpoint types holding a family's model as their language model: model_type -> Container
# (one definition per type, however many families it may hold)
CONTAINERS: dict = {}
for _container in (c for s in _SPECS for c in s.containers):
    if CONTAINERS.setdefault(_container.model_type, _container) != _container:
        raise ValueError(f"two different definitions of the container type {_container.model_type!r}")


def family(model_type) -> FamilySpec:
    """The spec of ``model_type``; ``ValueError`` naming the supported types otherwise."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def checkpoint_family(config: dict, where="config.json"):
    """``(spec, container)`` of a checkpoint's ``config.json`` dict: for a family's own
    ``model_type`` ``(spec, None)``; for a container type (``CONTAINERS``) the family of its
    language model (the ``model_type`` of ``config[container.config_key]``, which must list
    the container in ``FamilySpec.containers``) and the ``checkpoint.Container``.
    ``ValueError`` naming the supported types otherwise (``CheckpointError``, naming ``where``,
    for a container config without its language model's)."""
    model_type = config.get("model_type")
    container = CONTAINERS.get(model_type) if isinstance(model_type, str) else None
    if container is None:
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}, and the language "
                             f"models of {sorted(CONTAINERS)}")
        return FAMILIES[model_type], None
    inner = container.language_config(config, where)["model_type"]
    readers = sorted(s.model_type for s in _SPECS if container in s.containers)
    if inner not in readers:
        raise ValueError(f"the language model of a {model_type!r} checkpoint is of model_type {inner!r}; "
                         f"supported there: {readers}")
    return FAMILIES[inner], container


def family_checkpoint(config: dict, tensors: dict, where="checkpoint", dtype=None) -> tuple[FamilySpec, dict, dict]:
    """``(spec, config, tensors)`` of a checkpoint's ``config.json`` dict and tensors, put in
    the form the family's ``to_params`` reads: for a container type its language model's
    config and tensors (``checkpoint_family``), without the tensors the family does not read
    (``FamilySpec.unread_tensors``), the weights of a fine-grained FP8, compressed-tensors or
    ModelOpt checkpoint dequantized (as ``dtype``; None: the checkpoint's other tensors' dtype, see
    ``dequantized_fp8``, ``nn.compressed.dequantized_compressed``, ``nn.modelopt.dequantized_modelopt``),
    under the saved names (``tensor_prefixes``, and
    ``state_dict_names`` for a file written from transformers' ``state_dict()``), with an
    output head a tied config does not use handled as transformers does (``_untie_like_hf``).
    The tensors stay the views they were (only a head is compared with the embeddings, and
    FP8 weights are computed). ``CheckpointError`` naming ``where`` (or
    ``ValueError`` for an unknown type) as ``checkpoint_family`` and ``StateDictNames`` say."""
    spec, container = checkpoint_family(config, where)
    # the outer config's quantization, for a container
    schemes, modelopt = compressed_schemes(config, where), modelopt_scheme(config, where)
    blocks = fp8_blocks(config, where) if schemes is None and modelopt is None else None
    if container is not None:  # e.g. a vision-language checkpoint: its language model alone
        config, tensors = container.language_config(config, where), container.language_tensors(tensors, where)
    if spec.unread_tensors is not None:  # e.g. multi-token-prediction layers, which HF skips too
        tensors = without_unread(tensors, spec.unread_tensors(config))
    if blocks is not None:  # each weight next to its scales, before any renaming
        tensors = dequantized_fp8(tensors, blocks, dtype, where)
    file_name = None if container is None else container.file_name  # the outer config names modules so
    if schemes is not None:
        tensors = dequantized_compressed(tensors, schemes, dtype, where, file_name)
    if modelopt is not None:
        tensors = dequantized_modelopt(tensors, modelopt, dtype, where, file_name)
    if spec.tensor_prefixes:  # names transformers maps by a prefix change (Qwen3.5's text model)
        tensors = with_prefixes(tensors, spec.tensor_prefixes, where)
    if spec.state_dict_names is not None:  # a file written from transformers' state_dict(): fused experts...
        tensors = spec.state_dict_names.saved_tensors(tensors, _shape_table(spec, config), where)
    config, tensors = _untie_like_hf(spec, config, tensors, where)
    return spec, config, tensors


def read_family_checkpoint(path, dtype=None) -> tuple[FamilySpec, dict, dict]:
    """``family_checkpoint`` of the Hugging Face directory ``path`` (``read_hf_dir``), where a
    ModelOpt export that describes its quantization in ``hf_quant_config.json`` only reads that
    file as its ``quantization_config`` (``nn.modelopt.with_hf_quant_config``)."""
    config, tensors = read_hf_dir(path)
    return family_checkpoint(with_hf_quant_config(config, path), tensors, path, dtype)


def _shape_table(spec: FamilySpec, config: dict) -> dict:
    """``{tensor name: shape}`` of every tensor (required or optional) a checkpoint with HF
    config dict ``config`` may hold; empty when the config does not parse (``to_params`` then
    names the problem)."""
    try:
        required, optional = spec.expected_shapes(spec.config.from_hf(config))
    except (TypeError, ValueError, ArithmeticError):
        return {}
    return {**optional, **required}


def _head_names(spec, config: dict) -> tuple[set, dict] | None:
    """``(output-head tensor names, required names -> shapes)`` of a tied ``config``: the
    tensors of a module named ``*head`` the untied form of the config requires on top of the
    tied one (Zamba2's untied form also requires every shared block: not heads); None when the
    config is not tied (or not parseable: ``to_params`` reports that)."""
    try:
        tied = spec.config.from_hf(config)
        if not getattr(tied, "tie_word_embeddings", False):
            return None
        untied = spec.config.from_hf({**config, "tie_word_embeddings": False})
    except (TypeError, ValueError, ArithmeticError):
        return None
    req_tied = spec.expected_shapes(tied)[0]
    heads = {n for n in set(spec.expected_shapes(untied)[0]) - set(req_tied) if n.rsplit(".", 2)[-2].endswith("head")}
    return heads, req_tied


def _untie_like_hf(spec, config: dict, tensors: dict, path) -> tuple[dict, dict]:
    """Follow ``transformers`` (checked against 5.23 for every family) when a config ties
    the output head to the embeddings but the file also holds an output head: if the head
    equals the embedding matrix it is dropped (tied, same numbers); if it differs, HF does
    not tie and uses the file's head, so the model is loaded untied (``tie_word_embeddings``
    False, a warning names the tensors) and gives HF's logits. A file holding the head but
    no embedding matrix (``safetensors.torch.save_model`` keeps one name of a tied pair:
    ``lm_head.weight`` where it sorts first) is read with the head as the embeddings, as HF
    ties a missing embedding to a present head."""
    names = _head_names(spec, config)
    if names is None:
        return config, tensors
    heads, required = names
    present = sorted(h for h in heads if h in tensors)
    if not present:
        return config, tensors
    embeds = [n for n in sorted(required) if "embed" in n and len(required[n]) == 2]  # the embedding matrix
    if len(embeds) == 1 and embeds[0] not in tensors and len(present) == 1:
        return config, {(embeds[0] if k == present[0] else k): v for k, v in tensors.items()}
    embeds = [n for n in embeds if n in tensors]
    same = all(len(embeds) == 1 and tensors[h].shape == tensors[embeds[0]].shape
               and tensors[h].dtype == tensors[embeds[0]].dtype and np.array_equal(tensors[h], tensors[embeds[0]])
               for h in present)
    if same:
        return config, {k: v for k, v in tensors.items() if k not in heads}
    warnings.warn(f"{path}: config.json ties the output head to the embeddings (tie_word_embeddings) but the "
                  f"checkpoint holds a different {', '.join(present)}; like transformers, the file's head is "
                  f"used and the model is loaded untied (set tie_word_embeddings to false to silence this)",
                  stacklevel=4)
    return {**config, "tie_word_embeddings": False}, tensors


def model_types() -> list[str]:
    """Every supported ``model_type``, sorted."""
    return sorted(FAMILIES)


__all__ = ["FAMILIES", "CONTAINERS", "FamilySpec", "family", "checkpoint_family", "family_checkpoint", "read_family_checkpoint",
           "model_types"]
