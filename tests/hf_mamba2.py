"""Builder of tiny random HF ``Mamba2ForCausalLM`` models (torch), saved with ``save_pretrained``."""
from __future__ import annotations

import math
from pathlib import Path

from conftest import perturb_, torch_or_skip


def mamba2_hf(path: Path, seed: int = 0, **overrides):
    """A tiny random ``Mamba2ForCausalLM`` saved to ``path``; returns the torch model (eval).

    Defaults: d_model 16, 4 heads of 8 (expand 2), N 4, 1 group, chunk 8, 2 layers.
    """
    torch, tr = torch_or_skip()
    torch.manual_seed(seed)
    kw = dict(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8, state_size=4, n_groups=1,
              num_hidden_layers=2, conv_kernel=4, expand=2, chunk_size=8, use_conv_bias=True,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    kw.update(overrides)
    model = tr.Mamba2ForCausalLM(tr.Mamba2Config(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.backbone.layers:
            m = layer.mixer
            H = m.num_heads
            # Explicit SSM parameters (varied per head), so nothing depends on init order.
            m.A_log.copy_(torch.log(1 + 15 * torch.rand(H, generator=g)))
            dt = torch.exp(torch.rand(H, generator=g) * (math.log(0.5) - math.log(1e-2)) + math.log(1e-2))
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            m.D.copy_(1.0 + 0.5 * torch.randn(H, generator=g))
    perturb_(model, torch, seed=seed)
    with torch.no_grad():  # the conv bias and the norm weights away from their defaults: they must count
        for layer in model.backbone.layers:
            m = layer.mixer
            if m.conv1d.bias is not None:
                m.conv1d.bias.add_(0.3 * torch.randn(m.conv1d.bias.shape, generator=g))
            m.norm.weight.add_(0.3 * torch.randn(m.norm.weight.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    return model
