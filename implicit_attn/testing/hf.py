"""Hugging Face torch references for tests: build the HF model of a config, load it in JAX,
and assert that the two agree (logits, every layer's mixer output, exact operators).

Needs the ``test`` extra (torch, transformers): ``pip install implicit-attn[test]``.

    from implicit_attn.testing import assert_hf_parity
    report = assert_hf_parity("mamba", {"vocab_size": 64, "hidden_size": 16}, ids)
"""
from __future__ import annotations

import tempfile

import numpy as np

from .. import io
from ..registry import family
from .deps import require

torch = require("torch")
transformers = require("transformers")

from . import fla_rwkv, rwkv5_reference  # noqa: E402  (need torch and transformers, checked above)

# Where the reference torch classes are found: transformers, then our plain-torch versions of the
# models transformers does not ship (flash-linear-attention's RWKV-6/7, the RWKV team's RWKV-5).
REFERENCE_MODULES = (transformers, fla_rwkv, rwkv5_reference)


def reference_class(name: str):
    """The torch reference class ``name`` (a ``FamilySpec.hf_class`` or ``hf_config_class``):
    from transformers, else from ``testing.fla_rwkv`` or ``testing.rwkv5_reference``
    (``REFERENCE_MODULES``, in order). ``AttributeError`` if none has it."""
    for module in REFERENCE_MODULES:
        cls = getattr(module, name, None)
        if cls is not None:
            return cls
    raise AttributeError(f"no reference class {name!r} in transformers {transformers.__version__} or "
                         "implicit_attn.testing's reference modules")

ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def hf_config_kwargs(model_type: str, config: dict | None = None) -> dict:
    """Keyword arguments of the family's HF config class for ``config`` (default: the
    family's tiny test config). Flat ``rope_theta`` / ``partial_rotary_factor`` given next
    to ``rope_parameters`` (RecurrentGemma) are folded into it, and such models run their
    attention eagerly (the reference path)."""
    spec = family(model_type)
    kw = dict(spec.tiny if config is None else config)
    if "rope_parameters" in kw:
        rope = dict(kw["rope_parameters"])
        for k in ROPE_KEYS:
            if k in kw:
                rope[k] = kw.pop(k)
        kw["rope_parameters"] = rope
        kw["attn_implementation"] = "eager"
    return kw


def build_hf_model(model_type: str, config: dict | None = None, seed: int = 0, path=None):
    """A random HF torch model of ``model_type`` for the HF config kwargs ``config``
    (default: ``FamilySpec.tiny``), seeded by ``seed`` and prepared by the family's
    ``hf_setup`` (parameters moved off trivial initial values); in eval mode.

    If ``path`` is given, the model is saved there (safetensors) before any forward pass.
    Returns the ``transformers`` ``*ForCausalLM`` model (float32)."""
    spec = family(model_type)
    kw = hf_config_kwargs(model_type, config)
    torch.manual_seed(seed)
    model = reference_class(spec.hf_class)(reference_class(spec.hf_config_class)(**kw)).eval()
    spec.hf_setup(model, torch, seed)
    if path is not None:
        model.save_pretrained(path, safe_serialization=True)
    return model


def save_hf_model(torch_model, path) -> None:
    """``torch_model.save_pretrained(path)`` in the checkpoint's own form, also after a
    forward pass: models that rescale weights in place for inference (HF RWKV's
    ``layers_are_rescaled``) are first put back in their training form (exactly: the
    factors are powers of two); the next eval forward rescales them again."""
    for m in torch_model.modules():
        if getattr(m, "layers_are_rescaled", False) and hasattr(m, "_rescale_layers"):
            was_training = m.training
            m.train()
            m._rescale_layers()
            m.train(was_training)
    torch_model.save_pretrained(path, safe_serialization=True)


def load_jax_from_hf(torch_model, dtype=None):
    """The JAX model (``implicit_attn`` LM) of an HF torch model, through its saved
    checkpoint (``save_pretrained`` to a temporary directory, then ``implicit_attn.load``).
    ``dtype``: as for ``implicit_attn.load`` (None: the checkpoint's)."""
    with tempfile.TemporaryDirectory() as d:
        save_hf_model(torch_model, d)
        return io.load(d, dtype=dtype)


def hf_module(torch_model, path: str):
    """The submodule of ``torch_model`` at dotted ``path`` (digits index lists). ``path`` may
    list alternatives separated by ``|`` (hybrid layers: ``"...{i}.mamba|...{i}.self_attn"``):
    the first that exists and is not ``None``. ``AttributeError`` if none does."""
    for alt in path.split("|"):
        obj = torch_model
        try:
            for part in alt.split("."):
                obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
        except AttributeError:
            continue
        if obj is not None:
            return obj
    raise AttributeError(f"{type(torch_model).__name__} has no submodule {path!r}")


def torch_forward(torch_model, input_ids, mixer_path: str | None = None):
    """The torch model's logits and each layer's mixer input and output.

    Args:
      torch_model: an HF ``*ForCausalLM`` of a registered family.
      input_ids: ``(B, L)`` int token ids.
      mixer_path: dotted path of HF layer ``{i}``'s mixer (default: the family's
        ``FamilySpec.hf_mixer``; ``FamilySpec.hf_mixer_layers`` maps our layers to HF's
        layers or names their mixers' modules);
        paths joined by ``+`` are modules whose outputs ``FamilySpec.hf_mixer_output``
        combines into the mixer output (the input is the first one's).
    Returns:
      ``(logits (B, L, vocab) float32, {layer: (mixer input (B, L, D), mixer output (B, L, D))})``
      as numpy arrays.
    """
    spec = family(torch_model.config.model_type)
    path = mixer_path or spec.hf_mixer
    hf_layers = (range(torch_model.config.num_hidden_layers) if spec.hf_mixer_layers is None
                 else spec.hf_mixer_layers(torch_model.config))
    parts = path.split("+")  # modules that together make one mixer (Falcon-H1: Mamba and attention)
    seen = {}
    hooks = []
    for i, hf_layer in enumerate(hf_layers):
        for j, part in enumerate(parts):
            def hook(mod, args, kwargs, out, key=(i, j)):
                if spec.hf_mixer_input is not None:  # a mixer that reads more than its input
                    x = spec.hf_mixer_input(torch, mod, args, kwargs)
                else:
                    x = args[0] if args else kwargs["hidden_states"]  # some HF layers call mixers by keyword
                out = out[0] if isinstance(out, tuple) else out
                seen[key] = (x.detach().float().numpy().copy(), out.detach().float().numpy().copy())
            where = hf_layer if isinstance(hf_layer, str) else part.format(i=hf_layer)
            module = hf_module(torch_model, where)
            hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = torch_model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long), use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    io_ = {}
    for i in range(len(hf_layers)):
        if (i, 0) not in seen:
            continue
        outs = [seen[i, j][1] for j in range(len(parts))]
        out = outs[0] if len(parts) == 1 else spec.hf_mixer_output(torch_model.config, outs)
        io_[i] = (seen[i, 0][0], out)
    return logits.float().numpy(), io_


def max_rel_error(a, b) -> float:
    """``max |a - b| / max |b|`` in float64 (0 for empty arrays)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def random_ids(vocab_size: int, batch: int = 2, length: int = 11, seed: int = 0) -> np.ndarray:
    """Seeded random ``(batch, length)`` int64 token ids below ``vocab_size``."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, length))


def assert_hf_parity(model, config: dict | None = None, input_ids=None, *, seed: int = 0, jax_model=None,
                     atol: float = 1e-4, rtol: float = 1e-5, exact_tol: float = 1e-5,
                     variants=None) -> dict:
    """Assert that the JAX model of an HF torch model reproduces it, layer by layer.

    Checks, in float32: (1) the logits, ``max |ours - torch| <= atol``; (2) every layer's
    mixer input (captured in the torch forward) and the output of our mixer applied to the
    torch mixer's input, each ``max_rel_error <= rtol`` against torch (hooks on
    ``FamilySpec.hf_mixer``); (3) every layer's operator of every variant in ``variants``
    (default: the family's ``exact_variants``) is exact: ``op.apply()`` (``H @ values +
    offset``) equals the block's own token-mixing output ``op.output``,
    ``op.relative_error() <= exact_tol``, with the ``(B, C, L, L)`` shape of the input.

    Args:
      model: a registered ``model_type`` (the torch model is then built from ``config``
        and ``seed`` with ``build_hf_model``) or an HF torch ``*ForCausalLM`` (``config``
        must then be None).
      config: HF config kwargs (default: the family's tiny config); see ``strategies.configs``.
      input_ids: ``(B, L)`` int ids (default: ``random_ids(vocab_size, 2, 11, seed)``).
      jax_model: the JAX model to check (default: ``load_jax_from_hf`` of the torch model).
      variants: operator variants that must be exact (default ``FamilySpec.exact_variants``).
    Returns:
      ``{"model_type", "logits": max abs error, "mixer_inputs": [per layer rel. error],
      "mixers": [per layer rel. error], "exactness": {variant: [per layer relative_error]}}``.
    Raises:
      AssertionError naming the first check, layer and variant that fails.
    """
    if isinstance(model, str):
        tm = build_hf_model(model, config, seed)
    else:
        if config is not None:
            raise ValueError("config is only used with a model_type; got a torch model and a config")
        tm = model
    spec = family(tm.config.model_type)
    ours = load_jax_from_hf(tm) if jax_model is None else jax_model
    ids = random_ids(tm.config.vocab_size, seed=seed) if input_ids is None else np.asarray(input_ids)
    B, L = ids.shape
    ref_logits, ref_io = torch_forward(tm, ids, spec.hf_mixer)
    where = f"{spec.label} ({spec.model_type})"

    logits = np.asarray(ours(ids))
    if logits.shape != ref_logits.shape:
        raise AssertionError(f"{where}: logits shape {logits.shape}, torch {ref_logits.shape}")
    err = float(np.max(np.abs(logits.astype(np.float64) - ref_logits)))
    report = {"model_type": spec.model_type, "logits": err, "mixer_inputs": [], "mixers": [], "exactness": {}}
    if not err <= atol:
        raise AssertionError(f"{where}: logits differ from torch by {err:.3g} > atol={atol:g}")

    xs = ours.mixer_inputs(ids)
    if len(ours.layers) != len(ref_io):
        raise AssertionError(f"{where}: {len(ours.layers)} layers, torch ran {len(ref_io)} mixers")
    for i in range(len(ours.layers)):
        x_t, y_t = ref_io[i]
        e_in = max_rel_error(xs[i], x_t)
        e_out = max_rel_error(ours.layers[i].mixer(x_t), y_t)
        report["mixer_inputs"].append(e_in)
        report["mixers"].append(e_out)
        if not e_in <= rtol:
            raise AssertionError(f"{where}: layer {i} mixer input differs from torch (rel. error {e_in:.3g} > "
                                 f"rtol={rtol:g})")
        if not e_out <= rtol:
            raise AssertionError(f"{where}: layer {i} mixer output differs from torch's mixer on the same input "
                                 f"(rel. error {e_out:.3g} > rtol={rtol:g})")

    for v in spec.exact_variants if variants is None else variants:
        errs = report["exactness"][v] = []
        for i, op in enumerate(ours.operators(ids, variant=v)):
            if op.shape[0] != B or op.shape[2:] != (L, L):
                raise AssertionError(f"{where}: layer {i} operator ({v}) has shape {op.shape} for ids {ids.shape}")
            e = op.relative_error()
            errs.append(e)
            if not e <= exact_tol:
                raise AssertionError(f"{where}: layer {i} operator (variant {v!r}) is not exact: H @ values + offset "
                                     f"differs from the block output by {e:.3g} > exact_tol={exact_tol:g}")
    return report


def assert_loads_as_language_model(torch_model, path, model_type: str, tied: bool, input_ids) -> None:
    """Assert that the vision-language checkpoint at ``path`` (saved from ``torch_model``, a
    transformers ``*ForConditionalGeneration``) loads as its language model: a ``model_type``
    model tied as ``tied`` says, whose logits on the text ids ``input_ids (B, L)`` are the torch
    model's to 1e-4 and whose operators are exact to 1e-5."""
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(np.asarray(input_ids))).logits.numpy()
    model = io.load(path)
    assert model.family == model_type, (model.family, model_type)
    assert model.config.tie_word_embeddings == tied, model.config.tie_word_embeddings
    err = float(np.abs(np.asarray(model(input_ids)) - ref).max())
    assert err <= 1e-4, f"logits differ from torch by {err:.2e}"
    exact = max(op.relative_error() for op in model.operators(input_ids))
    assert exact <= 1e-5, f"operators' relative error {exact:.2e}"


__all__ = ["REFERENCE_MODULES", "assert_loads_as_language_model", "reference_class", "build_hf_model",
           "hf_config_kwargs", "save_hf_model", "load_jax_from_hf", "hf_module", "torch_forward", "max_rel_error",
           "random_ids", "assert_hf_parity"]
