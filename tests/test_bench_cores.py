"""The core benchmark's FLOP counts (``benchmarks.cores``) against counts written out by hand."""
from __future__ import annotations

import numpy as np

import dataclasses

from benchmarks.cores import LOW_RANK, block_entries, layer_operator, necessary_flops, reduce_flops, window_entries


def test_parallel_core_reduce_flops_count_each_parts_conv_taps():
    """Falcon-H1's quick shape: the Mamba-2 part's 192 channels with their 4 conv taps, the attention
    part's 4 heads x 32 value features (no conv), ``(2 K + 2)`` FLOPs per channel and causal entry."""
    L = 8
    core = layer_operator("falcon_h1", 0, L, quick=True).core
    tri = L * (L + 1) / 2
    assert [p.num_channels for p in core.parts] == [192, 4] and core.repeats == (1, 32)
    assert reduce_flops(core, L) == (2 * 4 + 2) * 192 * tri + (2 * 1 + 2) * 4 * 32 * tri


def test_attention_flops_count_the_entries_its_window_reaches():
    """Local attention (RecurrentGemma's quick shape, window 64): ``2 d`` FLOPs per head for every
    entry the probabilities can be nonzero at, counted from the core's own dense mask, below and
    above the window length (the full square was counted before: twice the causal entries), and
    the reduce's ``2 K + 2`` per head and reachable entry."""
    for L in (48, 150):
        core = layer_operator("recurrent_gemma", 2, L, quick=True).core
        H, d = core.q.shape[1], core.q.shape[-1]
        assert core.window == 64
        visible = int(np.count_nonzero(np.asarray(core.dense(np.arange(H)))[0] > 0))
        assert visible == H * window_entries(L, 64)  # every reachable entry of a softmax is > 0
        assert necessary_flops(core, L) == 2 * d * visible
        assert reduce_flops(core, L) == (2 * 1 + 2) * visible  # no conv: K = 1, one weight per head
    assert window_entries(48, 64) == 48 * 49 // 2 and window_entries(150, 64) == 64 * 65 // 2 + 86 * 64


def test_las_flops_count_the_causal_entries_of_each_block():
    """LaS attention (the benchmark's quick LaS layer: 4 heads of 16, pooling P = 3): ``2 d`` FLOPs per
    head for every entry its matrix can be nonzero at (pooled softmax probabilities are > 0 on the
    causal entries of the query's block), counted from the core's own dense matrices, without
    LaS-chunk blocks and with blocks of 16 that do not divide L."""
    L = 40
    core = layer_operator("las_transformer", 0, L, quick=True).core
    H, d = core.q.shape[1], core.q.shape[-1]
    assert (H, d, core.pool) == (4, 16, 3)
    for chunk in (None, 16):
        c = dataclasses.replace(core, chunk=chunk)
        visible = int(np.count_nonzero(np.asarray(c.dense(np.arange(H)))[0] > 0))
        assert visible == H * block_entries(L, chunk)
        assert necessary_flops(c, L) == 2 * d * visible
        assert reduce_flops(c, L) == (2 * 1 + 2) * visible
    assert block_entries(40, None) == 40 * 41 // 2 and block_entries(40, 16) == 2 * 16 * 17 // 2 + 8 * 9 // 2


def test_low_rank_scalar_decay_case_counts_each_groups_product_once():
    """The synthetic ``ScalarDecayCore`` with ``q k^T`` groups (quick shape: 4 groups of 16 channels,
    state 16, conv 4): ``2 N`` FLOPs per group and causal entry (a group's matrix once for its
    channels), the reduce's ``2 K + 2`` per channel and causal entry; the core's own dense matrices
    are nonzero on every causal entry and zero above."""
    L = 24
    core = layer_operator(LOW_RANK, 0, L, quick=True).core
    assert (core.log_a.shape[1], core.num_channels, core.q.shape[-1], core.conv_w.shape[-1]) == (4, 64, 16, 4)
    nonzero = np.asarray(core.dense(np.arange(64)))[0] != 0
    assert nonzero.sum() == 64 * L * (L + 1) // 2 and not np.triu(nonzero, 1).any()
    assert necessary_flops(core, L) == 2 * 16 * 4 * L * (L + 1) / 2
    assert reduce_flops(core, L) == (2 * 4 + 2) * 64 * L * (L + 1) / 2
