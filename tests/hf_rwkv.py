"""Builder of tiny random HF ``RwkvForCausalLM`` models (torch), saved with ``save_pretrained``."""
from __future__ import annotations

from pathlib import Path

from conftest import perturb_, torch_or_skip


def rwkv_hf(path: Path, **overrides):
    """A tiny random ``RwkvForCausalLM`` saved to ``path``; returns the torch model in eval mode.

    The model is saved *before* any forward pass, i.e. in HF's training-form weights; the
    first eval forward then rescales ``attention.output`` / ``feed_forward.value`` in place
    (``rescale_every``), which is the behaviour the JAX model must reproduce.
    """
    torch, tr = torch_or_skip()
    kw = dict(vocab_size=64, hidden_size=16, num_hidden_layers=5, attention_hidden_size=12,
              intermediate_size=24, rescale_every=2, context_length=64, tie_word_embeddings=False)
    kw.update(overrides)
    model = tr.RwkvForCausalLM(tr.RwkvConfig(**kw)).eval()
    perturb_(model, torch, scale=0.1)
    with torch.no_grad():
        # Spread the decays and the bonus so that both fast and slow channels occur.
        for b in model.rwkv.blocks:
            a = b.attention
            a.time_decay.copy_(torch.linspace(-3.0, 1.5, a.time_decay.numel()))
            a.time_first.add_(torch.randn(a.time_first.shape) * 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model
