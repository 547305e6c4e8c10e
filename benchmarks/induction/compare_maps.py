"""Per-layer attention maps and over-smoothing of models trained on the same task, side by side.

    # a transformer trained on the shipped Mamba's task (same trainer and data stream; ~20 min here)
    python -m benchmarks.induction.train --model transformer_alibi --key --steps 1000 --batch-size 32 \
        --lr 3e-3 --warm-length 64 --warm-steps 500 --out runs/induction/transformer_alibi_key
    # the shipped Mamba vs that transformer and an untrained one (the shipped figure; ~3 min)
    python -m benchmarks.induction.compare_maps --b runs/induction/transformer_alibi_key random-las
    python -m benchmarks.induction.compare_maps --a CKPT_A --b CKPT_B --tag _mine   # any two

``CKPT_A`` / ``CKPT_B`` (``--a`` / ``--b``): checkpoint directories (``config.json`` +
``model.safetensors``) of models with the same vocabulary: any registered family (``ia.load``)
or the project's LaS transformer (``model_type`` ``las_transformer``, ``models.las.load``), or
a run directory of ``benchmarks.induction.train`` (``run.json`` + orbax checkpoints; its latest
parameters, ``models.to_lm``). ``--a`` defaults to the shipped induction Mamba
(``implicit_attn/demo/assets/induction``). ``--b random-las`` builds a randomly initialised
softmax transformer (``models.las`` with ``--las-variant vanilla``: no ELD decay, no
smoothing; 2 layers, 4 heads, seed 0) at ``A``'s width and vocabulary, saves it to
``--random-dir`` (default ``runs/compare_random_las``, not versioned) and uses it: the
untrained baseline.

The trained transformer is ``models.SPECS["transformer_alibi"]``: the LaS model's causal
softmax attention with ALiBi's distance bias (2 layers, width 64, 4 heads). Its ``vanilla``
twin (no positional information but the causal mask) did not learn the task in a probe
(300 steps at length 64: loss 2.82, ln 16 = 2.77, accuracy 0.106; ALiBi 2.41 and 0.404).

The inputs are fresh sequences of the induction task (``demo.induction.eval_set``; key /
no key and length from ``A``'s ``induction.json`` when there is one). Outputs, in
``--out`` (default ``benchmarks/results``), named ``induction_compare{--tag}``:

* ``.png``: every layer's map of every model on the first sequence, one panel per layer
  (``explain.model_maps``, ``how="abs_mean"``: the mean of ``|H|`` over channels; for
  attention layers, over heads), drawn by ``explain.heatmap_grid`` (log colour scale);
* ``_smoothing.png``: each model's over-smoothing curve, Eq. 24 of the hidden-attention
  paper's appendix A (``explain.oversmoothing`` at ``--point``, the mean cosine
  similarity of the tokens of each layer's feature map, averaged over the ``--n``
  sequences) against the normalised layer index, drawn by ``explain.smoothing_plot``;
* ``_maps.npz``: every layer's map of each model on the first sequence, ``{name}``:
  ``(layers, L, L)`` float32 (the panels of the figure), and the ids;
* ``.json``: the models' paths, families, widths, accuracy on the ``--n`` sequences, the
  per-layer summaries (``explain.smoothing_summary``), the per-layer induction numbers
  (``induction_masses``: where the last query and every query put their map mass) and the
  settings.

This is a study script rather than library code: what it adds to ``implicit_attn.explain``
(the maps, the measure and the figures, all there) is only the choice of task data, the
loading of checkpoints of different kinds, the induction numbers and the file names.
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

from . import models as specs
from .train import load_run

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHIPPED = Path(induction.__file__).resolve().parent / "assets" / "induction"
SEED = 2468
MAX_COLS = 6


def load_checkpoint(path):
    """A checkpoint directory of any registered family (``ia.load``) or of the LaS
    transformer (``models.las.load``), chosen by its ``config.json`` ``model_type``; or a
    training run directory of ``benchmarks.induction.train`` (``run.json``)."""
    path = Path(path)
    if (path / "run.json").is_file():
        rc, params = load_run(path)
        return specs.to_lm(params, specs.get_spec(rc.model))
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path} has no config.json or run.json: not a checkpoint or run directory")
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


def induction_masses(maps, target_pos) -> dict:
    """Per-layer induction numbers of non-negative maps ``(layers, B, L, L)`` (rows = queries),
    ``target_pos (B,)`` the answer position of each sequence (the token after the earlier
    occurrence; ``induction.Batch.target_pos``). Each row is first divided by its sum.

    Returns ``{name: [one float per layer]}``:
      ``answer_mass``: the last query's share at ``target_pos``, mean over the sequences;
      ``answer_top``: the fraction of sequences whose largest off-diagonal entry of the last
        row is at ``target_pos`` (sequences with ``target_pos == L - 1`` not counted);
      ``prev_token_mass``: the share of query ``i`` at ``i - 1``, mean over ``i >= 1`` and
        the sequences (the previous-token pattern that feeds an induction head).
    """
    m = np.asarray(maps, np.float64)
    t = np.asarray(target_pos)
    if m.ndim != 4 or m.shape[-1] != m.shape[-2] or t.shape != m.shape[1:2]:
        raise ValueError(f"expected maps (layers, B, L, L) and target_pos (B,), got {m.shape} and {t.shape}")
    if (m < 0).any() or not np.isfinite(m).all():
        raise ValueError("maps must be finite and non-negative (e.g. how='abs_mean')")
    L = m.shape[-1]
    if (t < 0).any() or (t >= L).any():
        raise ValueError(f"target_pos must lie in [0, {L}), got range [{t.min()}, {t.max()}]")
    sums = m.sum(-1, keepdims=True)
    share = np.divide(m, sums, out=np.zeros_like(m), where=sums > 0)
    rows = np.arange(t.shape[0])
    last = share[:, :, -1, :]                                     # (layers, B, L)
    ok = t < L - 1
    off = last.copy()
    off[..., -1] = -np.inf
    top = (off.argmax(-1) == t[None]) & ok[None]
    i = np.arange(1, L)
    return {"answer_mass": last[:, rows, t].mean(1).tolist(),
            "answer_top": (top.sum(1) / max(int(ok.sum()), 1)).tolist(),
            "prev_token_mass": share[:, :, i, i - 1].mean((1, 2)).tolist()}


def compare(models: dict, ids, out_dir, tag: str = "", point: str = "hook_resid_post", how: str = "abs_mean",
            tokens=None, meta: dict | None = None, target_pos=None, answer=None, chunk: int = 8) -> dict:
    """Maps of ``ids[0]`` and over-smoothing over all of ``ids`` for each of ``models``.

    Args:
      models: ``{name: LanguageModel}`` (two, or more), sharing a vocabulary.
      ids: ``(B, L)`` token ids; ``ids[:1]`` is drawn, every row enters the over-smoothing.
      out_dir: where ``induction_compare{tag}.png``, ``..._smoothing.png``, ``..._maps.npz``
        (each model's ``(layers, L, L)`` maps of ``ids[0]``) and ``.json`` go.
      point: the feature map of ``explain.oversmoothing``; how: the channel summary of the maps.
      tokens: optional token strings of ``ids[0]`` for the axes (shown when L <= 40).
      target_pos, answer: optional ``(B,)`` answer positions and answer tokens of the task:
        then each model's ``induction_masses`` (maps of every row, ``chunk`` rows at a time;
        needs a non-negative ``how``) and last-position accuracy go into the JSON.
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
        if target_pos is not None:
            all_maps = np.concatenate([np.asarray(model_maps(m, ids[k:k + chunk], how=how), np.float32)
                                       for k in range(0, len(ids), chunk)], axis=1)
            doc[name]["induction"] = induction_masses(all_maps, target_pos)
        if answer is not None:
            last = np.concatenate([np.asarray(m(ids[k:k + chunk]))[:, -1] for k in range(0, len(ids), chunk)])
            doc[name]["accuracy"] = induction.accuracy_of(last, answer)
    n_panels = sum(len(p) for p in panels)
    ncols = n_panels if n_panels <= MAX_COLS else max(len(p) for p in panels)
    base = f"induction_compare{tag}"
    heatmap_grid(np.concatenate(panels), out / f"{base}.png", titles=titles, tokens=tokens, ncols=ncols,
                 suptitle=f"per-layer maps, channel {how} of H (one sequence, L = {ids.shape[1]})",
                 colorbar_label=how)
    smoothing_plot(sums, out / f"{base}_smoothing.png",
                   title=f"over-smoothing (Eq. 24) at {point}, {ids.shape[0]} sequences; lower = less smoothing")
    np.savez_compressed(out / f"{base}_maps.npz", ids=ids[0], **{name: p for name, p in zip(models, panels)})
    result = {"meta": {"point": point, "how": how, "batch": int(ids.shape[0]), "length": int(ids.shape[1]),
                       "figures": [f"{base}.png", f"{base}_smoothing.png"], "maps": f"{base}_maps.npz",
                       **(meta or {})},
              "models": doc}
    (out / f"{base}.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default=str(SHIPPED), help="first checkpoint (default: the shipped induction Mamba)")
    p.add_argument("--b", required=True, nargs="+",
                   help="the other checkpoint(s) or run directories, or 'random-las' (see module doc)")
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
    others, paths = {}, []
    for b in a.b:
        if b == "random-las":
            paths.append(Path(a.random_dir))
            others[f"random {a.las_variant} transformer"] = random_transformer(model_a, paths[-1], a.las_variant)
        else:
            paths.append(Path(b))
            others[paths[-1].name] = load_checkpoint(b)
    batch = induction.eval_set(a.n, SEED, length, task["key"])
    tokens = induction.decode(batch.ids[0]) if length <= 40 else None
    a_name = "shipped induction model" if Path(a.a).resolve() == SHIPPED else Path(a.a).name
    res = compare({a_name: model_a, **others}, batch.ids, a.out, a.tag, point=a.point,
                  tokens=tokens, target_pos=batch.target_pos, answer=batch.answer,
                  meta={"a": shown_path(a.a), "b": [shown_path(b) for b in paths], "seed": SEED,
                        "key": task["key"], "seconds": None})
    res["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out, f"induction_compare{a.tag}.json").write_text(json.dumps(res, indent=2))
    for name, d in res["models"].items():
        s = d["smoothing"]
        ind = d["induction"]
        print(f"{name} ({d['label']}, {d['layers']} layer(s)), accuracy {d['accuracy']:.3f}: per layer "
              f"mean cosine similarity " + ", ".join(f"{m:.3f}" for m in s["mean"])
              + "; last query's mass at the answer " + ", ".join(f"{m:.3f}" for m in ind["answer_mass"])
              + "; previous-token mass " + ", ".join(f"{m:.3f}" for m in ind["prev_token_mass"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
