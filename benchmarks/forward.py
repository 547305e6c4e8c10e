"""Full-model forward of every family, ours (jit) vs the Hugging Face torch model on the
same random weights, each side in a fresh process; logits parity is checked on the way.

Shapes are the published small checkpoints' widths and depths with a small vocabulary
(the embedding and head are not what is measured): mamba-130m, mamba2-130m, rwkv-430m,
and for RecurrentGemma a 768-wide, 12-layer model (recurrentgemma-2b's 2.7 B parameters
in float32, twice, do not fit a 2-core benchmark run alongside anything else).

Families, HF classes and shapes come from the registry (``FamilySpec.bench``,
``FamilySpec.hf_class``); ``--only`` takes ``model_type``s and replaces their rows in
the existing results, keeping the other families' rows (each row's two timings come from
one run; the row's ``date`` says when).

    python -m benchmarks.forward [--quick] [--only mamba,rwkv]
"""
from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, isolated, timeit, write_results


def families() -> list[str]:
    """The benchmarked ``model_type``s: every family in the registry whose reference is a
    transformers class (RWKV-6/7's reference is our plain-torch rebuild of fla's model, a
    per-step loop: ``benchmarks.rwkv_official`` times those against the official package)."""
    import transformers

    from implicit_attn.registry import FAMILIES

    return [t for t, spec in FAMILIES.items() if hasattr(transformers, spec.hf_class)]


def bench_shape(model_type: str, quick: bool) -> dict:
    """The HF config kwargs of ``model_type``'s benchmark model (``FamilySpec.bench``)."""
    from implicit_attn.registry import family

    return dict(family(model_type).bench["quick" if quick else "full"])


def random_ids(vocab: int, L: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, (1, L))


def write_checkpoint(family: str, path: str, quick: bool) -> dict:
    """A random model of the family's benchmark shape, saved in HF layout with our writer."""
    import jax

    import implicit_attn as ia
    from implicit_attn.registry import family as spec_of

    spec = spec_of(family)
    cfg = spec.config.from_hf(bench_shape(family, quick))  # HF kwargs, read as config.json
    model = spec.lm(cfg, spec.init_params(cfg, jax.random.PRNGKey(0)))
    ia.save(model, path)
    n = sum(x.size for x in jax.tree.leaves(model.params()))
    return {"path": path, "params": int(n)}


def case_jax(ckpt: str, L: int, out: str) -> dict:
    import numpy as np

    import implicit_attn as ia

    model = ia.load(ckpt)
    ids = random_ids(model.config.vocab_size, L)
    t = timeit(lambda: model(ids), repeat=3)
    np.save(out, np.asarray(model(ids))[0, -8:])  # the last rows, for the parity check
    return {"seconds": t}


def case_torch(family: str, ckpt: str, L: int, out: str) -> dict:
    import numpy as np
    import torch

    from implicit_attn.registry import family as spec_of
    from implicit_attn.testing import reference_class

    cls = reference_class(spec_of(family).hf_class)
    model = cls.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    ids = torch.tensor(random_ids(model.config.vocab_size, L))

    def run():
        with torch.no_grad():
            return model(ids).logits

    run()  # warm-up (RWKV rescales its weights here in eval mode)
    ts = []
    for _ in range(2):
        t = time.perf_counter()
        logits = run()
        ts.append(time.perf_counter() - t)
    np.save(out, logits[0, -8:].float().numpy())
    return {"seconds": min(ts), "threads": torch.get_num_threads()}


def forward_row(family: str, L: int, quick: bool = False) -> dict:
    """One table row: ours vs torch for ``family`` at length ``L`` (fresh processes)."""
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        ck = isolated("benchmarks.forward:write_checkpoint", family=family, path=str(Path(d) / "m"), quick=quick)
        jx = isolated("benchmarks.forward:case_jax", ckpt=ck["path"], L=L, out=str(Path(d) / "j.npy"))
        th = isolated("benchmarks.forward:case_torch", family=family, ckpt=ck["path"], L=L,
                      out=str(Path(d) / "t.npy"), timeout=3600)
        a, b = np.load(Path(d) / "j.npy"), np.load(Path(d) / "t.npy")
    err = float(np.max(np.abs(a - b)))
    from implicit_attn.registry import family as spec_of

    spec = spec_of(family)
    hf = spec.hf_class
    layers = spec.config.from_hf(bench_shape(family, quick)).num_hidden_layers  # ours (Nemotron-H: token mixers)
    return {"case": f"{family} forward, {layers} layers, {ck['params'] / 1e6:.3g}M params, L={L}",
            "ours_s": jx["seconds"], "baseline": f"HF {hf} (torch CPU, {th['threads']} threads)",
            "baseline_s": th["seconds"], "speedup": th["seconds"] / jx["seconds"],
            "note": f"{L / jx['seconds']:.0f} vs {L / th['seconds']:.0f} tokens/s; max abs logits diff {err:.1e}",
            "family": family, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}


def main(quick: bool = False, only=None) -> list[dict]:
    from implicit_attn.registry import family as spec_of

    for f in only or ():
        spec_of(f)  # ValueError naming the supported model_types
    L = 128 if quick else 512
    name = "forward_quick" if quick else "forward"
    rows = [forward_row(f, L, quick) for f in (only or families())]
    if only and (RESULTS / f"{name}.json").exists():
        new = {r["family"]: r for r in rows}
        old = json.loads((RESULTS / f"{name}.json").read_text())
        for r in old["rows"]:  # rows written before rows carried their own date
            r.setdefault("date", old["meta"]["machine"]["date"])
        kept = [new.pop(r.get("family", r["case"].split()[0]), r) for r in old["rows"]]
        rows = kept + list(new.values())
    write_results(name, rows, columns=["case", "ours_s", "baseline", "baseline_s", "speedup", "note", "date"])
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated model_types (default: all of "
                    "implicit_attn.registry.FAMILIES: mamba, mamba2, recurrent_gemma, rwkv)")
    a = ap.parse_args()
    main(a.quick, [s for s in a.only.split(",") if s] or None)
