"""The forward benchmark's measuring parts: the matmul-floor FLOP count (against counts
written out by hand), the mamba2-jax peer's weight mapping (against HF's torch model), and
every family's quick benchmark shape in HF's torch class (against our logits)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import torch_or_skip
from hf_build import mamba2_hf
from implicit_attn.registry import model_types


def test_hf_flops_counts_products_grouped_mm_and_cpu_attention():
    """Against counts written out by hand. A module called with a view of a parameter made under
    ``no_grad`` (as transformers 5.25's hub-kernel layers are, e.g. Mamba's conv weight) failed in
    torch's module tracker ("Expected gradient function to be set") until ``hf_flops`` counted with
    the parameters' ``requires_grad`` off."""
    torch, _ = torch_or_skip()
    from benchmarks.forward import hf_flops

    T, K, N, G, H, D = 12, 32, 16, 3, 2, 8
    offs = torch.tensor([3, 7, T], dtype=torch.int32)  # the rows each group (expert) takes

    class Product(torch.nn.Module):
        def forward(self, x, w):
            return x @ w

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(K, N, bias=False)
            self.experts = torch.nn.Parameter(torch.randn(G, K, N))
            self.w = torch.nn.Parameter(torch.randn(K, N))
            self.product = Product()

        def forward(self, x):
            y = self.lin(x) + self.product(x, self.w.view(K, N))          # 2 x 2 T K N
            g = torch._grouped_mm(x, self.experts, offs=offs)             # 2 T K N (routed rows)
            q = y.reshape(1, T, H, D).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)  # 4 H T T D
            v = torch.mv(x, torch.ones(K))                                # no formula: reported
            return y + g + a.transpose(1, 2).reshape(T, N) + v[:, None]

    probe = Probe().eval()
    r = hf_flops(probe, torch.randn(T, K))
    want = {"mm": 4 * T * K * N, "_grouped_mm": 2 * T * K * N,
            "_scaled_dot_product_flash_attention_for_cpu": 4 * H * T * T * D}
    assert r["flops_by_op"] == want
    assert r["flops"] == sum(want.values())
    assert r["uncounted_ops"] == ["mv"]
    assert all(p.requires_grad for p in probe.parameters())  # left as it was


def test_mamba2_peer_logits_match_hf(tmp_path):
    torch, _ = torch_or_skip()
    pytest.importorskip("mamba2_jax")
    from benchmarks.mamba2_peer import peer_forward

    # L = 20 over chunks of 8: the peer's multi-chunk path, with a padded last chunk
    tm = mamba2_hf(tmp_path, seed=1)
    ids = np.random.default_rng(0).integers(0, 64, (2, 20))
    with torch.no_grad():
        want = tm(torch.tensor(ids)).logits.numpy()
    got = np.asarray(peer_forward(str(tmp_path))[0](ids))  # the jitted program the benchmark times
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_mamba2_peer_refuses_what_it_cannot_express(tmp_path):
    torch_or_skip()
    pytest.importorskip("mamba2_jax")
    from benchmarks.mamba2_peer import peer_config

    mamba2_hf(tmp_path, n_groups=2)
    with pytest.raises(ValueError, match="n_groups=1 only"):
        peer_config(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, n_groups=1, num_heads=3)))
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        peer_config(str(tmp_path))


@pytest.mark.parametrize("family", model_types())
def test_quick_shape_runs_in_hf_torch_with_our_logits(family, tmp_path):
    """Every family's quick benchmark shape (``python -m benchmarks.forward --quick``, as
    ``benchmarks.run --quick`` runs it) loads into HF's torch class from the checkpoint the
    benchmark writes, and HF's logits equal ours. (Zamba's once had one hybrid layer, whose
    shared block HF refuses to tie, and Kimi-Linear's no attention layer, which HF's cache needs.)"""
    torch, _ = torch_or_skip()
    import implicit_attn as ia
    from benchmarks.forward import random_ids, write_checkpoint
    from implicit_attn.registry import family as spec_of
    from implicit_attn.testing import reference_class

    path = str(tmp_path / "m")
    write_checkpoint(family, path, quick=True)
    tm = reference_class(spec_of(family).hf_class).from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = random_ids(tm.config.vocab_size, 16)
    with torch.no_grad():
        want = tm(torch.tensor(ids)).logits.numpy()
    got = np.asarray(ia.load(path)(ids))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
