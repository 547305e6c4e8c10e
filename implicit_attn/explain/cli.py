"""``implicit-attn explain CKPT (--text TEXT | --ids IDS) [--method ...] --out DIR``.

Loads the checkpoint, tokenizes with its ``tokenizer.json`` when present (the ``tokenizers``
package), computes the per-layer operators one layer at a time under a progress bar,
and writes: ``<method>_layers.png`` (grid of the per-layer maps the method combines),
``<method>_matrix.png`` (raw mean / rollout matrix), ``relevance.png`` (token strips),
``relevance.json`` (tokens, ids, relevance per method, metrics), ``curves.png`` with
``--metrics``, and the self-contained ``report.html``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from tqdm import tqdm

from ..io import load, load_tokenizer, tokenize
from . import metrics as M
from ..registry import FAMILIES
from .maps import HOWS
from .methods import METHODS, explain
from .report import write_html
from .viz import curves_plot, heatmap_grid, relevance_strip


INT_ARG_LIMIT = 2**31 - 1  # bound of every integer in a list option (token ids, layers, positions)


def int_list(text: str, what: str, low: int = -INT_ARG_LIMIT) -> list[int]:
    """The integers of a list option such as ``--ids '1,2 3'`` (commas and/or spaces).

    Raises ``ValueError`` naming ``what`` and the text: no integers, an empty entry
    (``'1,,2'``, a leading or trailing comma), something not a plain decimal integer,
    or a value outside ``[low, INT_ARG_LIMIT]``."""
    vals = []
    for k, part in enumerate(str(text).split(",")):
        toks = part.split()
        if not toks:
            where = "the text is blank" if not str(text).strip() else f"entry {k + 1} is empty"
            raise ValueError(f"{what} must be integers separated by commas or spaces, got {text!r} ({where})")
        for t in toks:
            if not re.fullmatch(r"[+-]?[0-9]+", t):
                raise ValueError(f"{what} must be integers separated by commas or spaces, got {text!r} "
                                 f"({t!r} is not an integer)")
            v = int(t)
            if not low <= v <= INT_ARG_LIMIT:
                raise ValueError(f"{what} must be integers in [{low}, {INT_ARG_LIMIT}], got {t} in {text!r}")
            vals.append(v)
    return vals


def int_list_type(what: str, low: int = -INT_ARG_LIMIT):
    """An ``argparse`` ``type`` that checks a list option with ``int_list`` when the command
    line is parsed (a usage error, exit code 2, before any checkpoint is read) and keeps
    the text as given."""
    def check(text: str) -> str:
        try:
            int_list(text, what, low)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{what} ")) from None
        return text

    return check


NEGATIVE_LIST = re.compile(r"-\d+\s*(,\s*-?\d+\s*)+")


def attach_negative_lists(argv: list[str]) -> list[str]:
    """``argv`` with every ``--option -1,2`` written ``--option=-1,2``: argparse reads a value
    that starts with ``-`` and is not one number as an option, so a list option given a list
    that starts with a negative number would be refused as "expected one argument"."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and NEGATIVE_LIST.fullmatch(a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def plain(text: str | None) -> str | None:
    """Docstring text for ``--help``: reST literals (````x````) become plain ``x``."""
    return None if text is None else re.sub(r"``([^`]*)``", r"\1", text)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to every option whose help does not state its default already
    and whose default means something (not None / False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def variants_help() -> str:
    """The operator variants each registered family accepts, for ``--variant`` help."""
    return "; ".join(f"{s.label} ({s.model_type}): {', '.join(s.variants)}" for s in FAMILIES.values())


def layer_kind(model, layer: int) -> str:
    """``"attention"`` for an attention layer (RecurrentGemma), else ``"recurrent"``."""
    return getattr(getattr(model.layers[layer], "mixer", None), "kind", "recurrent")


def add_parser(subparsers):
    """Add the ``explain`` subcommand to an ``argparse`` subparsers object."""
    s = subparsers.add_parser("explain", help="token relevance maps, plots and an HTML report",
                              description=plain(__doc__.split("\n\n")[1]) if __doc__ else None,
                              formatter_class=HelpFormatter)
    s.add_argument("ckpt", metavar="CKPT",
                   help="Hugging Face checkpoint directory, or a repository id ORG/NAME in the local "
                        "Hugging Face cache")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="input text (needs CKPT/tokenizer.json)")
    src.add_argument("--ids", type=int_list_type("--ids", low=0), help="token ids, e.g. '1,2,3'")
    s.add_argument("--method", default="rollout", choices=list(METHODS) + ["all"],
                   help="relevance method; 'all' runs every one")
    s.add_argument("--variant", default="full",
                   help="operator variant (ablation); attention layers always use 'full'. Per family: "
                        + variants_help())
    s.add_argument("--layers", default=None, type=int_list_type("--layers"),
                   help="layer indices, e.g. '0,2' (default: all)")
    s.add_argument("--query", type=int, default=-1, help="query position (default: -1, the last)")
    s.add_argument("--target", type=int, default=None, help="target token id (default: argmax at query)")
    s.add_argument("--how", default="abs_mean", choices=list(HOWS),
                   help="channel aggregation of H (default: abs_mean; signed channels cancel in mean)")
    s.add_argument("--heads", default=None, type=int_list_type("--heads"),
                   help="only these heads, e.g. '0,3' (Mamba-2 mixers, attention layers; default: all channels)")
    s.add_argument("--segment-pos", default=None, type=int_list_type("--segment-pos"),
                   help="document positions of packed input, e.g. '0,1,2,0,1' (Griffin / RecurrentGemma; "
                        "default: one document)")
    s.add_argument("--start-layer", type=int, default=0,
                   help="index, into the selected layers, of the first layer that raw / rollout / "
                        "attribution combine")
    s.add_argument("--normalize-rows", action="store_true", help="row-normalise I + A in rollout (default: off)")
    s.add_argument("--exclude", default=None, type=int_list_type("--exclude"),
                   help="positions to exclude (sink/BOS), e.g. '0' (default: none)")
    s.add_argument("--metrics", action="store_true",
                   help="also compute faithfulness metrics and curves (default: off; runs the model many times)")
    s.add_argument("--baseline-id", type=int, default=0, help="token id that replaces removed tokens in the metrics")
    s.add_argument("--out", default="explain_out", help="output directory")
    s.set_defaults(func=run)
    return s


def _inputs(args, tok):
    if args.text is not None:
        return tokenize(args.ckpt, args.text)
    ids = np.asarray(int_list(args.ids, "--ids", low=0), np.int64)[None]
    if tok is not None:
        toks = [tok.id_to_token(int(i)) for i in ids[0]]
        return ids, [t if t is not None else str(i) for t, i in zip(toks, ids[0])]
    return ids, [str(i) for i in ids[0]]


def token_text(tok, token_id: int) -> str:
    """``'text' (id N)`` when the tokenizer knows the id, else ``id N``."""
    text = None if tok is None else tok.id_to_token(int(token_id))
    return f"id {token_id}" if text is None else f"{text!r} (id {token_id})"


def attention_variant_error(model, layers, variant: str) -> str:
    """The message for an ablation variant asked of attention layers only."""
    rec = [l for l in range(len(model.layers)) if layer_kind(model, l) != "attention"]
    what = f"layer {layers[0]} is an attention layer" if len(layers) == 1 else f"layers {layers} are attention layers"
    return (f"{what} of this {model.family} model: its operator is the softmax attention, which accepts only "
            f"variant 'full' (got {variant!r}); variant {variant!r} applies to the recurrent layers {rec}")


def _attention_note(model, layers, variant: str) -> str | None:
    """A note when ``variant`` is an ablation and some selected layers are attention layers,
    whose operator (softmax attention) has no ablations and is used as "full"; a
    ``ValueError`` when every selected layer is an attention layer (nothing to ablate)."""
    n = len(model.layers)
    sel = list(range(n)) if layers is None else [l % n for l in layers if -n <= l < n]
    att = [l for l in sel if layer_kind(model, l) == "attention"]
    if variant == "full" or not att:
        return None
    if len(att) == len(sel):
        raise ValueError(attention_variant_error(model, att, variant))
    return (f"layers {att} are attention layers: their operator is the softmax attention, which has no "
            f"ablations, so they use variant 'full'; variant {variant!r} applies to the other layers")


def run(args) -> int:
    """Run ``explain``; returns the exit code (0)."""
    model = load(args.ckpt)
    tok = load_tokenizer(args.ckpt)
    ids, tokens = _inputs(args, tok)
    layers = None if args.layers is None else int_list(args.layers, "--layers")
    note = _attention_note(model, layers, args.variant)
    if note:
        print(f"note: {note}", file=sys.stderr)
    exclude = () if args.exclude is None else tuple(int_list(args.exclude, "--exclude"))
    heads = None if args.heads is None else int_list(args.heads, "--heads")
    pos = None if args.segment_pos is None else np.asarray(int_list(args.segment_pos, "--segment-pos"))[None]
    methods = list(METHODS) if args.method == "all" else [args.method]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rel, images, results, written = {}, {}, {}, []
    ex = None
    for m in methods:
        def bar(it, m=m):
            n = len(model.layers) if layers is None else len(layers)
            return tqdm(it, total=n, desc=f"{m} ({args.variant})", unit="layer", file=sys.stderr)

        ex = explain(model, ids, m, variant=args.variant, layers=layers, query=args.query,
                     target=args.target, how=args.how, start_layer=args.start_layer,
                     normalize_rows=args.normalize_rows, exclude=exclude, progress=bar, heads=heads,
                     segment_pos=pos)
        rel[m] = ex.relevance[0]
        what = {"raw": f"{args.how} of H", "rollout": f"{args.how} of H",
                "attribution": "(mean grad x mean H)^+", "contributions": "R_l = g H v"}[m]
        p = heatmap_grid(ex.layer_maps[:, 0], out / f"{m}_layers.png",
                         [f"layer {l}" + (" (attention: full)" if note and layer_kind(model, l) == "attention"
                                          else "") for l in ex.layers], tokens,
                         suptitle=f"{model.family} {m}: per-layer {what} ({args.variant})")
        images[f"{m}: per-layer maps"] = p
        written.append(p)
        if ex.matrix is not None:
            p = heatmap_grid(ex.matrix[0], out / f"{m}_matrix.png", [f"{m} matrix"], tokens)
            images[f"{m}: combined matrix"] = p
            written.append(p)
        if args.metrics:
            curves = M.faithfulness(model, ids, ex.relevance, query=ex.query, target=ex.target,
                                    baseline_id=args.baseline_id, segment_pos=pos)
            results[m] = {k: c.mean_area for k, c in curves.items()}
            p = curves_plot(curves, out / f"{m}_curves.png")
            images[f"{m}: faithfulness curves"] = p
            written.append(p)
    p = relevance_strip(np.stack(list(rel.values())), out / "relevance.png", tokens, list(rel),
                        title=f"relevance for query position {ex.query}")
    images = {"token relevance": p, **images}
    written.append(p)
    meta = {"checkpoint": args.ckpt, "family": model.family, "variant": args.variant,
            "layers": ex.layers, "query position": ex.query,
            "target token": token_text(tok, int(ex.target[0])), "channel aggregation": args.how,
            "exclude": list(exclude)}
    if note:
        meta["note"] = note
    if heads is not None:
        meta["heads"] = heads
    if pos is not None:
        meta["segment positions"] = pos[0].tolist()
    report = write_html(out / "report.html", tokens, rel, title=f"{model.family} explanation",
                        query=ex.query, images=images, metrics=results or None, meta=meta)
    js = out / "relevance.json"
    js.write_text(json.dumps({"tokens": tokens, "ids": ids[0].tolist(), "query": ex.query,
                              "target": int(ex.target[0]), "target_token": tok.id_to_token(int(ex.target[0]))
                              if tok is not None else None, "variant": args.variant,
                              "relevance": {k: np.asarray(v).tolist() for k, v in rel.items()},
                              "metrics": results}, indent=1))
    for p in written + [js]:
        print(f"wrote {p}")
    print(f"report: {report}")
    return 0


__all__ = ["add_parser", "run", "load_tokenizer", "int_list", "int_list_type", "attach_negative_lists", "INT_ARG_LIMIT"]
