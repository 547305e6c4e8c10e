"""Builder of tiny random HF ``RwkvForCausalLM`` models (torch), saved with ``save_pretrained``."""
from __future__ import annotations

from pathlib import Path

from conftest import torch_or_skip
from implicit_attn.families import rwkv


def rwkv_hf(path: Path, **overrides):
    """A tiny random ``RwkvForCausalLM`` saved to ``path``; returns the torch model in eval mode.

    The model is saved *before* any forward pass, i.e. in HF's training-form weights; the
    first eval forward then rescales ``attention.output`` / ``feed_forward.value`` in place
    (``rescale_every``), which is the behaviour the JAX model must reproduce. Parameters are
    perturbed, decays and bonus spread (``rwkv.SPEC.hf_setup``).
    """
    torch, tr = torch_or_skip()
    kw = dict(vocab_size=64, hidden_size=16, num_hidden_layers=5, attention_hidden_size=12,
              intermediate_size=24, rescale_every=2, context_length=64, tie_word_embeddings=False)
    kw.update(overrides)
    model = tr.RwkvForCausalLM(tr.RwkvConfig(**kw)).eval()
    rwkv.SPEC.hf_setup(model, torch)
    model.save_pretrained(path, safe_serialization=True)
    return model
