"""Ship a trained full-Mamba run as the package's embedded induction model.

    python -m benchmarks.induction.ship --run runs/induction/mamba2_key

Writes ``implicit_attn/demo/assets/induction/``: ``config.json`` + ``model.safetensors``
(HF ``MambaForCausalLM`` via ``ia.save``), ``tokenizer.json`` (WordLevel over ``s0..s15``
and ``[key]``) and ``induction.json`` (the task settings, the run, and the accuracy of the
*reloaded* checkpoint on ``--eval`` fresh sequences of the evaluation stream).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


import implicit_attn as ia
from implicit_attn.demo import induction
from . import models, train

SHIP_EVAL_SEED = 777


def ship(run: Path, dest: Path = induction.ASSET_DIR, eval_n: int = 2000) -> dict:
    rc, params = train.load_run(run)
    spec = models.get_spec(rc.model)
    model = models.to_lm(params, spec)
    dest.mkdir(parents=True, exist_ok=True)
    ia.save(model, dest)
    induction.build_tokenizer().save(str(dest / "tokenizer.json"))
    loaded = ia.load(dest)
    ev = induction.eval_set(eval_n, SHIP_EVAL_SEED, rc.length, rc.key)
    acc = induction.evaluate(lambda ids: loaded(ids), ev, batch_size=100)
    result = json.loads((run / "result.json").read_text()) if (run / "result.json").exists() else {}
    meta = {"task": {"key": rc.key, "length": rc.length, "num_symbols": induction.NUM_SYMBOLS,
                     "key_id": induction.KEY},
            "model": spec.name, "run": run.name, "train_config": rc.__dict__,
            "steps": result.get("steps"), "train_seconds": result.get("seconds"),
            "accuracy": acc, "accuracy_eval": {"n": eval_n, "seed": SHIP_EVAL_SEED,
                                               "stream": induction.EVAL_STREAM}}
    (dest / "induction.json").write_text(json.dumps(meta, indent=2))
    size = sum(p.stat().st_size for p in dest.iterdir())
    print(f"shipped {spec.name} ({model.num_params} parameters, {size / 1e6:.2f} MB) to {dest}; "
          f"accuracy of the reloaded checkpoint {acc:.4f} on {eval_n} fresh sequences")
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a finished mamba1/mamba2 run directory")
    ap.add_argument("--dest", default=str(induction.ASSET_DIR))
    ap.add_argument("--eval", type=int, default=2000)
    a = ap.parse_args(argv)
    ship(Path(a.run), Path(a.dest), a.eval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
