"""Faithfulness of a token relevance: perturb the input in the order the relevance gives
and watch the model's output at the query position ``q``.

Notation: ``n`` candidate positions (default: every position ``<= q``; ``candidates``
narrows it), an ordering ``pi`` of them, ``k(f) = ceil(f * n)`` tokens for a fraction ``f``,
``x_b`` = the input with the chosen tokens replaced by ``baseline_id`` (removal keeps the
length and positions fixed). ``s(x)`` is the score of the target ``t`` at ``q``:
``"prob"`` softmax probability (default), ``"logit"``, or ``"top1"`` (1 if t is the argmax).
Orderings: ``order_by="value"`` sorts by relevance, ``"abs"`` by ``|relevance|``; ties keep
position order. Areas are trapezoids over the fraction grid (``np.trapezoid``); a grid must
be strictly increasing within [0, 1] (anything else raises ``ValueError``).
Packed documents (Griffin): ``segment_pos (B, L)`` is passed to every model call; removal
keeps the length, so the positions stay valid for every perturbed input.

activation (AUAC, higher better; Ali et al. 2022): start from all candidates = baseline,
    restore the k(f) most relevant:  a(f) = s(x with only top-k(f) restored),
    AUAC = trapz(a, f) over ``fractions`` (default 0, 0.1, ..., 1).
pruning (AU-MSE, lower better; Ali et al. 2022): replace the k(f) least relevant:
    m(f) = mean_v (y0[v] - y_f[v])^2 over the logits at q, AU-MSE = trapz(m, f).
positive perturbation (lower better): replace the k(f) most relevant, p+(f) = s(.),
    AUC+ = trapz(p+, f) over f = 0.1, ..., 0.9.
negative perturbation (higher better): replace the k(f) least relevant, AUC- = trapz(p-, f).
ERASER (DeYoung et al. 2020), rationale r_k = the k(f) most relevant, bins f in
    (0.01, 0.05, 0.1, 0.2, 0.5):
    comprehensiveness = mean_f [ s(x) - s(x with r_k replaced) ]   (higher better)
    sufficiency       = mean_f [ s(x) - s(x with all but r_k replaced) ]   (lower better)
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .maps import model_kwargs
from .methods import as_ids, check_query, resolve_target

SCORES = ("prob", "logit", "top1")
ORDER_BY = ("value", "abs")
AUC_GRID = tuple(np.round(np.arange(0.1, 0.91, 0.1), 2))
FULL_GRID = tuple(np.round(np.linspace(0.0, 1.0, 11), 2))
ERASER_BINS = (0.01, 0.05, 0.1, 0.2, 0.5)


@dataclasses.dataclass
class Curve:
    """A perturbation curve: ``fractions (G,)``, ``values (B, G)``, ``area (B,)``."""

    name: str
    fractions: np.ndarray
    values: np.ndarray
    area: np.ndarray

    @property
    def mean_area(self) -> float:
        return float(np.mean(self.area))


def check_fractions(fractions, name: str = "fractions") -> np.ndarray:
    """A fraction grid as float64: 1-D, non-empty, finite, within [0, 1] and strictly
    increasing (the trapezoid areas assume it). Raises ``ValueError`` naming the problem."""
    try:
        f = np.asarray(fractions, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a 1-D grid of numbers in [0, 1], got {fractions!r}") from None
    if f.ndim != 1 or f.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D grid in [0, 1], got {fractions!r}")
    if not np.all(np.isfinite(f)) or np.any(f < 0) or np.any(f > 1):
        raise ValueError(f"{name} must lie in [0, 1], got {f.tolist()}")
    if np.any(np.diff(f) <= 0):
        k = int(np.argmax(np.diff(f) <= 0))
        raise ValueError(f"{name} must be strictly increasing (the areas are trapezoids over the grid); "
                         f"{name}[{k + 1}] = {f[k + 1]} follows {f[k]}")
    return f


def token_counts(fractions, n) -> np.ndarray:
    """``k(f) = ceil(f * n)`` for each fraction and example: ``(B, G)`` ints."""
    f = check_fractions(fractions)
    return np.ceil(f[None, :] * np.asarray(n)[:, None] - 1e-9).astype(np.int64)


def ordering(relevance, candidates, order_by: str = "value", descending: bool = True) -> np.ndarray:
    """Positions sorted by relevance among the candidates: ``(B, L)``; row ``b`` lists the
    candidates first (most relevant first if ``descending``), ties in position order,
    then the non-candidates (never perturbed)."""
    if order_by not in ORDER_BY:
        raise ValueError(f"order_by must be one of {ORDER_BY}, got {order_by!r}")
    r = np.asarray(relevance, np.float64)
    r = np.abs(r) if order_by == "abs" else r
    key = -r if descending else r
    key = np.where(candidates, key, np.inf)
    return np.argsort(key, axis=1, kind="stable")


def perturbed_ids(ids, order, k, n, baseline_id: int, keep: bool) -> np.ndarray:
    """Inputs with the first ``k[b]`` ordered positions replaced (``keep=False``) or with
    every other candidate replaced (``keep=True``). ``ids (B, L)``, ``order (B, L)``,
    ``k, n (B,)`` -> ``(B, L)``."""
    ids = np.array(ids)
    out = ids.copy()
    for b in range(ids.shape[0]):
        first, rest = order[b, :k[b]], order[b, k[b]:n[b]]
        out[b, rest if keep else first] = baseline_id
    return out


class _Scorer:
    """Batched model calls at the query position. Every batch is padded to exactly
    ``batch_size`` rows so that a single input shape is compiled. ``segment_pos`` (B, L):
    row ``r`` of any batch given to ``logits`` uses positions ``segment_pos[r % B]``
    (batches are stacks of perturbed copies of the B examples)."""

    def __init__(self, model, q: int, batch_size: int, segment_pos=None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.q, self.bs, self.pos = model, q, batch_size, segment_pos

    def logits(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        pos = None
        if self.pos is not None:
            pos = np.asarray(self.pos)[np.arange(ids.shape[0]) % self.pos.shape[0]]
        out = []
        for s in range(0, ids.shape[0], self.bs):
            chunk = ids[s:s + self.bs]
            m = chunk.shape[0]
            pad = lambda a: a if m == self.bs else np.concatenate([a, np.repeat(a[-1:], self.bs - m, 0)])
            kw = {} if pos is None else {"segment_pos": pad(pos[s:s + self.bs])}
            out.append(np.asarray(self.model(pad(chunk), **kw)[:, self.q], np.float64)[:m])
        return np.concatenate(out)


def score_of(logits, target, score: str) -> np.ndarray:
    """``(N, V)`` logits, ``(N,)`` targets -> ``(N,)`` scores (float64)."""
    lg = np.asarray(logits, np.float64)
    t = np.asarray(target)
    rows = np.arange(lg.shape[0])
    if score == "logit":
        return lg[rows, t]
    if score == "prob":
        z = lg - lg.max(axis=1, keepdims=True)
        return np.exp(z[rows, t]) / np.exp(z).sum(axis=1)
    if score == "top1":
        return (lg.argmax(axis=1) == t).astype(np.float64)
    raise ValueError(f"score must be one of {SCORES}, got {score!r}")


def _setup(model, ids, relevance, query, target, candidates, segment_pos=None):
    ids = as_ids(ids)
    B, L = ids.shape
    q = check_query(query, L)
    rel = np.asarray(relevance, np.float64)
    if rel.ndim == 1:
        rel = rel[None]
    if rel.shape != (B, L):
        raise ValueError(f"relevance must have shape {(B, L)} like ids, got {rel.shape}")
    cand = np.arange(L)[None, :] <= q
    if candidates is not None:
        c = np.asarray(candidates)
        if c.dtype != bool or c.shape not in ((L,), (B, L)):
            raise ValueError(f"candidates must be a boolean mask of shape ({L},) or ({B}, {L}), "
                             f"got {c.dtype} {c.shape}")
        cand = cand & c
    cand = np.broadcast_to(cand, (B, L))
    unranked = cand & ~np.isfinite(rel)  # NaN has no rank: the order, and so the curve, would be arbitrary
    if unranked.any():
        raise ValueError(f"relevance is NaN or infinite at (example, position) {np.argwhere(unranked)[:8].tolist()} "
                         f"among the positions ranked (up to the query)")
    n = cand.sum(axis=1)
    if np.any(n == 0):
        raise ValueError("no candidate positions to perturb")
    kw = model_kwargs(model, ids, segment_pos)
    t = resolve_target(model, ids, q, target, **kw)
    return ids, rel, q, t, cand, n, kw.get("segment_pos")


def _check_baseline(model, baseline_id):
    V = model.config.vocab_size
    if not isinstance(baseline_id, (int, np.integer)) or not 0 <= baseline_id < V:
        raise ValueError(f"baseline_id {baseline_id!r} is outside the vocabulary [0, {V})")


def perturbation_curve(model, ids, relevance, fractions, *, most_relevant_first: bool, keep: bool,
                       query: int = -1, target=None, baseline_id: int = 0, order_by: str = "value",
                       score: str = "prob", candidates=None, batch_size: int = 16, name: str = "curve",
                       mse: bool = False, segment_pos=None) -> Curve:
    """The generic curve behind every metric (see module doc).

    Args:
      model: ``model(ids) -> (B, L, V)`` logits with ``config.vocab_size``.
      ids: ``(B, L)`` token ids; relevance: ``(B, L)`` (or ``(L,)`` for B = 1).
      fractions: strictly increasing grid of fractions in [0, 1].
      most_relevant_first: order the candidates most relevant first (else least first).
      keep: True keeps the first k(f) and replaces the other candidates; False replaces the first k(f).
      mse: values are the mean squared logit difference to the unperturbed input instead of the score.
      segment_pos: optional ``(B, L)`` document positions of packed inputs (Griffin only).
    Returns:
      ``Curve`` with ``values (B, G)`` and trapezoid ``area (B,)``.
    """
    _check_baseline(model, baseline_id)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    f = check_fractions(fractions)
    ids, rel, q, t, cand, n, pos = _setup(model, ids, relevance, query, target, candidates, segment_pos)
    k = token_counts(f, n)
    order = ordering(rel, cand, order_by, descending=most_relevant_first)
    B, G = k.shape
    batch = np.concatenate([perturbed_ids(ids, order, k[:, g], n, baseline_id, keep) for g in range(G)])
    sc = _Scorer(model, q, batch_size, pos)
    lg = sc.logits(batch).reshape(G, B, -1)
    if mse:
        y0 = sc.logits(ids)
        vals = np.mean((lg - y0[None]) ** 2, axis=-1).T
    else:
        vals = score_of(lg.reshape(G * B, -1), np.tile(t, G), score).reshape(G, B).T
    area = np.trapezoid(vals, f, axis=1) if G > 1 else vals[:, 0]
    return Curve(name=name, fractions=f, values=vals, area=area)


def activation(model, ids, relevance, fractions=FULL_GRID, **kw) -> Curve:
    """AUAC: restore the most relevant tokens into an all-baseline input (higher better)."""
    return perturbation_curve(model, ids, relevance, fractions, most_relevant_first=True, keep=True,
                              name="activation (AUAC)", **kw)


def pruning(model, ids, relevance, fractions=FULL_GRID, **kw) -> Curve:
    """AU-MSE: remove the least relevant tokens first, MSE of the logits at q (lower better)."""
    kw.pop("score", None)
    return perturbation_curve(model, ids, relevance, fractions, most_relevant_first=False, keep=False,
                              mse=True, name="pruning (AU-MSE)", **kw)


def positive_perturbation(model, ids, relevance, fractions=AUC_GRID, **kw) -> Curve:
    """Remove the most relevant first, AUC over 10%-90% (lower better)."""
    return perturbation_curve(model, ids, relevance, fractions, most_relevant_first=True, keep=False,
                              name="positive perturbation", **kw)


def negative_perturbation(model, ids, relevance, fractions=AUC_GRID, **kw) -> Curve:
    """Remove the least relevant first, AUC over 10%-90% (higher better)."""
    return perturbation_curve(model, ids, relevance, fractions, most_relevant_first=False, keep=False,
                              name="negative perturbation", **kw)


def _eraser(model, ids, relevance, bins, keep: bool, name: str, score="prob", **kw) -> Curve:
    kw.pop("mse", None)
    check_fractions(bins, "bins")
    full = perturbation_curve(model, ids, relevance, [0.0], most_relevant_first=True, keep=False,
                              score=score, **kw)
    cur = perturbation_curve(model, ids, relevance, bins, most_relevant_first=True, keep=keep,
                             score=score, **kw)
    diff = full.values - cur.values
    return Curve(name=name, fractions=np.asarray(bins, np.float64), values=diff, area=diff.mean(axis=1))


def comprehensiveness(model, ids, relevance, bins=ERASER_BINS, **kw) -> Curve:
    """ERASER comprehensiveness: mean over bins of ``s(x) - s(x \\ r_k)`` (higher better);
    ``area`` holds the bin average (AOPC)."""
    return _eraser(model, ids, relevance, bins, False, "comprehensiveness", **kw)


def sufficiency(model, ids, relevance, bins=ERASER_BINS, **kw) -> Curve:
    """ERASER sufficiency: mean over bins of ``s(x) - s(r_k)`` (lower better)."""
    return _eraser(model, ids, relevance, bins, True, "sufficiency", **kw)


def faithfulness(model, ids, relevance, **kw) -> dict[str, Curve]:
    """Every metric above with shared options (``query``, ``target``, ``baseline_id``,
    ``order_by``, ``score``, ``candidates``, ``segment_pos``). Returns ``{name: Curve}``."""
    if kw.get("target") is None:  # resolve once, not once per metric
        ids = as_ids(ids)
        kw["target"] = resolve_target(model, ids, check_query(kw.get("query", -1), ids.shape[1]),
                                      segment_pos=kw.get("segment_pos"))
    out = {"auac": activation(model, ids, relevance, **kw),
           "au_mse": pruning(model, ids, relevance, **kw),
           "positive_auc": positive_perturbation(model, ids, relevance, **kw),
           "negative_auc": negative_perturbation(model, ids, relevance, **kw),
           "comprehensiveness": comprehensiveness(model, ids, relevance, **kw),
           "sufficiency": sufficiency(model, ids, relevance, **kw)}
    return out


def random_relevance(shape, seed: int = 0) -> np.ndarray:
    """Uniform random relevance (a baseline ordering)."""
    return np.random.default_rng(seed).random(shape)


__all__ = ["Curve", "activation", "pruning", "positive_perturbation", "negative_perturbation",
           "comprehensiveness", "sufficiency", "faithfulness", "perturbation_curve", "ordering",
           "perturbed_ids", "token_counts", "check_fractions", "score_of", "random_relevance", "SCORES", "ORDER_BY",
           "AUC_GRID", "FULL_GRID", "ERASER_BINS"]
