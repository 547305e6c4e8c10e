"""The experts benchmark's cases (``benchmarks.experts``): its routing, and both sides' outputs
on a small layer against a float64 formula of the experts."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.experts import case_hf, case_ours, layer, routing


def experts64(a: dict) -> np.ndarray:
    """``sum_j weights[t, j] w_out[e] (silu(g) u)``, ``(g, u)`` the halves of ``w_in[e] x[t]``,
    ``e = experts[t, j]``, in float64."""
    x, w_in, w_out = (np.asarray(a[n], np.float64) for n in ("x", "w_in", "w_out"))
    F = w_out.shape[2]
    y = np.zeros_like(x)
    for t, j in np.ndindex(*a["experts"].shape):
        e = a["experts"][t, j]
        g, u = np.split(w_in[e] @ x[t], [F])
        y[t] += a["weights"][t, j] * (w_out[e] @ (g / (1 + np.exp(-g)) * u))
    return y


def test_routing_picks_distinct_experts_with_weights_summing_to_one():
    experts, weights = routing(E=8, k=3, T=50)
    assert experts.shape == weights.shape == (50, 3) and experts.dtype == np.int32
    assert all(len(set(row)) == 3 for row in experts) and experts.min() >= 0 and experts.max() < 8
    np.testing.assert_allclose(weights.sum(1), 1, rtol=1e-6)
    with pytest.raises(ValueError, match=r"k \(9\) must be in \[1, E \(8\)\]"):
        routing(E=8, k=9, T=4)


def test_both_sides_compute_the_float64_experts(tmp_path):
    """Ours (the kernel path) and HF's ``Qwen3MoeExperts`` on the case's inputs: the saved outputs
    equal the float64 formula, and every side reports its times."""
    shape = dict(D=40, F=24, E=6, k=2, T=37)
    want = experts64(layer(**shape))
    ours = case_ours(**shape, out=str(tmp_path / "ours.npy"), warm_s=0.0)
    hf = case_hf(**shape, out=str(tmp_path / "hf.npy"), warm_s=0.0)
    assert ours["ours_s"] > 0 and ours["loop_s"] > 0 and hf["hf_s"] > 0
    for side in ("ours", "hf"):
        got = np.load(tmp_path / f"{side}.npy")
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), err_msg=side)
