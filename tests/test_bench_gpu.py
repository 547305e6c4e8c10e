"""The GPU benchmark's choice of layer (``benchmarks.gpu``), which runs on a CPU too."""
from __future__ import annotations

from benchmarks.gpu import operator_rows
from implicit_attn.kernels import pallas
from implicit_attn.operator import AttentionCore, ShortConvCore


def test_a_family_without_a_pallas_kernel_gets_a_row_naming_its_cores(monkeypatch):
    """LFM2's layers are short convolutions and attention. With both kernels taken away, as before
    2026-12-04, no layer has one: one row saying so, where the benchmark once raised and ended the
    run at the first such family."""
    for core_type in (AttentionCore, ShortConvCore):
        monkeypatch.setitem(pallas.BACKEND.cores, core_type, lambda core: "simulated: no kernel")
    rows = operator_rows("lfm2", 8, 2, quick=True)
    assert rows == [{"family": "lfm2", "case": "no layer with a Pallas kernel (AttentionCore, ShortConvCore)",
                     "note": "XLA on a GPU; nothing to compare"}]
