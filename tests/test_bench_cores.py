"""The core benchmark's FLOP counts (``benchmarks.cores``) against counts written out by hand."""
from __future__ import annotations

from benchmarks.cores import layer_operator, reduce_flops


def test_parallel_core_reduce_flops_count_each_parts_conv_taps():
    """Falcon-H1's quick shape: the Mamba-2 part's 192 channels with their 4 conv taps, the attention
    part's 4 heads x 32 value features (no conv), ``(2 K + 2)`` FLOPs per channel and causal entry."""
    L = 8
    core = layer_operator("falcon_h1", 0, L, quick=True).core
    tri = L * (L + 1) / 2
    assert [p.num_channels for p in core.parts] == [192, 4] and core.repeats == (1, 32)
    assert reduce_flops(core, L) == (2 * 4 + 2) * 192 * tri + (2 * 1 + 2) * 4 * 32 * tri
