"""Benchmark plumbing: timing, peak memory of one case in a fresh process, JSON + table.

Peak memory is measured per case in a child process (``VmHWM`` of /proc minus the
resident size just before the measured call), so cases do not pollute each other.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def block(x):
    """Wait for every array in a pytree."""
    import jax

    return jax.block_until_ready(x)


def timeit(fn, repeat: int = 3, warmup: int = 1, best: bool = False, warm_s: float = 0.0, wait=block) -> float:
    """Median (``best``: fastest) wall seconds of ``fn()`` (``wait(result)`` blocks on its
    result) after ``warmup`` calls, and more until they have taken ``warm_s`` seconds."""
    t0 = time.perf_counter()
    n = 0
    while n < warmup or time.perf_counter() - t0 < warm_s:
        wait(fn())
        n += 1
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        wait(fn())
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[0] if best else ts[len(ts) // 2]


def paired_seconds(fn, baseline, pairs: int = 9, wait=block) -> dict:
    """``fn()`` and ``baseline()`` called in turn, ``pairs`` times each after one warm-up call of
    each, in this process: a drift in the machine's speed (minutes apart, as separate processes
    see it) touches both alike. Returns the medians ``fn_s`` and ``baseline_s``, the median of
    the per-pair ratios ``ratio`` (baseline / fn) and the raw lists ``fn_all``, ``baseline_all``."""
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    wait(fn())
    wait(baseline())
    ts, bs = [], []
    for _ in range(pairs):
        for f, out in ((fn, ts), (baseline, bs)):
            t = time.perf_counter()
            wait(f())
            out.append(time.perf_counter() - t)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return {"fn_s": med(ts), "baseline_s": med(bs), "ratio": med([b / t for t, b in zip(ts, bs)]),
            "fn_all": ts, "baseline_all": bs}


def fill_seconds(shape, time_fn) -> dict:
    """How long producing a fresh float32 array of ``shape`` takes, timed by ``time_fn(fn)``
    (each compiled before): ``xla`` by a jitted ``jnp.full`` (the bound the suite has used since
    it began), ``kernel`` by the kernel library's ``fill`` (huge pages, every thread: as the dense
    kernels write their outputs; None where the library is not available)."""
    import jax
    import jax.numpy as jnp

    from implicit_attn.kernels import cpu

    xla = jax.jit(lambda s: jnp.full(shape, s, jnp.float32))
    block(xla(1.0))  # compiled here: cores.steady_seconds takes a first call of 50 ms or more as a long case
    out = {"xla": time_fn(lambda: xla(1.0)), "kernel": None}
    if jax.default_backend() == "cpu" and cpu.available():
        kernel = jax.jit(lambda: cpu.fill(shape, 1.0))
        block(kernel())
        out["kernel"] = time_fn(kernel)
    return out


def peak_mb_of(fn) -> float:
    """Peak extra resident memory (MiB) of one ``fn()`` call in *this* process.

    Only meaningful in a fresh process (see ``isolated``): the high-water mark is
    process-wide."""
    before = _status_kb("VmRSS")
    block(fn())
    return max(0, _status_kb("VmHWM") - before) / 1024


def isolated(target: str, timeout: float = 1800, **kwargs) -> dict:
    """Run ``module:function(**kwargs)`` in a fresh Python process; returns its dict.

    The function should build its inputs, then call ``peak_mb_of``/``timeit`` itself.
    """
    code = ("import json,sys,importlib;m,f=sys.argv[1].split(':');"
            "r=getattr(importlib.import_module(m),f)(**json.loads(sys.argv[2]));"
            "print('@@RESULT@@'+json.dumps(r))")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, target, json.dumps(kwargs)], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=root)
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])
    raise RuntimeError(f"benchmark case {target} {kwargs} failed:\n{p.stderr[-3000:]}")


def machine() -> dict:
    """What the numbers were measured on."""
    import jax

    cpu, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # The vector extensions the kernels (built with -march=native) and XLA can use.
    vector = [name for flag, name in (("avx2", "AVX2"), ("fma", "FMA"), ("avx512f", "AVX-512"))
              if flag in flags] or ["none of AVX2 / FMA / AVX-512"]
    return {"platform": platform.platform(), "cpu": cpu, "vector": " ".join(vector), "cores": os.cpu_count(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
            "device_kind": jax.devices()[0].device_kind,
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of dicts as a GitHub markdown table."""
    if not rows:
        return "(no rows)\n"
    cols = columns or list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def write_results(name: str, rows: list[dict], meta: dict | None = None, columns=None) -> Path:
    """Write ``results/<name>.json`` and ``results/<name>.md``; returns the JSON path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine(), **(meta or {})}
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": info, "rows": rows}, indent=2))
    md = f"# {name}\n\nMachine: {info['machine']['cpu']} ({info['machine']['vector']}, " \
         f"{info['machine']['cores']} cores), " \
         f"jax {info['machine']['jax']} on {info['machine']['backend']}" \
         f"{'' if info['machine']['backend'] == 'cpu' else ' (' + info['machine']['device_kind'] + ')'}, " \
         f"{info['machine']['date']} UTC\n\n"
    md += markdown_table(rows, columns)
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    return RESULTS / f"{name}.json"


def replace_rows(name: str, rows: list[dict], key=lambda r: r["family"]) -> list[dict]:
    """``rows`` in place of the rows of ``results/<name>.json`` with the same ``key`` (what ``--only``
    re-runs): the other rows kept in their order, each with the ``date`` of the run that wrote it,
    new keys after them; ``rows`` alone where there is no such file."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return rows
    new = {key(r): r for r in rows}
    old = json.loads(path.read_text())
    for r in old["rows"]:  # rows written before rows carried their own date
        r.setdefault("date", old["meta"]["machine"]["date"])
    return [new.pop(key(r), r) for r in old["rows"]] + list(new.values())


def family_parser(doc: str, default_families, quick_help: str) -> argparse.ArgumentParser:
    """The command line of a benchmark run per model family: ``--quick`` (``quick_help`` says what
    it changes) and ``--only`` (comma-separated model_types, default ``default_families``); add the
    benchmark's own options to it."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--only", default="", help="comma-separated model_types (default: " +
                    ", ".join(default_families) + ")")
    return ap


def only_families(only: str) -> list[str] | None:
    """``--only``'s model_types as a list, or ``None`` where it names none."""
    return [s for s in only.split(",") if s] or None


def rows_over_families(families, rows_of) -> list[dict]:
    """``rows_of(family)`` (a list of rows) for each family in turn, after checking every name
    against the registry (a ``ValueError`` naming the supported model_types before anything runs);
    a progress line per family and each new row printed (floats to 4 significant digits)."""
    from implicit_attn.registry import family as spec_of

    for f in families:
        spec_of(f)
    rows = []
    for i, f in enumerate(families):
        print(f"[{i + 1}/{len(families)}] {f}", flush=True)
        new = rows_of(f)
        for row in new:
            print({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        rows += new
    return rows


def import_case(target: str):
    m, f = target.split(":")
    return getattr(importlib.import_module(m), f)
