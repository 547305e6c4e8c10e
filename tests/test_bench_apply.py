"""The ``apply`` benchmark's baseline (``benchmarks.apply.blockwise_apply``: ``materialize`` one block
at a time) computes what ``apply`` does, in several blocks, for channels and for attention heads."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.apply import blockwise_apply, head_reduce
from benchmarks.cores import layer_operator
from implicit_attn.operator import dispatch


@pytest.mark.parametrize("model_type, layer, per_block", [("mamba2", 0, 40), ("recurrent_gemma", 2, 3)])
def test_blockwise_apply_equals_apply(monkeypatch, model_type, layer, per_block):
    op = layer_operator(model_type, layer, 24, quick=True)
    B, C, L, _ = op.shape
    monkeypatch.setattr(dispatch, "APPLY_BUDGET", per_block * B * L * L)  # several blocks, a ragged last
    assert C % per_block and C > per_block
    got, want = np.asarray(blockwise_apply(op)), np.asarray(op.apply())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(want - np.asarray(op.output))) <= 1e-5 * np.max(np.abs(np.asarray(op.output)))


def test_head_reduce_baseline_computes_what_reduce_does():
    """The one-head XLA reduce and its baseline (every head's matrix computed first) agree."""
    op = layer_operator("qwen3_next", 0, 24, quick=True)
    got, want = np.asarray(head_reduce(op, True)()), np.asarray(head_reduce(op, False)())
    assert want.shape == (op.shape[0], 24, 24) and np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
