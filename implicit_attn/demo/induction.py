"""The induction-head task of Yamamoto & Matsuzaki (Mamba induction heads, §3.1), its
evaluation, and the mechanism check on a model's implicit operator.

Task (0-based positions, sequence length ``L``, ``V = 16`` symbols ``0..15``, the key
token ``KEY = 16``):

* without the key (``key=False``): ``v_0 .. v_{L-2}`` are drawn uniformly with
  replacement from the 16 symbols; the last token ``v_{L-1}`` equals one of them (drawn
  uniformly among the symbols that occur in ``v_0 .. v_{L-2}``). With ``s`` the largest
  ``s < L-1`` such that ``v_s = v_{L-1}``, the answer is ``v_{s+1}`` (``s+1`` may be
  ``L-1`` itself when the last two tokens are equal).
* with the key (``key=True``, the definition of Gu et al. / Fu et al.): the key token
  occurs exactly twice, at a uniformly drawn position ``p in [0, L-3]`` and at the last
  position ``L-1``; every other token is a symbol. The answer is ``v_{p+1}``.

The paper trains on the cross-entropy of the last position only, length 255, batch 8.
A batch is a pure function of ``(seed, stream, index)`` (``numpy`` ``SeedSequence``), so
training data is reproducible step by step and evaluation sets never overlap training.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..families.mamba import mixer_operator
from ..io import load
from ..ops import conv_right

NUM_SYMBOLS = 16
KEY = NUM_SYMBOLS           # id of the special key token
VOCAB_SIZE = NUM_SYMBOLS + 1
LENGTH = 255                # the paper's sequence length
TRAIN_STREAM, EVAL_STREAM = 0, 1
ASSET_DIR = Path(__file__).parent / "assets" / "induction"
VARIANTS = ("full", "s6_only", "no_conv", "no_gate", "no_act")


@dataclasses.dataclass(frozen=True)
class Batch:
    """``ids (B, L)`` int32; ``answer (B,)`` the correct next token; ``target_pos (B,)`` the
    position of the answer token in ``ids`` (the key the last query should read);
    ``earlier_pos (B,)`` the earlier occurrence of the last token (``target_pos - 1``)."""

    ids: np.ndarray
    answer: np.ndarray
    target_pos: np.ndarray
    earlier_pos: np.ndarray
    key: bool


def _check(batch_size: int, length: int):
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(length, (int, np.integer)) or length < 4:
        raise ValueError(f"length must be an integer >= 4, got {length!r}")


def rng_for(seed: int, stream: int, index: int) -> np.random.Generator:
    """The generator of batch ``index`` in ``stream`` (0 train, 1 eval) of ``seed``."""
    for name, v in (("seed", seed), ("stream", stream), ("index", index)):
        if not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(stream), int(index)]))


def sample(rng: np.random.Generator, batch_size: int, length: int = LENGTH, key: bool = False) -> Batch:
    """Draw ``batch_size`` task sequences of ``length`` tokens (see module doc)."""
    _check(batch_size, length)
    B, L = int(batch_size), int(length)
    rows = np.arange(B)
    if key:
        ids = rng.integers(0, NUM_SYMBOLS, (B, L))
        p = rng.integers(0, L - 2, B)                      # p in [0, L-3]: v_{p+1} is a symbol
        ids[rows, p] = KEY
        ids[:, -1] = KEY
        earlier = p
    else:
        ids = rng.integers(0, NUM_SYMBOLS, (B, L))
        ctx = ids[:, :-1]
        present = np.zeros((B, NUM_SYMBOLS), bool)
        present[rows[:, None], ctx] = True
        # uniform among the symbols present: argmax of uniform noise restricted to them
        ids[:, -1] = np.argmax(np.where(present, rng.random((B, NUM_SYMBOLS)), -1.0), axis=1)
        hit = ctx == ids[:, -1:]
        earlier = (L - 2) - np.argmax(hit[:, ::-1], axis=1)  # latest s < L-1 with v_s = v_{L-1}
    target = earlier + 1
    return Batch(ids=ids.astype(np.int32), answer=ids[rows, target].astype(np.int32),
                 target_pos=target.astype(np.int64), earlier_pos=earlier.astype(np.int64), key=key)


def batch_at(seed: int, index: int, batch_size: int, length: int = LENGTH, key: bool = False,
             stream: int = TRAIN_STREAM) -> Batch:
    """Batch number ``index`` of a stream: a pure function of its arguments."""
    return sample(rng_for(seed, stream, index), batch_size, length, key)


def eval_set(n: int, seed: int = 1234, length: int = LENGTH, key: bool = False) -> Batch:
    """``n`` fresh sequences from the evaluation stream (disjoint from training batches)."""
    return batch_at(seed, 0, n, length, key, stream=EVAL_STREAM)


def accuracy_of(logits_last, answer) -> float:
    """Fraction of rows whose argmax over the vocabulary equals the answer.
    ``logits_last (B, V)``, ``answer (B,)``."""
    lg = np.asarray(logits_last)
    a = np.asarray(answer)
    if lg.ndim != 2 or a.shape != lg.shape[:1]:
        raise ValueError(f"expected logits (B, V) and answers (B,), got {lg.shape} and {a.shape}")
    return float(np.mean(lg.argmax(axis=1) == a))


def evaluate(logits_fn, batch: Batch, batch_size: int = 128) -> float:
    """Accuracy of ``logits_fn(ids (b, L)) -> (b, L, V)`` on ``batch`` (last position)."""
    n = batch.ids.shape[0]
    out = []
    for s in range(0, n, batch_size):
        chunk = batch.ids[s:s + batch_size]
        m = chunk.shape[0]
        if m < batch_size and n > batch_size:   # keep one compiled shape
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - m, 0)])
        out.append(np.asarray(logits_fn(chunk))[:m, -1])
    return accuracy_of(np.concatenate(out), batch.answer)


# ----------------------------------------------------------------------------- mechanism

def strongest_keys(maps_last_row, exclude_diagonal: bool = True):
    """Argmax key of the last query. ``maps_last_row (B, L)`` (row ``L-1`` of a map) ->
    ``(B,)`` positions; the diagonal (position ``L-1``) is excluded if asked."""
    r = np.asarray(maps_last_row, np.float64)
    if exclude_diagonal:
        r = r.copy()
        r[:, -1] = -np.inf
    return r.argmax(axis=1)


HOWS = ("mean", "abs_mean", "pos_mean")


def state_decay_last_row(core, how: str = "abs_mean"):
    """Row ``L-1`` of ``reduce(how)`` for a Mamba ``StateDecayCore``, in ``O(C L N)``.

    The last query's row of ``H_c = (diag(l_c) K_c diag(r_c) + diag(d_c)) M_c`` with
    ``K_c[L-1, j] = sum_n q[L-1, n] k[j, n] exp(A[c, n] T_c[j])``,
    ``T_c[j] = sum_{t=j+1..L-1} dt[c, t]`` (every exponent <= 0), is formed directly
    instead of the ``(L, L)`` matrices; it equals ``core``-based ``reduce(how)[:, -1]``
    (tested). Returns ``(B, L)`` float32.
    """
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")
    f32 = jnp.float32
    q, k, A, dt = (jnp.asarray(x, f32) for x in (core.q, core.k, core.A, core.dt))
    # T[b, c, j] = sum_{t > j} dt[b, c, t]: a reverse exclusive cumulative sum.
    T = jnp.flip(jnp.cumsum(jnp.flip(dt, -1), -1), -1) - dt
    E = jnp.exp(A[None, :, None, :] * T[..., None])                     # (B, C, L, N)
    row = jnp.einsum("bn,bjn,bcjn->bcj", q[:, -1], k, E)                # (B, C, L)
    if core.left is not None:
        row = row * core.left[:, :, -1:].astype(f32)
    if core.right is not None:
        row = row * core.right.astype(f32)
    if core.diag is not None:
        row = row.at[:, :, -1].add(core.diag[:, :, -1].astype(f32))
    if core.conv_w is not None:
        row = conv_right(row[:, :, None, :], core.conv_w.astype(f32))[:, :, 0]
    if how == "abs_mean":
        row = jnp.abs(row)
    elif how == "pos_mean":
        row = jnp.maximum(row, 0.0)
    return jnp.mean(row, axis=1)


def _last_row_fn(model, layer: int, variant: str, how: str, method: str):
    """A jitted ``(params, x) -> (B, L)`` for one layer of a Mamba ``LM``."""
    cfg = model.config

    def f(p, x):
        op = mixer_operator(p, x, cfg, variant)
        if method == "reduce":
            return op.reduce(how)[:, -1]
        return state_decay_last_row(op.core, how)

    return jax.jit(f)


def last_rows(model, ids, layer: int = -1, variant: str = "full", how: str = "abs_mean",
              batch_size: int = 50, method: str = "row"):
    """Row ``L-1`` of the channel summary ``op.reduce(how)`` of one layer, every sequence: ``(B, L)``.

    ``method="reduce"`` calls the operator's ``reduce`` (all ``L x L`` entries);
    ``"row"`` (Mamba only) forms the last row alone (``state_decay_last_row``), the same
    numbers at ``1/L`` of the cost. Both run one jitted function over ``batch_size``
    sequences at a time (the last chunk is padded to keep one compiled shape)."""
    if method not in ("row", "reduce"):
        raise ValueError(f"method must be 'row' or 'reduce', got {method!r}")
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if getattr(model, "family", None) != "mamba":
        raise ValueError(f"the induction mechanism check supports Mamba models, got "
                         f"{getattr(model, 'family', type(model).__name__)!r}")
    ids = np.asarray(ids)
    n_layers = len(model.layers)
    if not -n_layers <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range for {n_layers} layers")
    layer %= n_layers
    fn = _last_row_fn(model, layer, variant, how, method)
    p = model.layers[layer].mixer.arrays()
    rows = []
    for s in range(0, ids.shape[0], batch_size):
        chunk = ids[s:s + batch_size]
        m = chunk.shape[0]
        if m < batch_size and ids.shape[0] > batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - m, 0)])
        x = model.mixer_inputs(chunk, [layer])[layer]
        rows.append(np.asarray(fn(p, x))[:m])
    return np.concatenate(rows)


def mechanism_check(model, batch: Batch, variants=VARIANTS, layer: int = -1, how: str = "abs_mean",
                    batch_size: int = 50, method: str = "row") -> dict:
    """For each variant, the fraction of sequences whose strongest off-diagonal key for the
    last query (in ``op.reduce(how)`` of ``layer``) is ``target_pos``, the position right
    after the earlier occurrence. Sequences whose target is the last position itself (no
    key: the last two tokens equal) are not counted (the diagonal is excluded).

    Returns ``{variant: {"fraction", "hits", "n", "excluded", "offset_mode",
    "offset_mode_fraction"}}``: the most common ``strongest key - target_pos`` and how often
    it occurs (where an ablation points instead)."""
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {v!r}")
    L = batch.ids.shape[1]
    ok = batch.target_pos < L - 1
    out = {}
    for v in variants:
        top = strongest_keys(last_rows(model, batch.ids, layer, v, how, batch_size, method))
        hits = int(np.sum((top == batch.target_pos) & ok))
        n = int(ok.sum())
        offs, counts = np.unique((top - batch.target_pos)[ok], return_counts=True)
        mode = int(offs[np.argmax(counts)]) if n else 0
        out[v] = {"fraction": hits / max(n, 1), "hits": hits, "n": n, "excluded": int((~ok).sum()),
                  "offset_mode": mode, "offset_mode_fraction": float(counts.max() / n) if n else 0.0}
    return out


# ----------------------------------------------------------------------------- tokenizer

def symbols() -> list[str]:
    """Token strings by id: ``s0 .. s15`` and ``[key]``."""
    return [f"s{i}" for i in range(NUM_SYMBOLS)] + ["[key]"]


def build_tokenizer():
    """A ``tokenizers`` WordLevel tokenizer over the 16 symbols and the key (whitespace split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols())}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def load_tokenizer(path=None):
    """The shipped tokenizer (``assets/induction/tokenizer.json``) or the one at ``path``."""
    from tokenizers import Tokenizer

    p = Path(path) if path is not None else ASSET_DIR / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer at {p}")
    return Tokenizer.from_file(str(p))


def decode(ids) -> list[str]:
    """Token strings of a 1-D id sequence."""
    names = symbols()
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(f"token ids must be in [0, {VOCAB_SIZE}), got range [{ids.min()}, {ids.max()}]")
    return [names[int(i)] for i in ids]


def load_default():
    """The shipped induction model (``ia.load`` of ``assets/induction``) and its metadata."""
    meta_path = ASSET_DIR / "induction.json"
    if not (ASSET_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the shipped induction model is missing from {ASSET_DIR}")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return load(ASSET_DIR), meta


__all__ = ["Batch", "sample", "batch_at", "eval_set", "rng_for", "evaluate", "accuracy_of",
           "strongest_keys", "last_rows", "mechanism_check", "build_tokenizer", "load_tokenizer",
           "decode", "load_default", "NUM_SYMBOLS", "KEY", "VOCAB_SIZE", "LENGTH", "VARIANTS"]
