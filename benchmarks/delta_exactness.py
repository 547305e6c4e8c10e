"""The README's exactness table of the delta-rule models, measured.

For each delta-rule model type: a tiny random HF torch model (``FamilySpec.tiny``, perturbed by
``FamilySpec.hf_setup``), two sequences of 32 tokens, loaded with ``ia.load`` from its
``save_pretrained`` folder. Columns: the logits and every mixer's output against torch
(``implicit_attn.testing.assert_hf_parity``), the largest ``relative_error()`` of the exact
variant ``full``, ``materialize()`` against the family's float64 recurrence
(``FamilySpec.naive_operator``) on every delta layer's mixer input, and the range over the delta
layers of ``relative_error()`` of the ``no_delta`` operator (the erasure left out: the
approximation other tools report). Needs the test extras (torch, transformers).

    python -m benchmarks.delta_exactness
"""
from __future__ import annotations

import tempfile

from benchmarks.common import write_results

TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini", "kimi_linear", "bailing_hybrid")
B, L = 2, 32


def row(model_type: str) -> dict:
    import numpy as np

    import implicit_attn as ia
    from implicit_attn import testing
    from implicit_attn.operator import DeltaRuleCore
    from implicit_attn.registry import family

    spec = family(model_type)
    with tempfile.TemporaryDirectory() as path:
        tm = testing.build_hf_model(model_type, path=path)
        model = ia.load(path)
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (B, L))
        r = testing.assert_hf_parity(tm, input_ids=ids, jax_model=model)
    xs = model.mixer_inputs(ids)
    to_f64, no_delta = [], []
    for i, layer in enumerate(model.layers):
        op = layer.mixer.as_operator(xs[i])
        if not isinstance(op.core, DeltaRuleCore):
            continue
        H = np.asarray(op.materialize(), np.float64)
        ref = spec.naive_operator(layer.mixer.arrays(), np.asarray(xs[i]), model.config, i)
        to_f64.append(float(np.abs(H - ref).max() / np.abs(ref).max()))
        no_delta.append(layer.mixer.as_operator(xs[i], variant="no_delta").relative_error())
    return {"model_type": model_type, "logits_max_abs": r["logits"], "mixers_max_rel": max(r["mixers"]),
            "full_exactness_max_rel": max(r["exactness"]["full"]), "vs_float64_max_rel": max(to_f64),
            "no_delta_rel_min": min(no_delta), "no_delta_rel_max": max(no_delta), "delta_layers": len(to_f64)}


def main() -> list[dict]:
    rows = [row(t) for t in TYPES]
    write_results("delta_exactness", rows, meta={"batch": B, "length": L})
    return rows


if __name__ == "__main__":
    main()
