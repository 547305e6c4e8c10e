"""Property tests against the Hugging Face torch models, for users of ``implicit_attn``.

``strategies``: hypothesis strategies of valid small configs of every registered family
(``configs``, ``model_types``) and of token ids (``input_ids``, ``model_inputs``).
``hf``: ``build_hf_model`` (the HF torch model of a config), ``load_jax_from_hf`` and
``assert_hf_parity`` (logits, every mixer's output and exact operators, against torch).

    from hypothesis import given, settings
    from implicit_attn.testing import assert_hf_parity, model_inputs

    @settings(max_examples=5, deadline=None)
    @given(model_inputs("mamba"))
    def test_mamba_matches_torch(case):
        model_type, config, ids = case
        assert_hf_parity(model_type, config, ids)

Needs the ``test`` extra (torch, transformers, hypothesis): ``pip install implicit-attn[test]``.
Nothing else in ``implicit_attn`` imports this package.
"""
from .hf import (assert_hf_parity, assert_loads_as_language_model, build_hf_model, hf_config_kwargs, hf_module,
                 load_jax_from_hf, max_rel_error, random_ids, reference_class, save_hf_model, torch_forward)
from .strategies import configs, input_ids, model_inputs, model_types

__all__ = ["assert_hf_parity", "assert_loads_as_language_model", "build_hf_model", "hf_config_kwargs", "hf_module",
           "load_jax_from_hf", "max_rel_error", "random_ids", "reference_class", "save_hf_model", "torch_forward",
           "configs", "input_ids", "model_inputs", "model_types"]
