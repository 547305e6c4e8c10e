"""The benchmarks' shared timing helpers (``benchmarks.common``), on a clock the test moves."""
from __future__ import annotations

import pytest

import benchmarks.common as common


def test_paired_seconds_alternates_and_takes_medians(monkeypatch):
    """Each call advances a fake clock by its own duration: the calls alternate (fn first), one
    warm-up call of each is not timed, and the medians and the median per-pair ratio are those of
    the durations given."""
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    calls = []
    fn_times = iter([9.0, 1.0, 3.0, 2.0])  # warm-up, then three timed calls
    base_times = iter([9.0, 2.0, 1.5, 6.0])

    def make(name, times):
        def f():
            calls.append(name)
            now[0] += next(times)
        return f

    r = common.paired_seconds(make("fn", fn_times), make("base", base_times), pairs=3, wait=lambda x: x)
    assert calls == ["fn", "base"] * 4
    assert r["fn_all"] == [1.0, 3.0, 2.0] and r["baseline_all"] == [2.0, 1.5, 6.0]
    assert r["fn_s"] == 2.0 and r["baseline_s"] == 2.0
    assert r["ratio"] == 2.0  # per pair 2.0, 0.5, 3.0
    with pytest.raises(ValueError, match="pairs must be at least 1"):
        common.paired_seconds(lambda: None, lambda: None, pairs=0)
