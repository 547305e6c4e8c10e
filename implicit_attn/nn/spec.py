"""``FamilySpec``: everything the rest of the library (io, cli, explain, tests, benchmarks)
needs to know about a family, filled in by the family's folder and listed in
``implicit_attn.registry``."""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One architecture.

    Attributes:
      model_type: the HF ``config.json`` ``model_type`` it loads.
      label: the name used in messages and tables.
      config: the family's ``Config`` (``from_hf``/``to_hf``).
      lm: the family's ``LM`` class (``LM(config, params)``).
      variants: every operator variant; ``exact_variants``: those whose operator
        reproduces the block output (``"full"`` always).
      to_params: ``(config dict, tensors) -> (Config, params)`` (strict checks).
      from_params: ``(Config, params) -> (config dict, tensors)``.
      expected_shapes: ``Config -> (required, optional)`` HF tensor names -> shapes.
      init_params: ``(Config, key, dtype) -> params`` drawn from the same table.
      naive_operator: float64 reference ``(mixer params, x (B, L, D) numpy, Config, layer)
        -> (B, C, L, L)`` numpy of the ``"full"`` operator of layer ``layer``'s mixer (for
        tests), or None where a layer has no recurrent mixer.
      hf_class, hf_config_class: the transformers class names of the reference model.
      tiny: keyword arguments of ``hf_config_class`` for a tiny test model.
      hf_setup: ``(torch model, torch module, seed) -> None`` that moves parameters away
        from trivial initial values before a test saves the model (torch is passed in; the
        library never imports it).
      hf_mixer: the dotted path of layer ``{i}``'s token mixer in the HF model (e.g.
        ``"backbone.layers.{i}.mixer"``; alternatives separated by ``|`` where the mixer's
        name depends on the layer kind), for per-mixer parity tests.
      bench: ``{"full": HF kwargs, "quick": HF kwargs}`` of the forward benchmark.
      hf_mixer_layers: ``HF config object -> [HF layer index of each of our layers' mixer,
        or the dotted path of its module]`` where our layers are not HF's one to one
        (Nemotron-H: a token-mixing layer with the MLP layers after it; Zamba2: two token
        mixers in one HF layer); None: layer ``i`` is HF layer ``i``.
      hf_mixer_output: ``(HF config object, [outputs of the "+"-joined hf_mixer modules]) ->
        mixer output``, for a mixer HF computes in several modules (Falcon-H1's Mamba and
        attention paths); None otherwise.
      has_heads: operators of this family have heads (``heads=``, ``head_matrices``).
      hf_mixer_input: ``(torch, module, args, kwargs) -> our mixer's input`` from the HF mixer
        module and the arguments of its call, for a mixer that reads more than its first argument (RWKV-7's value
        residual); None: the first argument (or ``hidden_states``).
      containers: ``checkpoint.Container``s of the checkpoint types that hold this family's
        model as their language model (Qwen3.5's vision-language type); ``io.load`` reads
        their language model as this family's.
      tensor_prefixes: ``(source, target)`` name prefixes renamed before the names are checked:
        transformers' ``PrefixChange`` conversions for the class (Qwen3.5's text model read
        from names under ``model.language_model.``).
      unread_tensors: ``config dict -> regex patterns`` of the checkpoint tensors the model
        does not read (``re.search`` on the name): transformers' ``_keys_to_ignore_on_load_unexpected``
        of the HF class, e.g. multi-token-prediction layers; None: every tensor is read.
      state_dict_names: a ``checkpoint.StateDictNames``: the names transformers' class gives the
        tensors in ``state_dict()`` where they differ from the saved names (fused experts,
        renamed modules), read as the saved ones; None: the same names.
    """

    model_type: str
    label: str
    config: type
    lm: type
    variants: tuple
    exact_variants: tuple
    to_params: Callable
    from_params: Callable
    expected_shapes: Callable
    init_params: Callable
    naive_operator: Callable | None
    hf_class: str
    hf_config_class: str
    tiny: dict
    hf_mixer: str
    bench: dict
    hf_setup: Callable
    has_heads: bool = False
    hf_mixer_layers: Callable | None = None
    hf_mixer_output: Callable | None = None
    hf_mixer_input: Callable | None = None
    containers: tuple = ()
    unread_tensors: Callable | None = None
    tensor_prefixes: tuple = ()
    state_dict_names: object = None


def perturb_parameters(model, torch, scale: float = 0.05, seed: int = 0):
    """Add seeded noise to every parameter of a torch ``model`` so that nothing stays at a
    trivial initial value (zeros, ones); for ``hf_setup`` hooks (``torch`` passed in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def move_off_initial_values(torch, norms, mamba_mixers, seed: int = 0, norm_scale: float = 0.2):
    """For the ``hf_setup`` hooks of the Mamba families: add seeded noise (``norm_scale``) to
    every module in ``norms``' weight, and move every Mamba mixer's ``D`` by +0.5 and its conv
    bias (if any) by +0.3, so that a misplaced norm weight, skip or bias shows in tests
    (``torch`` passed in)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mixer in mamba_mixers:
            mixer.D.add_(0.5)
            if mixer.conv1d.bias is not None:
                mixer.conv1d.bias.add_(0.3)
        for norm in norms:
            norm.weight.add_(norm_scale * torch.randn(norm.weight.shape, generator=g))


__all__ = ["FamilySpec", "perturb_parameters", "move_off_initial_values"]
