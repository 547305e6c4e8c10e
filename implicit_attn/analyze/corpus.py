"""A corpus for batch analysis: token ids of example ``i`` on demand, without holding the
corpus in memory.

Sources:
  * a ``.jsonl`` file: one JSON object per line with ``"text"`` (tokenized with the
    checkpoint's tokenizer) or ``"ids"`` (a list of token ids);
  * any other file: one text per line (tokenized);
  * a Python sequence (``len`` and ``[i]``; a Hugging Face ``datasets.Dataset`` is one) of
    strings, id lists, or dicts with ``"text"`` / ``"ids"`` (the field names are options).

``Corpus.index`` reads the source once: it parses and tokenizes every line, records the byte
offset and token count of the good ones and the line number and reason of the bad ones, and
hashes the token ids and bad-line numbers (``fingerprint``). ``Corpus.ids(row)`` reads one example again (a seek for
files), so memory is a few integers per example, not the tokens.
"""
from __future__ import annotations

import array
import hashlib
import json
from pathlib import Path

import numpy as np


class BadLine(ValueError):
    """A corpus line that cannot be used; ``where`` is ``"FILE:LINE"`` or ``"item I"``."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


class Corpus:
    """Examples of a file or a sequence (see module doc).

    Args:
      source: a path (``str`` / ``Path``) or a sequence.
      tokenizer: a ``tokenizers.Tokenizer`` (None: texts raise a ``BadLine``).
      vocab_size: ids must lie in ``[0, vocab_size)``.
      max_length: longer examples are bad lines (None: no limit).
      text_field, ids_field: the dict keys of texts and ids.
    """

    def __init__(self, source, tokenizer=None, vocab_size: int | None = None, max_length: int | None = None,
                 text_field: str = "text", ids_field: str = "ids"):
        if max_length is not None and (not isinstance(max_length, (int, np.integer)) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        self.is_file = isinstance(source, (str, Path))
        if self.is_file:
            self.path = Path(source)
            if not self.path.is_file():
                raise FileNotFoundError(f"corpus file {self.path} does not exist")
            self.jsonl = self.path.suffix == ".jsonl"
        else:
            if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")) or isinstance(source, (bytes, dict)):
                raise ValueError(f"data must be a file path or a sequence of examples (len and [i]), "
                                 f"got {type(source).__name__}")
            self.seq, self.jsonl = source, False
        self.tokenizer, self.vocab_size, self.max_length = tokenizer, vocab_size, max_length
        self.text_field, self.ids_field = text_field, ids_field
        self.offsets = array.array("q")   # byte offset (files) or item index (sequences) of each row
        self.lengths = array.array("q")
        self.lines = array.array("q")     # 1-based line number (files) or item index of each row
        self.bad: list[dict] = []
        self.fingerprint = ""

    # ------------------------------------------------------------------ parsing
    def where(self, line: int) -> str:
        return f"{self.path}:{line}" if self.is_file else f"item {line}"

    def parse(self, item, line: int) -> np.ndarray:
        """Token ids of one raw item (a file line as ``str`` or a sequence element); raises
        ``BadLine`` naming the line and the reason."""
        if self.is_file and not item.strip():
            raise BadLine(self.where(line), "blank line")
        if self.is_file and self.jsonl:
            try:
                item = json.loads(item)
            except json.JSONDecodeError as e:
                raise BadLine(self.where(line), f"not valid JSON ({e.msg} at column {e.colno})") from None
        if isinstance(item, dict):
            has_t, has_i = self.text_field in item, self.ids_field in item
            if has_t == has_i:
                raise BadLine(self.where(line), f"needs exactly one of {self.text_field!r} (text) or "
                                                f"{self.ids_field!r} (token ids), has keys {sorted(item)[:8]}")
            item = item[self.text_field] if has_t else item[self.ids_field]
            if has_t and not isinstance(item, str):
                raise BadLine(self.where(line), f"{self.text_field!r} must be a string, got {type(item).__name__}")
        elif self.is_file and self.jsonl:
            raise BadLine(self.where(line), f"a JSON object is needed, got {type(item).__name__}")
        ids = self.id_list(self.tokenize(item, line) if isinstance(item, str) else item, line)
        if ids.size == 0:
            raise BadLine(self.where(line), "empty example (no tokens)")
        if self.max_length is not None and ids.size > self.max_length:
            raise BadLine(self.where(line), f"{ids.size} tokens, longer than max_length {self.max_length}")
        return ids

    def tokenize(self, text: str, line: int) -> np.ndarray:
        if self.tokenizer is None:
            raise BadLine(self.where(line), "text needs a tokenizer and the checkpoint has no tokenizer.json "
                                            "(give token ids, or tokenizer=)")
        return np.asarray(self.tokenizer.encode(text).ids, np.int64)

    def id_list(self, item, line: int) -> np.ndarray:
        try:
            ids = np.asarray(item)
        except (TypeError, ValueError):  # ragged nesting
            ids = np.asarray(None)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise BadLine(self.where(line), f"token ids must be a flat list of ints, got {str(item)[:60]}")
        ids = ids.astype(np.int64)
        if ids.size and self.vocab_size is not None and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise BadLine(self.where(line), f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    # ------------------------------------------------------------------ reading
    def raw_items(self):
        """``(offset, line, item)`` of every example of the source, in order (files: lines
        without their newline, decoded as UTF-8)."""
        if not self.is_file:
            for i in range(len(self.seq)):
                yield i, i, self.seq[i]
            return
        with open(self.path, "rb") as f:
            line, off = 0, 0
            for raw in f:
                line += 1
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield off, line, BadLine(self.where(line), f"not UTF-8 ({e.reason} at byte {e.start})")
                else:
                    yield off, line, text.rstrip("\r\n")
                off += len(raw)

    def index(self, skip_bad_lines: bool = False) -> "Corpus":
        """Read the source once (see module doc). A bad line raises its ``BadLine`` unless
        ``skip_bad_lines``, which records ``{"line", "error"}`` in ``bad`` instead."""
        h = hashlib.sha256()
        for off, line, item in self.raw_items():
            try:
                if isinstance(item, BadLine):
                    raise item
                ids = self.parse(item, line)
            except BadLine as e:
                if not skip_bad_lines:
                    raise
                self.bad.append({"line": line, "error": e.why})
                h.update(f"bad {line}\n".encode())
                continue
            h.update(ids.astype("<i8").tobytes() + b"\n")
            self.offsets.append(off)
            self.lengths.append(int(ids.size))
            self.lines.append(line)
        self.fingerprint = h.hexdigest()
        return self

    def __len__(self) -> int:
        return len(self.lengths)

    def ids(self, row: int) -> np.ndarray:
        """Token ids of row ``row`` (good examples numbered from 0)."""
        line = self.lines[row]
        if not self.is_file:
            return self.parse(self.seq[self.offsets[row]], line)
        with open(self.path, "rb") as f:
            f.seek(self.offsets[row])
            text = f.readline().decode("utf-8").rstrip("\r\n")
        return self.parse(text, line)

    def source(self) -> str:
        """The file's absolute path, or ``<type>`` of a sequence."""
        return str(self.path.resolve()) if self.is_file else f"<{type(self.seq).__name__}>"

    def describe(self) -> dict:
        """The corpus part of a store's manifest (what a resumed run must match: the path
        is not part of it, a moved file resumes)."""
        return {"sha256": self.fingerprint, "rows": len(self), "max_length": int(max(self.lengths, default=0)),
                "skipped": list(self.bad)}


__all__ = ["Corpus", "BadLine"]
