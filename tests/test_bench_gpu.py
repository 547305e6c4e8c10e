"""The GPU benchmark's choice of layer (``benchmarks.gpu``), which runs on a CPU too."""
from __future__ import annotations

from benchmarks.gpu import operator_rows


def test_a_family_without_a_pallas_kernel_gets_a_row_naming_its_cores():
    """LFM2's layers (short convolution, attention) have no Pallas kernel: one row saying so, where
    the benchmark once raised and ended the run at the first such family."""
    rows = operator_rows("lfm2", 8, 2, quick=True)
    assert rows == [{"family": "lfm2", "case": "no layer with a Pallas kernel (AttentionCore, ShortConvCore)",
                     "note": "XLA on a GPU; nothing to compare"}]
