"""The gradients benchmark's runner (``benchmarks/gradients.py``): both modes in fresh processes on a
quick model, the CPU kernels taken at any size (the suite's ``$IMPLICIT_ATTN_CPU_AUTO_MIN``), the
same relevance from both."""
from __future__ import annotations

import pytest


@pytest.mark.deep
def test_both_modes_run_and_agree(monkeypatch):
    from benchmarks.gradients import COLUMNS, family_row

    monkeypatch.setenv("IMPLICIT_ATTN_CPU_AUTO_MIN", "0")
    row = family_row("rwkv6", quick=True, L=16, repeat=1)
    assert list(row) == COLUMNS
    assert row["max_rel_diff"] <= 1e-5
    assert all(row[c] > 0 for c in COLUMNS if c.endswith("_s")) and row["note"] == ""
