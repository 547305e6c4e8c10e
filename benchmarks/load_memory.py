"""Peak memory of loading a checkpoint (issue 16): ``implicit_attn.load`` reads the
safetensors files through read-only memory maps, copies each tensor once into the model
and drops the mapped pages, so the peak resident-memory increase should stay near the
checkpoint's size (at most about 1.2x), never two full copies.

A random Mamba model of about 300 MB (float32) is generated and saved; every measured
case runs in a fresh child process, which records its peak resident size (``VmHWM``;
``ru_maxrss`` as a fallback) before and after the call after warming up JAX, so the
delta is what the call itself needed. The page cache is not dropped between cases (no
root needed), which only matters for time, not for resident memory.

    python benchmarks/load_memory.py          # writes benchmarks/results/load_memory.{json,md}
"""
from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
# ~300 MB of float32: a 32k x 1024 embedding (128 MB) and 8 layers of ~22 MB
CONFIG = dict(vocab_size=32768, hidden_size=1024, state_size=16, num_hidden_layers=8, conv_kernel=4)


def _status_kb(field: str) -> int:
    """``field`` (``VmHWM``: peak resident size, ``VmRSS``) of /proc/self/status in KiB;
    the peak from ``getrusage`` where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def child(case: str, path: str) -> dict:
    """Run one case in this (fresh) process; return peak and resident deltas in bytes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import implicit_attn as ia
    from weights_convert import read_hf_dir

    jax.block_until_ready(jnp.ones(8) + 1)  # JAX initialised before the baseline
    base_peak, base_rss = _status_kb("VmHWM"), _status_kb("VmRSS")
    t = time.perf_counter()
    if case == "ia.load":
        keep = ia.load(path)
        jax.block_until_ready(keep.params())
    elif case == "read_hf_dir (views, all touched)":
        _, keep = read_hf_dir(path)
        total = sum(float(np.asarray(v).reshape(-1)[:: 4096 // max(v.itemsize, 1) or 1].sum()) for v in keep.values())
        assert np.isfinite(total)
    elif case == "read_bytes + a copy per tensor (like the old reader)":
        from weights_convert import read_header
        keep = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            data = f.read_bytes()
            entries, _, start = read_header(f)
            for name, (dt, shape, a, b) in entries.items():
                keep[name] = np.frombuffer(data[start + a:start + b], dt).reshape(shape).copy()
            del data
    else:
        raise ValueError(case)
    seconds = time.perf_counter() - t
    return {"case": case, "seconds": seconds, "peak_delta_bytes": (_status_kb("VmHWM") - base_peak) * 1024,
            "rss_delta_bytes": (_status_kb("VmRSS") - base_rss) * 1024}


def main():
    import jax

    import implicit_attn as ia
    from implicit_attn.registry import family

    spec = family("mamba")
    work = Path(tempfile.mkdtemp(prefix="load-memory-"))
    try:
        cfg = spec.config.from_hf({**CONFIG, "model_type": "mamba"})
        model = spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(0)))
        rows = []
        for layout, shard in (("single file", None), ("sharded (64 MB)", 64 << 20)):
            d = work / ("s" if shard else "m")
            ia.save(model, d, max_shard_bytes=shard)
            size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
            cases = ["ia.load", "read_hf_dir (views, all touched)"]
            if shard is None:
                cases.append("read_bytes + a copy per tensor (like the old reader)")
            for case in cases:
                out = subprocess.run([sys.executable, __file__, "--child", case, str(d)], capture_output=True,
                                     text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                r = json.loads(out.stdout.strip().splitlines()[-1])
                r.update(layout=layout, checkpoint_bytes=size, peak_ratio=r["peak_delta_bytes"] / size)
                rows.append(r)
                print(f"{layout:16s} {case:50s} peak +{r['peak_delta_bytes'] / 2**20:7.1f} MiB "
                      f"= {r['peak_ratio']:.2f}x of {size / 2**20:.1f} MiB  ({r['seconds']:.2f} s)")
        del model
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "config": CONFIG, "measure": "VmHWM (peak RSS) delta of the call in a fresh process"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["# Peak memory of loading a checkpoint", "",
             f"Random Mamba {CONFIG}, float32; each case in a fresh process; peak resident-size increase "
             "(VmHWM) of the call over the checkpoint's size on disk. Target for `ia.load`: <= 1.2x.", "",
             "| layout | case | checkpoint MiB | peak delta MiB | ratio | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['case']} | {r['checkpoint_bytes'] / 2**20:.1f} | "
                     f"{r['peak_delta_bytes'] / 2**20:.1f} | {r['peak_ratio']:.2f}x | {r['seconds']:.2f} |")
    lines += ["", f"Python {meta['python']}, {meta['machine']}, {meta['cpus']} CPUs (shared)."]
    (RESULTS / "load_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        main()
