"""Builder of tiny random HF ``RecurrentGemmaForCausalLM`` models (torch), saved with
``save_pretrained``."""
from __future__ import annotations

from pathlib import Path

from conftest import torch_or_skip
from implicit_attn.families import griffin

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, lru_width=24, attention_window_size=5,
            conv1d_width=4, logits_soft_cap=30.0, rms_norm_eps=1e-6,
            block_types=["recurrent", "recurrent", "attention"], attention_bias=False,
            partial_rotary_factor=0.5, rope_theta=10000.0)


def griffin_hf(path: Path, **overrides):
    """A tiny random ``RecurrentGemmaForCausalLM`` saved to ``path``; returns the torch model
    (eval, eager attention). Every parameter is perturbed away from its init (zero biases,
    zero norm weights) so that each one counts in the comparison (``griffin.SPEC.hf_setup``)."""
    torch, tr = torch_or_skip()
    kw = dict(TINY)
    kw.update(overrides)
    rope = dict(rope_type="default", rope_theta=kw.pop("rope_theta"),
                partial_rotary_factor=kw.pop("partial_rotary_factor"))
    cfg = tr.RecurrentGemmaConfig(rope_parameters=rope, attn_implementation="eager", **kw)
    model = tr.RecurrentGemmaForCausalLM(cfg).eval()
    griffin.SPEC.hf_setup(model, torch)
    model.save_pretrained(path, safe_serialization=True)
    return model
