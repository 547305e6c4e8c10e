"""``implicit-attn analyze CKPT --data FILE --out STORE [--analyses maps,relevance,faithfulness,stats] ...``.

Runs the analyses over every example of a corpus (``.jsonl`` with ``"text"`` or ``"ids"``
per line, or one text per line) into a Zarr v3 store, in batches over all local devices
(and over all processes with ``--distributed``). Rerunning the same command resumes: rows
already marked done are not recomputed. A summary is printed at the end.
"""
from __future__ import annotations

import json

import jax

from ..explain.cli import HelpFormatter, int_list, int_list_type, plain
from ..explain.maps import HOWS
from ..explain.methods import METHODS
from ..explain.metrics import SCORES
from .run import ANALYSES, analyze


def analyses_list(text: str) -> list[str]:
    """``"maps,relevance"`` -> ``["maps", "relevance"]``; ``ValueError`` for unknown names."""
    names = [a.strip() for a in text.split(",")]
    bad = [a for a in names if a not in ANALYSES]
    if bad or not names:
        raise ValueError(f"--analyses must be names from {', '.join(ANALYSES)} separated by commas, got {text!r}")
    return names


def add_parser(subparsers):
    """Add the ``analyze`` subcommand to an ``argparse`` subparsers object."""
    s = subparsers.add_parser("analyze", help="batch analysis of a corpus into a resumable Zarr store",
                              description=plain(__doc__.split("\n\n")[1]), formatter_class=HelpFormatter)
    s.add_argument("ckpt", metavar="CKPT", help="Hugging Face checkpoint directory, or a cached repository id")
    s.add_argument("--data", required=True, help="corpus: .jsonl ({\"text\": ...} or {\"ids\": [...]} per line) "
                                                 "or a text file (one example per line)")
    s.add_argument("--out", required=True, help="store directory (created; resumed if it holds the same run)")
    s.add_argument("--analyses", default="maps,relevance,stats", type=analyses_list,
                   help=f"comma-separated, from {', '.join(ANALYSES)}")
    s.add_argument("--method", default="rollout", choices=list(METHODS), help="relevance method")
    s.add_argument("--how", default="abs_mean", choices=list(HOWS), help="channel summary of each layer's map")
    s.add_argument("--variant", default="full", help="operator variant (ablation)")
    s.add_argument("--layers", default=None, type=int_list_type("--layers"), help="layer indices (default: all)")
    s.add_argument("--start-layer", type=int, default=0, help="first of the selected layers combined")
    s.add_argument("--normalize-rows", action="store_true", help="row-normalise I + A in rollout")
    s.add_argument("--exclude", default=None, type=int_list_type("--exclude", low=0),
                   help="positions (from each example's start) given relevance 0, e.g. '0' for a BOS")
    s.add_argument("--baseline-id", type=int, default=0, help="faithfulness: the token that replaces removed ones")
    s.add_argument("--score", default="prob", choices=list(SCORES), help="faithfulness: score of the target")
    s.add_argument("--batch-size", type=int, default=8, help="examples per batch (all local devices together)")
    s.add_argument("--pad-multiple", type=int, default=16, help="bucket lengths are multiples of this")
    s.add_argument("--max-length", type=int, default=None, help="longer examples are bad lines")
    s.add_argument("--skip-bad-lines", action="store_true",
                   help="skip lines that cannot be read and record them in the manifest (default: stop with an "
                        "error naming the line)")
    s.add_argument("--model-shards", type=int, default=1,
                   help="split the parameters over this many devices (read slice by slice from the safetensors "
                        "files); the batch is split over the rest")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    d = s.add_argument_group("several processes (jax.distributed)")
    d.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (arguments detected on TPU pods and SLURM, or "
                        "given below)")
    d.add_argument("--coordinator", default=None, help="address HOST:PORT of process 0")
    d.add_argument("--num-processes", type=int, default=None, help="number of processes")
    d.add_argument("--process-id", type=int, default=None, help="this process's index")
    s.set_defaults(func=cmd_analyze)


def cmd_analyze(args) -> int:
    if args.distributed or args.coordinator is not None:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    summary = analyze(args.ckpt, args.data, args.out, args.analyses, method=args.method, how=args.how,
                      variant=args.variant, layers=args.layers and int_list(args.layers, "--layers"),
                      start_layer=args.start_layer, normalize_rows=args.normalize_rows,
                      exclude=int_list(args.exclude, "--exclude", low=0) if args.exclude else (),
                      baseline_id=args.baseline_id, score=args.score, batch_size=args.batch_size,
                      pad_multiple=args.pad_multiple, max_length=args.max_length,
                      skip_bad_lines=args.skip_bad_lines, model_shards=args.model_shards,
                      progress=not args.no_progress)
    print(json.dumps(summary))
    return 0


__all__ = ["add_parser", "cmd_analyze", "analyses_list"]
