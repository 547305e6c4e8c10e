"""Where a family's forward spends its time: XLA's own per-operation trace of the benchmark
model's compiled forward (``jax.profiler``), each operation's time summed by what it is.

The model is ``benchmarks.forward``'s (the family's ``bench`` shape, random weights written and
loaded as a checkpoint, L = 512); its forward is compiled once, warmed up, timed without the
profiler (``forward_s``, the median of ``calls``), then traced over ``calls`` more calls. Every
operation of the program's entry computation that the trace times is put into one kind:

- ``kernel <name>``: a custom call into our CPU kernel library (``implicit_attn_<name>``); for the
  grouped expert products the routed FLOPs (``2 T k R K``) and their rate;
- ``products (XLA)``: XLA's matrix products (a ``dot``, or a fusion that holds one), with their
  FLOPs counted from the operand shapes (``2 * output elements * contracted size``) and the rate
  they ran at (``gflops``);
- ``custom call <target>`` for XLA's own custom calls (``TopK``), ``<opcode>`` for the rest
  (``fusion``: elementwise work, ``sort``, ``copy``, ...).

Rows: per family and kind, milliseconds per forward (``ms``), operations per forward (``ops``),
the share of the traced total (``share``). XLA runs independent operations side by side on its
thread pool (a layer's query, key and value products), and the trace times each from its start
to its end, so their durations overlap: every stretch of time is split equally among the
operations running in it (``shared_time``), and the kinds add up to the time any operation ran
(``traced_s`` in each family's ``total`` row, beside ``forward_s``, the untraced call's median;
the profiler adds a little). ``overlap`` is the operations' own durations over ``traced_s`` (1:
one at a time); a kind's ``gflops`` is its FLOPs over its share of the time.

    python -m benchmarks.forward_profile [--quick] [--only qwen3_5_moe_text,qwen3_next] [--calls 10]
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import math
import re
import statistics
import tempfile
import time

from benchmarks.common import block, family_parser, only_families, rows_over_families, write_results

COLUMNS = ["family", "kind", "ms", "ops", "share", "gflop", "gflops", "forward_s", "traced_s", "overlap"]
# The families issue 23's forward target misses where HF's products leave room for 3x
# (``max_speedup`` above 3 in benchmarks.forward's run of 2026-12-04 on the Xeon).
DEFAULT_FAMILIES = ("qwen3_next", "qwen3_5_moe_text", "lara_mini", "qwen3_5_text", "olmo_hybrid")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([\w\-]+)\(")  # shape: maybe a tuple
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")


def _dims(shape: str) -> list[int]:
    """``f32[512,1024]{1,0}`` -> ``[512, 1024]`` (``[]`` for a scalar)."""
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def hlo_operations(hlo: str) -> tuple[dict, str]:
    """Parse compiled HLO text: ``({computation: {instruction: (shape, opcode, line)}}, entry name)``."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("{")[0]:
            current = head.group(2)
            comps[current] = {}
            if head.group(1):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            comps[current][m.group(1)] = (m.group(2), m.group(3), line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def dot_flops(comps: dict, comp: str, line: str) -> int:
    """FLOPs of the ``dot`` on ``line`` of computation ``comp``: 2 x output elements x the
    product of the left operand's contracted dimensions."""
    out = _dims(line.split("=", 1)[1].split()[0])
    lhs = re.search(r"dot\(%?([\w.\-]+)", line).group(1)
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
    lhs_dims = _dims(comps[comp][lhs][0])
    k = math.prod(lhs_dims[int(d)] for d in contracting.split(",") if d)
    return 2 * math.prod(out) * k


# The kernels whose products are counted: the grouped expert products, x (T, K) or h (P, K, 32)
# times each routed copy's expert W (E, R, K), the copies col (T, k): 2 T k R K (the routed work,
# as HF's count has it; the packs' empty columns not counted).
GROUPED = ("implicit_attn_grouped_from_tokens", "implicit_attn_grouped_to_tokens")


def grouped_flops(comps: dict, entry: str, line: str) -> int:
    """FLOPs of a grouped expert product's custom call on ``line`` (``GROUPED``)."""
    operands = [o.strip().lstrip("%") for o in re.search(r"custom-call\(([^)]*)\)", line).group(1).split(",")]
    T, k = _dims(comps[entry][operands[1]][0])
    _, R, K = _dims(comps[entry][operands[-1]][0])
    return 2 * T * k * R * K


def operation_kind(comps: dict, name: str, entry: str) -> tuple[str, int]:
    """``(kind, FLOPs)`` of entry instruction ``name`` (FLOPs for matrix products and the grouped
    expert kernels, else 0)."""
    shape, opcode, line = comps[entry][name]
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        if target.startswith("implicit_attn_"):
            flops = grouped_flops(comps, entry, line) if target in GROUPED else 0
            return "kernel " + target[len("implicit_attn_"):], flops
        return "custom call " + target, 0
    if opcode == "dot":
        return "products (XLA)", dot_flops(comps, entry, line)
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if opcode == "fusion" and called and called.group(1) in comps:
        body = comps[called.group(1)]
        dots = [ln for (_, op, ln) in body.values() if op == "dot"]
        if dots:
            return "products (XLA)", sum(dot_flops(comps, called.group(1), ln) for ln in dots)
    return opcode, 0


def shared_time(ops: list) -> collections.Counter:
    """Each name's time in ``ops`` (``(start, end, name)`` intervals), every stretch of time split
    equally among the operations running in it: XLA runs independent operations side by side on
    its thread pool, so their own durations overlap; these shares add up to the time any ran."""
    ops = [o for o in ops if o[1] > o[0]]  # an empty interval takes no time (and never ends below)
    bounds = sorted({t for a, b, _ in ops for t in (a, b)})
    starts = collections.defaultdict(list)
    for i, (a, _, _) in enumerate(ops):
        starts[a].append(i)
    ends = collections.defaultdict(list)
    for i, (_, b, _) in enumerate(ops):
        ends[b].append(i)
    out, running = collections.Counter(), set()
    for t0, t1 in zip(bounds, bounds[1:]):
        running.difference_update(ends[t0])
        running.update(starts[t0])
        for i in running:
            out[ops[i][2]] += (t1 - t0) / len(running)
    return out


def profile_compiled(compiled, args: tuple, calls: int = 10) -> dict:
    """Trace ``calls`` calls of ``compiled(*args)`` (a ``jax.stages.Compiled``) and sum its entry
    operations' times by kind (``shared_time``): ``{"kinds": {kind: {"ms", "ops", "gflop"}},
    "traced_s", "overlap", "forward_s"}``, per call; ``traced_s`` the time any operation ran,
    ``overlap`` the operations' own durations summed over it (1: one at a time), ``forward_s`` the
    median of ``calls`` untraced calls."""
    import jax

    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    comps, entry = hlo_operations(compiled.as_text())
    block(compiled(*args))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        block(compiled(*args))
        times.append(time.perf_counter() - t)
    # XLA's operations only: without the HLO of every program alive in the process (which made
    # the first trace in a long-lived process take seconds) and without Python's calls.
    options = jax.profiler.ProfileOptions()
    options.enable_hlo_proto, options.python_tracer_level = False, 0
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=options):
            for _ in range(calls):
                block(compiled(*args))
        (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        trace = json.load(gzip.open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events
           if e.get("ph") == "X" and e.get("name") in comps[entry]]
    us, seen = shared_time(ops), collections.Counter(name for _, _, name in ops)
    kinds = {}
    for name, total in us.items():
        kind, flops = operation_kind(comps, name, entry)
        k = kinds.setdefault(kind, {"ms": 0.0, "ops": 0.0, "gflop": 0.0})
        k["ms"] += total / 1e3 / calls
        k["ops"] += seen[name] / calls
        k["gflop"] += flops / 1e9 * seen[name] / calls
    if not kinds:
        raise RuntimeError("the trace timed none of the program's operations (a jax whose CPU "
                           "profiler does not trace XLA's operations?)")
    return {"kinds": kinds, "traced_s": sum(k["ms"] for k in kinds.values()) / 1e3,
            "overlap": sum(b - a for a, b, _ in ops) / sum(us.values()), "forward_s": statistics.median(times)}


def family_rows(family: str, quick: bool = False, calls: int = 10) -> list[dict]:
    """The profile of ``family``'s benchmark forward as rows (a ``total`` row last)."""
    import implicit_attn as ia
    from benchmarks.forward import random_ids, write_checkpoint

    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(family, d, quick)
        model = ia.load(d)
    ids, extra = model.inputs(random_ids(model.config.vocab_size, 128 if quick else 512))
    args = (model.params(), ids, *extra)
    compiled = type(model).forward_fn.lower(*args, cfg=model.config).compile()
    p = profile_compiled(compiled, args, calls)
    total_ms = p["traced_s"] * 1e3
    rows = [{"family": family, "kind": kind, "ms": k["ms"], "ops": round(k["ops"], 2),
             "share": k["ms"] / total_ms, "gflop": k["gflop"] or None,
             "gflops": k["gflop"] / (k["ms"] / 1e3) if k["gflop"] else None}
            for kind, k in sorted(p["kinds"].items(), key=lambda kv: -kv[1]["ms"])]
    rows.append({"family": family, "kind": "total", "ms": total_ms, "forward_s": p["forward_s"],
                 "traced_s": p["traced_s"], "overlap": p["overlap"],
                 "gflop": sum(r["gflop"] or 0 for r in rows) or None})
    return rows


def main(quick: bool = False, only=None, calls: int = 10) -> list[dict]:
    rows = rows_over_families(only or DEFAULT_FAMILIES, lambda f: family_rows(f, quick, calls))
    write_results("forward_profile_quick" if quick else "forward_profile", rows, columns=COLUMNS)
    return rows


if __name__ == "__main__":
    ap = family_parser(__doc__, DEFAULT_FAMILIES, "the families' quick benchmark shapes, L = 128")
    ap.add_argument("--calls", type=int, default=10, help="calls timed and traced (default 10)")
    a = ap.parse_args()
    main(a.quick, only_families(a.only), a.calls)
