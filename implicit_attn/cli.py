"""The ``implicit-attn`` command: ``info``, ``operator``, ``demo``, ``convert`` (and ``explain``, ``analyze``)."""
from __future__ import annotations

import argparse
import atexit
import gc
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from .analyze import cli as analyze_cli
from .compile_cache import QUICK_MAX_WEIGHT_BYTES, enable_compile_cache, quick_compile, quick_flags
from .convert import FAMILY_CHOICES, convert_checkpoint
from .demo import induction
from .explain import cli as explain_cli
from .explain import explain, relevance_strip
from .explain.viz import SCALES, heatmap
from .io import CheckpointError, load, tokenize, weight_bytes


def _parse_ids(text: str) -> np.ndarray:
    return np.asarray(explain_cli.int_list(text, "--ids", low=0), np.int64)[None]


def save_heatmap(matrix: np.ndarray, path: Path, title: str, tokens=None, scale: str = "log") -> Path:
    """Write an ``(L, L)`` map as a PNG heatmap (query rows, key columns; ``scale``:
    ``"log"`` or ``"linear"`` colours, see ``explain.viz``)."""
    return heatmap(matrix, path, title, tokens=tokens, scale=scale)


def cmd_info(args) -> int:
    model = load(args.ckpt)
    print(json.dumps(model.info(), indent=2))
    return 0


def _operator_map(model, ids, layer: int, variant: str, how: str):
    op = model.operators(ids, layers=[layer], variant=variant)[0]
    return op, np.asarray(op.reduce(how))[0]


def cmd_operator(args) -> int:
    model = load(args.ckpt)
    ids, tokens = tokenize(args.ckpt, args.text) if args.text is not None else (_parse_ids(args.ids), None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = len(model.layers)
    # An attention layer's operator (softmax attention) has no ablations: say so rather than
    # writing a "full" map under an ablation's name.
    if args.variant != "full" and -n <= args.layer < n and explain_cli.layer_kind(model, args.layer) == "attention":
        raise ValueError(explain_cli.attention_variant_error(model, [args.layer % n], args.variant))
    op, m = _operator_map(model, ids, args.layer, args.variant, args.how)
    layer = args.layer % n  # files and titles name the layer, not "-1" (which reads as layer 1)
    stem = f"layer{layer}_{args.variant}_{args.how}"
    np.save(out / f"{stem}.npy", m)
    png = save_heatmap(m, out / f"{stem}.png",
                       f"{model.family} layer {layer}: channel {args.how} of H ({args.variant})",
                       tokens=tokens, scale=args.scale)
    print(f"operator of layer {layer}: {op.shape[1]} channels, L = {op.shape[2]}")
    if args.variant == "full":
        print(f"exactness (max |H v + offset - output| / max |output|, against the block computed in "
              f"{model.dtype}): {op.relative_error():.2e}")
    print(f"wrote {png}")
    print(f"wrote {out / (stem + '.npy')}")
    return 0


def cmd_demo(args) -> int:
    """The shipped induction-head Mamba: load, check exactness, explain one random sequence."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, meta = induction.load_default()
    task = meta["task"]
    length = task["length"] if args.length is None else args.length
    print(f"1. loaded the embedded induction model ({meta['model']}, {model.num_params} parameters, "
          f"{len(model.layers)} layer(s)) from {induction.ASSET_DIR}: trained "
          f"{'with' if task['key'] else 'without'} the key token at length {task['length']}, "
          f"accuracy {100 * meta['accuracy']:.1f}% on {meta['accuracy_eval']['n']} fresh sequences")
    b = induction.sample(np.random.default_rng(args.seed), 1, length, task["key"])
    ids, e, t = b.ids, int(b.earlier_pos[0]), int(b.target_pos[0])
    toks = induction.decode(ids[0])
    pred = int(np.asarray(model(ids))[0, -1].argmax())
    print(f"2. random induction sequence (seed {args.seed}, L = {length}): ... "
          f"{' '.join(toks[max(0, e - 3):e + 3])} ... {' '.join(toks[-4:])}")
    print(f"   the last token {toks[-1]} occurred earlier at position {e}; the answer is the token after "
          f"it, {toks[t]} (position {t}); the model predicts {induction.decode([pred])[0]} "
          f"({'correct' if pred == int(b.answer[0]) else 'wrong'})")
    ops = model.operators(ids)
    for i, op in enumerate(ops):
        err = op.relative_error()
        status = "exact" if err <= 1e-5 else "NOT EXACT"
        print(f"3. layer {i}: H of shape {op.shape}; max|H v + offset - output|/max|output| = "
              f"{err:.2e} ({status})")
        if not err <= 1e-5:  # NaN (nothing compared) fails too
            return 1
    m = np.asarray(ops[-1].reduce("abs_mean"))[0]
    png = save_heatmap(m, out / "demo_layer_last_abs_mean.png",
                       f"induction Mamba, layer {len(ops) - 1}: mean |H| over channels "
                       f"(earlier occurrence {e}, answer position {t})", tokens=toks, scale=args.scale)
    np.save(out / "demo_layer_last_abs_mean.npy", m)
    print(f"4. wrote the channel-mean |H| map of the last layer to {png}")
    # abs_mean channel maps: on this model the signed mean cancels across channels and its
    # rollout is less faithful than a random order (README, induction faithfulness table).
    ex = explain(model, ids, method="rollout", how="abs_mean")
    rel = ex.relevance[0]
    np.save(out / "demo_rollout_relevance.npy", rel)
    lo, hi = max(0, t - 12), min(length, t + 12)
    strip = relevance_strip(rel[lo:hi], out / "demo_rollout_relevance.png", tokens=toks[lo:hi],
                            names=["rollout"], title=f"rollout (abs_mean) relevance for the last query, "
                                                     f"positions {lo}-{hi - 1} (answer at {t})")
    top3 = [int(j) for j in np.argsort(-rel[:-1], kind="stable")[:3]]
    print(f"5. rollout relevance (channel-mean |H| maps) of every position for the last query: "
          f"{out / 'demo_rollout_relevance.npy'} "
          f"(strip around the answer: {strip}); most relevant positions {top3}")
    if t == length - 1:
        print("6. the answer is the last position itself (the last two tokens are equal): "
              "no off-diagonal key to check")
        return 0
    key = int(induction.strongest_keys(m[None, -1])[0])
    verdict = "YES" if key == t else "NO"
    print(f"6. strongest key (off the diagonal) for the last query in layer {len(ops) - 1}: position {key}; "
          f"the position right after the earlier occurrence is {t}: {verdict}")
    return 0


def cmd_convert(args) -> int:
    """Convert a PyTorch-pickle checkpoint (a state-spaces/mamba-* directory with mamba_ssm's
    config.json and pytorch_model.bin, an official RWKV-4/5.2/6/7 .pth, or a Hugging Face
    directory whose weights are pytorch_model.bin or its shards) into a safetensors checkpoint
    directory that every other command (and implicit_attn.load) reads; an official Vision Mamba .pth
    (hustvl/Vim) becomes a directory that implicit_attn.models.vim.load reads. The pickle is
    read with torch.load(weights_only=True) only (torch must be installed): anything but tensors
    is refused and never run."""
    config = convert_checkpoint(args.src, args.dst, args.family, args.vim_cls, not args.vim_sum_out)
    size = (f"vocabulary {config['vocab_size']}" if "vocab_size" in config
            else f"{config['num_labels']} classes, {config['image_size']}px images")
    print(f"converted {args.src} -> {args.dst} (model_type {config['model_type']}, "
          f"{config['num_hidden_layers']} layers, hidden size {config['hidden_size']}, {size})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    fmt = explain_cli.HelpFormatter
    p = argparse.ArgumentParser(prog="implicit-attn", description=explain_cli.plain(__doc__), formatter_class=fmt)
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile everything afresh: do not read or write JAX's persistent compilation cache "
                        "(default: on, in $IMPLICIT_ATTN_CACHE/jax or ~/.cache/implicit_attn/jax, "
                        "one subdirectory per CPU; "
                        "IMPLICIT_ATTN_COMPILE_CACHE=0 also turns it off, or names another directory)")
    p.add_argument("--compile", default="auto", choices=["auto", "quick", "optimized"],
                   help="how XLA compiles: 'quick' builds slower machine code in a fraction of the time "
                        "(compile_cache.QUICK_XLA_FLAGS, on the jaxlib releases known to accept them), 'optimized' is XLA's default, 'auto' is quick for "
                        f"checkpoints with at most {QUICK_MAX_WEIGHT_BYTES >> 20} MiB of weights (the demo's "
                        "model among them), where compiling takes longer than running; options already in "
                        "$XLA_FLAGS win")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="family, layers, widths and parameter count of a checkpoint",
                       formatter_class=fmt)
    s.add_argument("ckpt", help="Hugging Face checkpoint directory, or a repository id ORG/NAME in the "
                                "local Hugging Face cache")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("operator", help="heatmap + raw array of one layer's channel-summarised operator",
                       formatter_class=fmt)
    s.add_argument("ckpt", help="Hugging Face checkpoint directory, or a repository id ORG/NAME in the "
                                "local Hugging Face cache")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="input text (tokenized with the checkpoint's tokenizer.json)")
    src.add_argument("--ids", type=explain_cli.int_list_type("--ids", low=0), help="token ids, e.g. '1,2,3'")
    s.add_argument("--layer", type=int, default=0, help="layer index (negative counts from the end)")
    s.add_argument("--variant", default="full",
                   help="operator variant (ablation); attention layers accept only 'full'. Per family: "
                        + explain_cli.variants_help())
    s.add_argument("--how", default="abs_mean", choices=["mean", "abs_mean", "pos_mean"],
                   help="channel summary of H: mean of H, of |H|, or of max(H, 0)")
    s.add_argument("--scale", default="log", choices=list(SCALES), help="heatmap colour scale")
    s.add_argument("--out", default="out", help="output directory")
    s.set_defaults(func=cmd_operator)

    s = sub.add_parser("demo", help="end-to-end demo on the embedded default model", formatter_class=fmt,
                       description=explain_cli.plain(cmd_demo.__doc__))
    s.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "implicit_attn_demo"),
                   help="output directory")
    s.add_argument("--length", type=int, default=None,
                   help="sequence length (default: the length the model was trained at)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random induction sequence")
    s.add_argument("--scale", default="log", choices=list(SCALES), help="heatmap colour scale")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("convert",
                       help="PyTorch pickle (mamba_ssm, official RWKV or ViM .pth) -> safetensors checkpoint",
                       formatter_class=fmt, description=explain_cli.plain(cmd_convert.__doc__))
    s.add_argument("src", help="mamba_ssm checkpoint directory (config.json + pytorch_model.bin), official RWKV "
                               ".pth file, or Hugging Face directory with pytorch_model.bin (or its shards)")
    s.add_argument("dst", help="output directory (config.json + model.safetensors)")
    s.add_argument("--family", default=None, choices=list(FAMILY_CHOICES),
                   help="family (model_type) to insist on; default: detected from the source (an error if it disagrees)")
    s.add_argument("--vim-cls", default="middle", choices=["middle", "start", "end"],
                   help="official ViM checkpoint: where its CLS token sits (the weights do not say; the released "
                        "*midclstok* models: middle)")
    s.add_argument("--vim-sum-out", action="store_true",
                   help="official ViM checkpoint trained with if_devide_out=False (out_proj of y_f + y_b, not of "
                        "their mean)")
    s.set_defaults(func=cmd_convert)

    explain_cli.add_parser(sub)
    analyze_cli.add_parser(sub)
    return p


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its lines joined with "; ")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return "; ".join(lines) or type(e).__name__


def wants_quick_compile(args) -> bool:
    """Whether a parsed command line compiles with ``compile_cache.QUICK_XLA_FLAGS``:
    ``--compile quick``, or ``auto`` (the default) for a checkpoint of at most
    ``QUICK_MAX_WEIGHT_BYTES`` of safetensors weights (``demo``: the embedded model). A
    checkpoint that cannot be found gets the default; the command reports it."""
    if args.compile != "auto":
        return args.compile == "quick"
    ckpt = induction.ASSET_DIR if args.command == "demo" else getattr(args, "ckpt", None)
    if ckpt is None:
        return False
    try:
        return weight_bytes(ckpt) <= QUICK_MAX_WEIGHT_BYTES
    except CheckpointError:
        return False


def main(argv=None) -> int:
    """Run the command line; returns the exit code: 0, 2 for a usage error (argparse's
    message) or a library error (``ValueError``/``TypeError``/``OSError``, including
    ``CheckpointError``), 1 for any other exception. Errors are one line on stderr,
    never a traceback."""
    try:
        argv = explain_cli.attach_negative_lists(sys.argv[1:] if argv is None else list(argv))
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage errors (2, message printed), --help (0)
        return e.code if isinstance(e.code, int) else 2
    try:
        if not args.no_compile_cache:
            enable_compile_cache()
        if args.compile == "quick" and not quick_flags():
            print(f"implicit-attn: note: --compile quick compiles with XLA's defaults here: jaxlib "
                  f"{importlib.metadata.version('jaxlib')} is not among the releases known to accept its "
                  "options (compile_cache.QUICK_FLAGS_JAXLIB)", file=sys.stderr)
        with quick_compile(wants_quick_compile(args)):
            return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"implicit-attn: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - anything else is still one line, not a traceback
        print(f"implicit-attn: error: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 1


def console() -> None:
    """The ``implicit-attn`` executable: ``main`` on ``sys.argv``; then the exit handlers run
    (``atexit``: JAX's, which end a multi-process ``jax.distributed`` run in step with the
    other processes, and any other library's), stdout and stderr are flushed, and the process
    ends with ``main``'s exit code. What is skipped is the interpreter's teardown, freeing
    each module, array and compiled program one by one: about 0.7 s after an ``explain`` on a
    2-core CPU. Before ``main``, everything the imports made is frozen (``gc.freeze``): the
    cyclic collector's full passes then skip those 200,000 objects, which live as long as
    this process anyway (0.2-0.4 s of an ``explain``)."""
    gc.freeze()
    code = main()
    atexit._run_exitfuncs()  # noqa: SLF001 - the standard library's own exit sequence, run early
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
