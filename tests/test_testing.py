"""``implicit_attn.testing``: the strategies draw configs that HF and we both accept, the
parity helper passes on random configs of every family (a hypothesis property test) and
fails when parity is broken.

Compilation dominates: each drawn config is a new set of XLA programs, so the property
test draws few examples by default; ``IA_PARITY_EXAMPLES=n`` draws ``n`` per family.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

testing = pytest.importorskip("implicit_attn.testing")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from implicit_attn.registry import FAMILIES, family  # noqa: E402
from implicit_attn.testing import deps, strategies  # noqa: E402
from test_layers import graph  # noqa: E402
from weights_convert import read_hf_dir  # noqa: E402

FAMILY_IDS = sorted(FAMILIES)
EXAMPLES = int(os.environ.get("IA_PARITY_EXAMPLES", "1"))


# ----------------------------------------------------------------------------- strategies

def test_every_registered_family_has_a_config_strategy():
    assert set(strategies.CONFIGS) == set(FAMILIES)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies.model_inputs(batch=st.integers(1, 3)))
def test_drawn_configs_are_valid_for_hf_and_for_us(case):
    model_type, config, ids = case
    spec = family(model_type)
    testing.reference_class(spec.hf_config_class)(**testing.hf_config_kwargs(model_type, config))
    cfg = spec.config.from_hf(config)
    assert cfg.vocab_size == config["vocab_size"]
    assert ids.dtype == np.int64 and ids.ndim == 2 and 1 <= ids.shape[0] <= 3 and 1 <= ids.shape[1] <= 12
    assert ids.min() >= 0 and ids.max() < config["vocab_size"]


def test_configs_of_an_unknown_family_name_the_supported_ones():
    with pytest.raises(ValueError, match="supported"):
        strategies.configs("no_such_model")


# ----------------------------------------------------------------------------- the property

@pytest.mark.parametrize("model_type", FAMILY_IDS)
def test_property_every_family_matches_torch(model_type):
    """For random valid configs and ids: logits, every mixer and exact operators agree with
    the HF torch model (``variants=("full",)`` here: the other exact variants are checked
    by the conformance suite on the tiny configs)."""

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategies.model_inputs(model_type, batch=2, length=st.integers(1, 12)), st.integers(0, 3))
    def prop(case, seed):
        t, config, ids = case
        report = testing.assert_hf_parity(t, config, ids, seed=seed, variants=("full",))
        spec = family(t)
        hf_config = testing.reference_class(spec.hf_config_class)(**testing.hf_config_kwargs(t, config))
        # one of our layers per token mixer (every HF layer but Nemotron-H's MLP / MoE ones; two per Zamba2 hybrid)
        n = hf_config.num_hidden_layers if spec.hf_mixer_layers is None else len(spec.hf_mixer_layers(hf_config))
        assert len(report["mixers"]) == n == len(report["exactness"]["full"])

    prop()


# ----------------------------------------------------------------------------- it can fail

@pytest.fixture(scope="module")
def mamba():
    """``(torch model, JAX model, ids)`` of the tiny Mamba."""
    tm = testing.build_hf_model("mamba")
    return tm, testing.load_jax_from_hf(tm), testing.random_ids(tm.config.vocab_size)


def perturbed(model, name: str, eps: float = 1e-2):
    """``model`` with HF tensor ``name`` shifted by ``eps`` (through the family's mapping)."""
    spec = family(model.family)
    config, tensors = spec.from_params(model.config, model.params())
    tensors = {**tensors, name: np.asarray(tensors[name]) + eps}
    cfg, params = spec.to_params(config, tensors)
    return spec.lm(cfg, params)


def test_parity_holds_and_the_report_has_every_layer(mamba):
    tm, model, ids = mamba
    r = testing.assert_hf_parity(tm, input_ids=ids, jax_model=model)
    assert r["model_type"] == "mamba" and r["logits"] <= 1e-4
    assert len(r["mixers"]) == len(r["mixer_inputs"]) == len(r["exactness"]["full"]) == 2


def test_a_perturbed_parameter_fails_the_logits(mamba):
    tm, model, ids = mamba
    bad = perturbed(model, "backbone.layers.1.mixer.out_proj.weight")
    with pytest.raises(AssertionError, match="logits differ from torch"):
        testing.assert_hf_parity(tm, input_ids=ids, jax_model=bad)


def test_a_perturbed_mixer_fails_at_its_layer(mamba):
    tm, model, ids = mamba
    bad = perturbed(model, "backbone.layers.1.mixer.out_proj.weight")
    with pytest.raises(AssertionError, match="layer 1 mixer output differs"):
        testing.assert_hf_parity(tm, input_ids=ids, jax_model=bad, atol=np.inf)
    bad = perturbed(model, "backbone.embeddings.weight")
    with pytest.raises(AssertionError, match="layer 0 mixer input differs"):
        testing.assert_hf_parity(tm, input_ids=ids, jax_model=bad, atol=np.inf)


def test_an_inexact_operator_fails_exactness(mamba):
    tm, model, ids = mamba
    with pytest.raises(AssertionError, match="layer 0 operator \\(variant 's6_only'\\) is not exact"):
        testing.assert_hf_parity(tm, input_ids=ids, jax_model=model, variants=("s6_only",))


def test_a_torch_model_with_a_config_is_refused(mamba):
    tm, _, _ = mamba
    with pytest.raises(ValueError, match="config is only used with a model_type"):
        testing.assert_hf_parity(tm, {"vocab_size": 8})


# ----------------------------------------------------------------------------- plumbing

def test_rwkv_is_saved_in_its_training_form_after_a_forward(tmp_path):
    """HF RWKV divides weights in place on its first eval forward; the saved checkpoint
    must not change (the helper loads torch models that have already run)."""
    tm = testing.build_hf_model("rwkv", path=tmp_path / "before")
    testing.torch_forward(tm, testing.random_ids(tm.config.vocab_size))
    testing.save_hf_model(tm, tmp_path / "after")
    (_, a), (_, b) = read_hf_dir(tmp_path / "before"), read_hf_dir(tmp_path / "after")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_missing_extras_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(ImportError, match=r"pip install implicit-attn\[test\]"):
        deps.require("hypothesis")


def test_nothing_in_the_library_imports_testing():
    users = sorted(m for m, d in graph().items() if "implicit_attn.testing" in d
                   and not m.startswith("implicit_attn.testing"))
    assert not users, users
