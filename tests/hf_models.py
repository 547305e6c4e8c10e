"""Builders of tiny random HF models (torch), saved with ``save_pretrained``."""
from __future__ import annotations

from pathlib import Path

from conftest import perturb_, torch_or_skip


def mamba_hf(path: Path, **overrides):
    """A tiny random ``MambaForCausalLM`` saved to ``path``; returns the torch model (eval)."""
    torch, tr = torch_or_skip()
    kw = dict(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=4,
              expand=2, use_conv_bias=True, time_step_rank=4)
    kw.update(overrides)
    model = tr.MambaForCausalLM(tr.MambaConfig(**kw)).eval()
    perturb_(model, torch)
    with torch.no_grad():  # D and the conv bias away from their defaults: they must count
        for layer in model.backbone.layers:
            layer.mixer.D.add_(0.5)
            if layer.mixer.conv1d.bias is not None:
                layer.mixer.conv1d.bias.add_(0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model
