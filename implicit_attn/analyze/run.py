"""``analyze``: a corpus in, a resumable results store out (see ``store`` for the layout).

Per example ``b`` of length ``n_b`` the query is its last position ``q_b = n_b - 1`` and the
target the argmax of the logits there. Analyses (``analyses=``):

  maps          ``maps (N, layers, Lmax, Lmax)``: ``explain.operator_map(op, how)`` per layer.
  relevance     ``relevance (N, Lmax)``: ``explain``'s ``method`` for query ``q_b``;
                ``target (N,)`` is always written.
  faithfulness  ``faithfulness/<metric> (N,)`` areas and ``faithfulness/<metric>_curve (N, G)``
                of ``explain.metrics.faithfulness`` for that relevance.
  stats         ``stats/distance``, ``stats/entropy`` ``(N, layers)``: with
                ``p_ij = |A_ij| / sum_j |A_ij|`` over the causal row ``i`` of a layer's map,
                the mean over rows ``i < n_b`` of ``sum_j p_ij (i - j)`` (how far back a
                position reads, in tokens) and of ``-sum_j p_ij log p_ij`` (nats); rows whose
                map is all zero are left out (NaN if every row is).

Variable lengths: examples are bucketed by length (rounded up to ``pad_multiple``) and
right-padded; the models are causal, so every value at positions ``< n_b`` is that of the
example run alone (to float32 rounding: tested), and everything at positions ``>= n_b`` is
stored as 0 (``ids``: -1).

Devices: a ``jax.sharding.Mesh`` ``("batch", "model")`` over this process's devices, the
batch axis sharded with a ``NamedSharding``; parameters replicated, or with
``model_shards=k`` split over the ``"model"`` axis of size ``k`` (read slice by slice from
the safetensors files onto their devices, ``io.load(sharding_of=model_sharding(mesh))``).
The per-batch computation is one ``jax.jit``.
Processes (``jax.distributed.initialize`` before the call): process ``p`` of ``P`` takes the
rows ``i`` with ``i % P == p``; process 0 creates the store, the others wait for its
manifest; every process writes only its own rows.

Resuming: the batches are a fixed function of the corpus and the settings, so a rerun
recomputes exactly the batches with a row not marked done and writes those rows again with
the same values; the finished store equals an uninterrupted one. The environment variable
``IMPLICIT_ATTN_ANALYZE_KILL_AFTER=K`` (a test hook) SIGKILLs the process once ``K`` rows are
written and marked done; ``K:data`` kills it after the data of the batch reaching ``K``
is written but before those rows are marked done.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from ..explain.maps import HOWS, iter_operators, operator_map, position_mean
from ..explain.methods import METHODS, check_start_layer, combine, contribution_map, query_gradients
from ..explain.metrics import AUC_GRID, ERASER_BINS, FULL_GRID, SCORES, faithfulness
from ..io import load, load_tokenizer
from ..nn import check_layers
from .corpus import Corpus
from ..version import __version__
from .store import FORMAT, Store

ANALYSES = ("maps", "relevance", "faithfulness", "stats")
KILL_AFTER_ENV = "IMPLICIT_ATTN_ANALYZE_KILL_AFTER"
# the curves' grids, as explain.metrics.faithfulness computes them
CURVES = {"auac": FULL_GRID, "au_mse": FULL_GRID, "positive_auc": AUC_GRID, "negative_auc": AUC_GRID,
          "comprehensiveness": ERASER_BINS, "sufficiency": ERASER_BINS}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What an analysis computes (a store only resumes under equal settings)."""

    analyses: tuple = ("maps", "relevance", "stats")
    method: str = "rollout"
    how: str = "abs_mean"
    variant: str = "full"
    layers: tuple | None = None
    start_layer: int = 0
    normalize_rows: bool = False
    exclude: tuple = ()
    baseline_id: int = 0
    score: str = "prob"
    pad_multiple: int = 16
    batch_size: int = 8

    def check(self, model) -> "Settings":
        """Validated copy (layers normalised); ``ValueError`` naming the bad setting."""
        bad = [a for a in self.analyses if a not in ANALYSES]
        if bad or not self.analyses or len(set(self.analyses)) != len(self.analyses):
            raise ValueError(f"analyses must be distinct names from {ANALYSES}, got {list(self.analyses)}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.how not in HOWS:
            raise ValueError(f"how must be one of {HOWS}, got {self.how!r}")
        model.check_variant(self.variant)
        layers = tuple(check_layers(None if self.layers is None else list(self.layers), len(model.layers)))
        check_start_layer(self.start_layer, len(layers), "layers")
        for name in ("pad_multiple", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if any(not isinstance(p, (int, np.integer)) or p < 0 for p in self.exclude):
            raise ValueError(f"exclude must be positions >= 0 (counted from each example's start), "
                             f"got {list(self.exclude)}")
        V = model.config.vocab_size
        if not isinstance(self.baseline_id, (int, np.integer)) or not 0 <= self.baseline_id < V:
            raise ValueError(f"baseline_id {self.baseline_id!r} is outside the vocabulary [0, {V})")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        return dataclasses.replace(self, analyses=tuple(self.analyses), layers=layers,
                                   exclude=tuple(sorted({int(p) for p in self.exclude})))

    def manifest(self) -> dict:
        """The result-defining settings (batching is left out: it changes only rounding)."""
        d = dataclasses.asdict(self)
        for k in ("pad_multiple", "batch_size"):
            d.pop(k)
        d.update(analyses=list(self.analyses), layers=list(self.layers), exclude=list(self.exclude),
                 query="last position of each example", target="argmax of the logits at the query")
        return d


# ----------------------------------------------------------------------------- computation

def attention_stats(maps, valid):
    """Mean attention distance and entropy per layer (module doc).

    Args:
      maps: ``(B, N, L, L)`` causal maps, zero outside each example.
      valid: ``(B, L)`` bool, positions inside the example.
    Returns:
      ``(distance (B, N), entropy (B, N))`` float32.
    """
    A = jnp.abs(maps)
    tot = jnp.sum(A, axis=-1)
    p = A / jnp.where(tot > 0, tot, 1.0)[..., None]
    L = maps.shape[-1]
    back = (jnp.arange(L)[:, None] - jnp.arange(L)[None, :]).astype(jnp.float32)
    dist = jnp.sum(p * back, axis=-1)
    ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    rows = (tot > 0) & valid[:, None, :]
    n = jnp.sum(rows, axis=-1)

    def mean(x):
        return jnp.where(n > 0, jnp.sum(jnp.where(rows, x, 0.0), axis=-1) / jnp.maximum(n, 1), jnp.nan)

    return mean(dist), mean(ent)


def batch_results(model, ids, lengths, s: Settings) -> dict:
    """Every analysis of a right-padded batch (jittable).

    Args:
      ids: ``(B, L)`` token ids, right-padded; lengths: ``(B,)`` true lengths (>= 1).
    Returns:
      ``{"target": (B,), "maps": (B, N, L, L), "relevance": (B, L), "stats/distance": (B, N),
      "stats/entropy": (B, N)}`` (those the settings ask for), zero at padded positions.
    """
    B, L = ids.shape
    q = lengths - 1
    valid = jnp.arange(L)[None, :] < lengths[:, None]
    square = valid[:, :, None] & valid[:, None, :]
    sel = list(s.layers)
    target = jnp.argmax(model(ids)[jnp.arange(B), q], axis=-1)
    out = {"target": target}
    want_rel = "relevance" in s.analyses or "faithfulness" in s.analyses
    use_grads = want_rel and s.method in ("attribution", "contributions")
    want_maps = "maps" in s.analyses or "stats" in s.analyses or (want_rel and s.method != "contributions")
    grads = query_gradients(model, ids, q, target, sel) if use_grads else None
    maps, contribs = [], []
    for l, op in iter_operators(model, ids, sel, s.variant):
        if want_maps:
            maps.append(operator_map(op, s.how))
        if use_grads and s.method == "contributions":
            contribs.append(contribution_map(op, grads[l]))
    if want_maps:
        maps = jnp.where(square[None], jnp.stack(maps), 0.0)   # (N, B, L, L)
        if "maps" in s.analyses:
            out["maps"] = jnp.swapaxes(maps, 0, 1)
        if "stats" in s.analyses:
            out["stats/distance"], out["stats/entropy"] = attention_stats(jnp.swapaxes(maps, 0, 1), valid)
    if want_rel:
        exclude = tuple(p for p in s.exclude if p < L)
        mats = jnp.where(square[None], jnp.stack(contribs), 0.0) if s.method == "contributions" else maps
        gm = None
        if s.method == "attribution":
            gm = jnp.where(valid[None], jnp.stack([position_mean(grads[l]) for l in sel]), 0.0)
        rel = combine(s.method, mats, q, gm, s.start_layer, s.normalize_rows, exclude)[0]
        keep = jnp.ones(L).at[jnp.asarray(exclude, jnp.int32)].set(0.0) if exclude else 1.0
        out["relevance"] = jnp.where(valid, rel * keep, 0.0)
    return out


def step_fn(graphdef, s: Settings, state, ids, lengths) -> dict:
    """``batch_results`` of the model ``nnx.merge(graphdef, state)`` (parameters as arguments,
    not constants of the compiled program)."""
    return batch_results(nnx.merge(graphdef, state), ids, lengths, s)


# The arguments arrive placed (parameters replicated or split over "model", the batch split
# over "batch"), and jit keeps their shardings; one cache for every call (graphdef and
# settings are static), so repeated calls with the same model structure reuse compilations.
step = jax.jit(step_fn, static_argnums=(0, 1))


def model_sharding(mesh: Mesh, axis: str = "model"):
    """A ``sharding_of`` rule for ``io.load``: a tensor is split over ``mesh``'s ``axis``
    along its largest dimension divisible by that axis's size (the first of equal ones);
    tensors with no such dimension are replicated."""
    k = mesh.shape[axis]

    def rule(name, shape):
        dims = [d for d in range(len(shape)) if shape[d] % k == 0]
        if k == 1 or not dims:
            return NamedSharding(mesh, P())
        d = max(dims, key=lambda d: (shape[d], -d))
        return NamedSharding(mesh, P(*[axis if i == d else None for i in range(len(shape))]))

    return rule


def place_state(state, mesh: Mesh, replicate: bool):
    """Parameters on every device of ``mesh``: all replicated, or (``replicate=False``,
    parameters loaded split over the mesh) each kept where it is unless it lives on other
    devices (e.g. an array a family's ``to_params`` computed), which is replicated."""
    rep = NamedSharding(mesh, P())
    devs = set(mesh.devices.flat)
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, rep) if replicate or set(x.sharding.device_set) != devs else x, state)


def faithfulness_rows(model, ids, lengths, relevance, target, s: Settings) -> dict:
    """``explain.metrics.faithfulness`` of each example at its own last position: examples
    of equal length share one call (on the padded ids: the perturbations touch only
    positions ``<= q``). Returns ``{"faithfulness/<m>": (B,), "faithfulness/<m>_curve": (B, G)}``."""
    B = ids.shape[0]
    out = {f"faithfulness/{m}{suffix}": np.zeros((B,) + ((len(g),) if suffix else ()))
           for m, g in CURVES.items() for suffix in ("", "_curve")}
    for n in np.unique(lengths):
        rows = np.flatnonzero(lengths == n)
        curves = faithfulness(model, ids[rows], relevance[rows], query=int(n) - 1, target=target[rows],
                              baseline_id=s.baseline_id, score=s.score, batch_size=s.batch_size)
        for m, c in curves.items():
            out[f"faithfulness/{m}"][rows] = c.area
            out[f"faithfulness/{m}_curve"][rows] = c.values
    return out


# ----------------------------------------------------------------------------- store layout

def array_table(s: Settings, N: int, Lmax: int, n_layers: int) -> dict:
    """``{name: {"shape", "dtype", "fill"}}`` of a store for these settings."""
    t = {"ids": ((N, Lmax), "int32", -1), "length": ((N,), "int32", 0), "line": ((N,), "int64", -1),
         "done": ((N,), "uint8", 0), "target": ((N,), "int32", -1)}
    if "maps" in s.analyses:
        t["maps"] = ((N, n_layers, Lmax, Lmax), "float32", 0.0)
    if "relevance" in s.analyses:
        t["relevance"] = ((N, Lmax), "float32", 0.0)
    if "stats" in s.analyses:
        t["stats/distance"] = t["stats/entropy"] = ((N, n_layers), "float32", 0.0)
    if "faithfulness" in s.analyses:
        for m, g in CURVES.items():
            t[f"faithfulness/{m}"] = ((N,), "float64", 0.0)
            t[f"faithfulness/{m}_curve"] = ((N, len(g)), "float64", 0.0)
    return {k: {"shape": list(shape), "dtype": dt, "fill": fill} for k, (shape, dt, fill) in t.items()}


def model_manifest(model) -> dict:
    """Family, layer count, config hash and parameter hash of a model."""
    cfg = json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str)
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params())[0]:
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return {"family": model.family, "layers": len(model.layers), "config_sha256": hashlib.sha256(cfg.encode()).hexdigest(),
            "params_sha256": h.hexdigest()}


# ----------------------------------------------------------------------------- driver

def plan(lengths: np.ndarray, rows: np.ndarray, pad_multiple: int, batch_size: int, Lmax: int) -> list:
    """Batches ``(bucket length, row indices)``: ``rows`` sorted by (bucket, row) and cut
    into groups of at most ``batch_size`` with one bucket each. A function of its arguments
    only (resuming recomputes the same batches)."""
    bucket = np.minimum(-(-lengths[rows] // pad_multiple) * pad_multiple, Lmax)
    order = np.lexsort((rows, bucket))
    rows, bucket = rows[order], bucket[order]
    out = []
    for b in np.unique(bucket):
        r = rows[bucket == b]
        out += [(int(b), r[i:i + batch_size]) for i in range(0, len(r), batch_size)]
    return out


def kill_hook():
    """``(rows, stage)`` from ``IMPLICIT_ATTN_ANALYZE_KILL_AFTER`` (``"K"`` or ``"K:data"``), or None."""
    v = os.environ.get(KILL_AFTER_ENV)
    if not v:
        return None
    k, _, stage = v.partition(":")
    if not k.isdigit() or stage not in ("", "data"):
        raise ValueError(f"{KILL_AFTER_ENV} must be K or K:data (K rows), got {v!r}")
    return int(k), stage or "done"


def analyze(model_or_ckpt, data, out, analyses=("maps", "relevance", "stats"), *, method: str = "rollout",
            how: str = "abs_mean", variant: str = "full", layers=None, start_layer: int = 0,
            normalize_rows: bool = False, exclude=(), baseline_id: int = 0, score: str = "prob",
            batch_size: int = 8, pad_multiple: int = 16, max_length: int | None = None,
            skip_bad_lines: bool = False, tokenizer=None, text_field: str = "text", ids_field: str = "ids",
            devices=None, model_shards: int = 1, progress: bool = True, dtype=None) -> dict:
    """Run analyses over a corpus into a resumable Zarr v3 store (module doc; layout in
    ``analyze.store``).

    Args:
      model_or_ckpt: a model (``ia.load``) or a checkpoint directory / cached repo id.
      data: a corpus file (``.jsonl`` with ``"text"`` or ``"ids"`` per line, else one text
        per line) or a sequence of texts / id lists / dicts (a ``datasets.Dataset``).
      out: the store directory (created, or resumed if it holds the same run).
      analyses: any of ``"maps", "relevance", "faithfulness", "stats"``.
      method, how, variant, layers, start_layer, normalize_rows, exclude: as ``explain``
        (``exclude``: positions from each example's start).
      baseline_id, score: faithfulness options (``explain.metrics``).
      batch_size: examples per batch (rounded up to a multiple of the devices on the batch axis).
      pad_multiple: bucket lengths are multiples of it (fewer compilations, more padding).
      max_length: longer examples are bad lines.
      skip_bad_lines: skip (and record in the manifest) lines that cannot be read, instead
        of raising a ``ValueError`` naming the file and line.
      tokenizer: a ``tokenizers.Tokenizer`` for texts (default: the checkpoint's).
      devices: the devices of this process to use (default ``jax.local_devices()``).
      model_shards: split the parameters over this many devices (a ``"model"`` mesh axis;
        the batch is split over the rest): each tensor is read from the checkpoint's
        safetensors slice by slice onto its devices (``model_sharding``), so a model larger
        than one device fits. Needs a checkpoint path and a device count it divides.
      progress: show a progress bar (examples/s) on stderr.
      dtype: parameter dtype when loading a checkpoint.
    Returns:
      A summary dict: ``store``, ``rows`` (all), ``process`` / ``processes``,
      ``process_rows`` (this process's share), ``computed`` (this call), ``already_done``
      (found done), ``skipped_lines``, ``devices``, ``model_shards``, ``seconds`` (the whole
      call: reading the corpus and compiling included), ``examples_per_s`` (computed / seconds).
    """
    t0 = time.perf_counter()
    devs = list(jax.local_devices() if devices is None else devices)
    is_path = isinstance(model_or_ckpt, (str, Path))
    if model_shards != 1 and not is_path:
        raise ValueError("model_shards > 1 needs a checkpoint path: the parameters are read from its files "
                         "slice by slice onto their devices")
    if not isinstance(model_shards, (int, np.integer)) or model_shards < 1 or len(devs) % model_shards:
        raise ValueError(f"model_shards must be a positive int dividing the {len(devs)} devices, got {model_shards!r}")
    mesh = Mesh(np.array(devs).reshape(len(devs) // model_shards, model_shards), ("batch", "model"))
    if is_path:
        model = load(model_or_ckpt, dtype=dtype, sharding_of=model_sharding(mesh) if model_shards > 1 else None)
        tok = tokenizer if tokenizer is not None else load_tokenizer(model_or_ckpt)
    else:
        model = model_or_ckpt
        src = getattr(model, "source", None)
        tok = tokenizer if tokenizer is not None or src is None else load_tokenizer(src)
    s = Settings(analyses=tuple(analyses), method=method, how=how, variant=variant,
                 layers=None if layers is None else tuple(layers), start_layer=start_layer,
                 normalize_rows=normalize_rows, exclude=tuple(exclude), baseline_id=baseline_id, score=score,
                 pad_multiple=pad_multiple, batch_size=batch_size).check(model)
    corpus = Corpus(data, tok, model.config.vocab_size, max_length, text_field, ids_field).index(skip_bad_lines)
    N = len(corpus)
    if N == 0:
        raise ValueError(f"the corpus {corpus.source()} has no usable examples")
    lengths = np.asarray(corpus.lengths, np.int64)
    Lmax = int(lengths.max())
    manifest = {"format": FORMAT, "library_version": __version__, "model": model_manifest(model),
                "corpus": corpus.describe(), "settings": s.manifest(),
                "paths": {"checkpoint": getattr(model, "source", None), "corpus": corpus.source()},
                "arrays": array_table(s, N, Lmax, len(s.layers))}
    pid, nproc = jax.process_index(), jax.process_count()
    store = Store.open_or_create(out, manifest, create=pid == 0)

    n_batch = mesh.shape["batch"]
    B = -(-s.batch_size // n_batch) * n_batch
    graphdef, state = nnx.split(model)
    state = place_state(state, mesh, replicate=model_shards == 1)
    batch_sh = NamedSharding(mesh, P("batch"))

    mine = np.arange(pid, N, nproc)
    done = store.done()
    batches = [(L, r) for L, r in plan(lengths, mine, s.pad_multiple, B, Lmax) if not done[r].all()]
    already = int(done[mine].sum())
    hook = kill_hook()
    written = 0
    bar = tqdm(total=len(mine), initial=already, unit="ex", desc=f"analyze (process {pid}/{nproc})",
               file=sys.stderr, disable=not progress, dynamic_ncols=True)
    for L, rows in batches:
        ids = np.zeros((B, L), np.int32)
        lens = np.ones(B, np.int32)
        full = np.full((len(rows), Lmax), -1, np.int32)
        for k, r in enumerate(rows):
            x = corpus.ids(int(r))
            ids[k, :x.size], lens[k], full[k, :x.size] = x, x.size, x
        ids[len(rows):] = ids[0]   # filler rows (a fixed batch shape), dropped below
        lens[len(rows):] = lens[0]
        got = step(graphdef, s, state, jax.device_put(ids, batch_sh), jax.device_put(lens, batch_sh))
        res = {k: np.asarray(v)[:len(rows)] for k, v in got.items()}
        if "faithfulness" in s.analyses:
            res.update(faithfulness_rows(model, ids[:len(rows)], lens[:len(rows)], res["relevance"],
                                         res["target"], s))
            if "relevance" not in s.analyses:
                res.pop("relevance")
        res = {k: pad_to(k, v, Lmax) for k, v in res.items()}
        res.update(ids=full, length=lens[:len(rows)], line=np.asarray(corpus.lines, np.int64)[rows])
        todo = ~done[rows]
        early = hook is not None and hook[1] == "data" and written + int(todo.sum()) >= hook[0]
        store.write_rows(rows[todo], {k: v[todo] for k, v in res.items()}, mark_done=not early)
        if early:  # test hook: data written, rows not marked done
            os.kill(os.getpid(), signal.SIGKILL)
        written += int(todo.sum())
        bar.update(int(todo.sum()))
        if hook is not None and hook[1] == "done" and written >= hook[0]:
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    secs = time.perf_counter() - t0
    return {"store": str(Path(out)), "rows": N, "process": pid, "processes": nproc, "process_rows": len(mine),
            "computed": written, "already_done": already, "skipped_lines": len(corpus.bad),
            "devices": len(devs), "model_shards": model_shards, "seconds": round(secs, 3), "examples_per_s": round(written / secs, 3) if secs else None}


def pad_to(name: str, v: np.ndarray, Lmax: int) -> np.ndarray:
    """Zero-pad the position axes of a batch result to ``Lmax``: ``relevance (B, L)``,
    ``maps (B, N, L, L)``; other results are returned as they are."""
    v = np.asarray(v)
    if name == "relevance":
        return np.pad(v, ((0, 0), (0, Lmax - v.shape[1])))
    if name == "maps":
        return np.pad(v, ((0, 0), (0, 0), (0, Lmax - v.shape[2]), (0, Lmax - v.shape[3])))
    return v


__all__ = ["analyze", "Settings", "ANALYSES", "batch_results", "model_sharding", "place_state", "step", "attention_stats", "faithfulness_rows", "plan",
           "array_table", "model_manifest", "KILL_AFTER_ENV"]
