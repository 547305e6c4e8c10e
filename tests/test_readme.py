"""Every Python block of the README runs as written.

The blocks are taken from README.md in order and run in one namespace, as a reader would
paste them into one session, once per registered family: ``"path/to/hf_checkpoint_dir"``
(the only placeholder) becomes a tiny random checkpoint of that family written with
``ia.save``. Blocks that build their own model (the Mamba-2 and Griffin examples) run in
every pass too, so the blocks after them use that model, as they would for a reader.
Files the blocks write go to a temporary directory. A failure names the block's line.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import implicit_attn as ia
from implicit_attn.registry import FAMILIES

README = Path(__file__).resolve().parent.parent / "README.md"
PLACEHOLDER = "path/to/hf_checkpoint_dir"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every fenced ```python block."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            j = start
            while lines[j].strip() != "```":
                j += 1
            out.append((start + 1, "\n".join(lines[start:j])))
            i = j
        i += 1
    return out


def test_the_readme_has_python_blocks_and_one_placeholder():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 10
    placeholders = set(re.findall(r'ia\.load\("([^"]+)"', README.read_text()))
    assert placeholders <= {PLACEHOLDER}, placeholders  # anything else could not run here


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_readme_blocks_run(model_type, tmp_path, monkeypatch):
    spec = FAMILIES[model_type]
    cfg = spec.config.from_hf(spec.tiny)
    ckpt = tmp_path / "ckpt"
    ia.save(spec.lm(cfg, spec.init_params(cfg, 0)), ckpt)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for line, code in python_blocks(README.read_text()):
        code = code.replace(PLACEHOLDER, str(ckpt))
        try:
            exec(compile(code, f"README.md:{line}", "exec"), ns)
        except Exception as e:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"README block at line {line} failed for {model_type}: "
                                 f"{type(e).__name__}: {e}") from e
    for name in ("layers.png", "relevance.png", "channels.png", "curves.png", "report.html"):
        assert (tmp_path / name).stat().st_size > 0, name
