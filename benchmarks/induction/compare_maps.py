"""Per-layer attention maps and over-smoothing of two models on the same task, side by side.

    python -m benchmarks.induction.compare_maps --a CKPT_A --b CKPT_B [--n 64] [--length 255]
    python -m benchmarks.induction.compare_maps --b random-las     # the shipped model vs an
                                                                  # untrained transformer

``CKPT_A`` / ``CKPT_B``: checkpoint directories (``config.json`` + ``model.safetensors``) of
models with the same vocabulary: any registered family (``ia.load``) or the project's LaS
transformer (``model_type`` ``las_transformer``, ``models.las.load``). ``--a`` defaults to the
shipped induction Mamba (``implicit_attn/demo/assets/induction``). ``--b random-las`` builds
a randomly initialised softmax transformer (``models.las`` with ``--las-variant vanilla``:
no ELD decay, no smoothing; 2 layers, 4 heads, seed 0) at ``A``'s width and vocabulary,
saves it to ``--random-dir`` (default ``runs/compare_random_las``, not versioned) and uses it: the project ships one trained model, so this is the
demonstration until a transformer is trained on the task (then pass its directory).

The inputs are fresh sequences of the induction task (``demo.induction.eval_set``; key /
no key and length from ``A``'s ``induction.json`` when there is one). Outputs, in
``--out`` (default ``benchmarks/results``), named ``induction_compare{--tag}``:

* ``.png``: every layer's map of both models on the first sequence, one panel per layer
  (``explain.model_maps``, ``how="abs_mean"``: the mean of ``|H|`` over channels; for
  attention layers, over heads), drawn by ``explain.heatmap_grid`` (log colour scale);
* ``_smoothing.png``: each model's over-smoothing curve, Eq. 24 of the hidden-attention
  paper's appendix A (``explain.oversmoothing`` at ``--point``, the mean cosine
  similarity of the tokens of each layer's feature map, averaged over the ``--n``
  sequences) against the normalised layer index, drawn by ``explain.smoothing_plot``;
* ``.json``: both models' paths, families, widths, the per-layer summaries
  (``explain.smoothing_summary``) and the settings.

This is a study script rather than library code: what it adds to ``implicit_attn.explain``
(the maps, the measure and the figures, all there) is only the choice of task data, the
loading of two checkpoints of possibly different kinds and the file names.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import implicit_attn as ia
from implicit_attn.demo import induction
from implicit_attn.explain import heatmap_grid, model_maps, oversmoothing, smoothing_plot, smoothing_summary
from implicit_attn.models import las

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHIPPED = Path(induction.__file__).resolve().parent / "assets" / "induction"
SEED = 2468
MAX_COLS = 6


def load_checkpoint(path):
    """A checkpoint directory of any registered family (``ia.load``) or of the LaS
    transformer (``models.las.load``), chosen by its ``config.json`` ``model_type``."""
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a checkpoint directory")
    if json.loads(cfg.read_text()).get("model_type") == las.MODEL_TYPE:
        return las.load(path)
    return ia.load(path)


def random_transformer(like, path, variant: str = "vanilla", layers: int = 2, heads: int = 4, seed: int = 0):
    """A randomly initialised LaS transformer with ``like``'s width and vocabulary (flags of
    ``las.VARIANTS[variant]``; ``vanilla`` is plain causal softmax attention), saved to
    ``path`` and returned."""
    if variant not in las.VARIANTS:
        raise ValueError(f"variant must be one of {tuple(las.VARIANTS)}, got {variant!r}")
    flags = las.VARIANTS[variant]
    cfg = las.Config(vocab_size=like.config.vocab_size, hidden_size=like.config.hidden_size,
                     num_hidden_layers=layers, num_attention_heads=heads, eld=flags["eld"], alibi=flags["alibi"],
                     pool=3 if flags["smooth"] else 1, chunk=128 if flags["chunked"] else None)
    model = las.init(cfg, seed)
    las.save(path, model)
    return load_checkpoint(path)


def shown_path(path) -> str:
    """``path`` relative to the working directory when it lies below it (for the JSON)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def describe(model) -> dict:
    return {"family": model.family, "label": model.label, "layers": len(model.layers),
            "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size,
            "params": model.num_params}


def compare(models: dict, ids, out_dir, tag: str = "", point: str = "hook_resid_post", how: str = "abs_mean",
            tokens=None, meta: dict | None = None) -> dict:
    """Maps of ``ids[0]`` and over-smoothing over all of ``ids`` for each of ``models``.

    Args:
      models: ``{name: LanguageModel}`` (two, or more), sharing a vocabulary.
      ids: ``(B, L)`` token ids; ``ids[:1]`` is drawn, every row enters the over-smoothing.
      out_dir: where ``induction_compare{tag}.png``, ``..._smoothing.png`` and ``.json`` go.
      point: the feature map of ``explain.oversmoothing``; how: the channel summary of the maps.
      tokens: optional token strings of ``ids[0]`` for the axes (shown when L <= 40).
    Returns:
      the JSON document written (``{"meta", "models": {name: {... "smoothing": summary}}}``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(ids)
    if len(models) < 2:
        raise ValueError(f"compare needs at least two models, got {list(models)}")
    vocab = {name: m.config.vocab_size for name, m in models.items()}
    if len(set(vocab.values())) != 1:
        raise ValueError(f"the models must share a vocabulary (the same task), got vocab sizes {vocab}")
    panels, titles, doc, sums = [], [], {}, {}
    for name, m in models.items():
        maps = np.asarray(model_maps(m, ids[:1], how=how))[:, 0]        # (layers, L, L)
        panels.append(maps)
        titles += [f"{name} ({m.label}): layer {i}" for i in range(len(maps))]
        sums[name] = smoothing_summary(oversmoothing(m, ids, point=point), num_layers=len(m.layers), point=point)
        doc[name] = {**describe(m), "smoothing": sums[name]}
    n_panels = sum(len(p) for p in panels)
    ncols = n_panels if n_panels <= MAX_COLS else max(len(p) for p in panels)
    base = f"induction_compare{tag}"
    heatmap_grid(np.concatenate(panels), out / f"{base}.png", titles=titles, tokens=tokens, ncols=ncols,
                 suptitle=f"per-layer maps, channel {how} of H (one sequence, L = {ids.shape[1]})",
                 colorbar_label=how)
    smoothing_plot(sums, out / f"{base}_smoothing.png",
                   title=f"over-smoothing (Eq. 24) at {point}, {ids.shape[0]} sequences; lower = less smoothing")
    result = {"meta": {"point": point, "how": how, "batch": int(ids.shape[0]), "length": int(ids.shape[1]),
                       "figures": [f"{base}.png", f"{base}_smoothing.png"], **(meta or {})},
              "models": doc}
    (out / f"{base}.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default=str(SHIPPED), help="first checkpoint (default: the shipped induction Mamba)")
    p.add_argument("--b", required=True, help="second checkpoint, or 'random-las' (see module doc)")
    p.add_argument("--las-variant", default="vanilla", help="with --b random-las: a models.las variant")
    p.add_argument("--random-dir", default="runs/compare_random_las", help="with --b random-las: where it is saved")
    p.add_argument("--n", type=int, default=64, help="sequences for the over-smoothing average")
    p.add_argument("--length", type=int, default=None, help="sequence length (default: A's task, else 255)")
    p.add_argument("--point", default="hook_resid_post", help="feature map of the measure")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    model_a = load_checkpoint(a.a)
    task_file = Path(a.a) / "induction.json"
    task = json.loads(task_file.read_text())["task"] if task_file.is_file() else {"key": True,
                                                                                  "length": induction.LENGTH}
    length = a.length or task["length"]
    if a.b == "random-las":
        b_path = Path(a.random_dir)
        model_b = random_transformer(model_a, b_path, a.las_variant)
        b_name = f"random {a.las_variant} transformer"
    else:
        b_path, model_b, b_name = Path(a.b), load_checkpoint(a.b), Path(a.b).name
    batch = induction.eval_set(a.n, SEED, length, task["key"])
    tokens = induction.decode(batch.ids[0]) if length <= 40 else None
    a_name = "shipped induction model" if Path(a.a).resolve() == SHIPPED else Path(a.a).name
    res = compare({a_name: model_a, b_name: model_b}, batch.ids, a.out, a.tag, point=a.point,
                  tokens=tokens, meta={"a": shown_path(a.a), "b": shown_path(b_path), "seed": SEED, "key": task["key"],
                                       "seconds": None})
    res["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out, f"induction_compare{a.tag}.json").write_text(json.dumps(res, indent=2))
    for name, d in res["models"].items():
        s = d["smoothing"]
        print(f"{name} ({d['label']}, {d['layers']} layer(s)): mean cosine similarity per layer "
              + ", ".join(f"{m:.3f}" for m in s["mean"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
