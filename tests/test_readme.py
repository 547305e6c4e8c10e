"""Every Python block of the README runs as written, and its model-type table is the registry.

The blocks are taken from README.md in order and run in one namespace, as a reader would
paste them into one session, once per family of ``FULL_PASSES`` (the Quickstart alone for
the other registered families): ``"path/to/hf_checkpoint_dir"``
(the only placeholder) becomes a tiny random checkpoint of that family written with
``ia.save``. A block whose fence is directly preceded by the line
``<!-- readme-test: once -->`` does not use that checkpoint (it builds its own model, or
loads the shipped induction model, or builds torch models) and runs only in the first
family's pass; ``test_every_block_is_scheduled`` checks that every block runs in some pass
and that no block run in every pass reads a name last bound by a once-block (which would
make the passes differ). Files the blocks write go to a temporary directory. A failure names
the block's line.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import implicit_attn as ia
from implicit_attn.registry import FAMILIES

README = Path(__file__).resolve().parent.parent / "README.md"
PLACEHOLDER = "path/to/hf_checkpoint_dir"
ONCE = "<!-- readme-test: once -->"
TABLE_HEADING = "## Supported model types"


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the block's first code line
    code: str
    once: bool  # run only in the first family's pass


def python_blocks(text: str) -> list[Block]:
    """Every fenced ```python block, in order; ``once`` when the line before the fence is
    ``ONCE``. A ``ONCE`` line anywhere else is an error (it would silently do nothing)."""
    out, lines = [], text.splitlines()
    marked = {i + 1 for i, s in enumerate(lines) if s.strip() == ONCE}
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            j = start
            while lines[j].strip() != "```":
                j += 1
            once = i in marked
            marked.discard(i)
            out.append(Block(start + 1, "\n".join(lines[start:j]), once))
            i = j
        i += 1
    if marked:
        raise ValueError(f"{ONCE} at README line(s) {sorted(m for m in marked)} is not directly "
                         "before a ```python fence")
    return out


# Families whose pass runs every block: a plain mixer stack (Mamba) and a hybrid with
# attention layers and document positions (RecurrentGemma). The other families run the
# Quickstart; the APIs the later blocks use are run on every registered family by
# test_conformance, test_explain_families, test_hooks and test_viewers (suite time).
FULL_PASSES = ("mamba", "recurrent_gemma")


def schedule(blocks: list[Block], model_types) -> dict[str, list[Block]]:
    """The blocks each family's pass runs: every block in the first ``FULL_PASSES`` family,
    every block but the once-blocks in the other full passes, the first block that loads
    the placeholder checkpoint (the Quickstart) in the rest."""
    full = [mt for mt in FULL_PASSES if mt in model_types]
    quick = next(b for b in blocks if PLACEHOLDER in b.code)
    out = {}
    for mt in sorted(model_types):
        if mt in full:
            out[mt] = [b for b in blocks if mt == full[0] or not b.once]
        else:
            out[mt] = [quick]
    return out


def bound_names(tree: ast.AST) -> set[str]:
    """Names a block binds at module level (assignments, imports, defs; not inside functions)."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            return  # their bodies bind locals
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def loaded_names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def table_rows(text: str) -> dict[str, tuple]:
    """``{model_type: (variants, exact variants, HF class)}`` from the first table after
    ``TABLE_HEADING`` (columns: `model_type`, HF class, token mixer, operator variants,
    exact variants; names in backticks)."""
    lines = text.splitlines()
    k = next(i for i, s in enumerate(lines) if s.strip() == TABLE_HEADING)
    while not lines[k].startswith("|"):
        k += 1
    header = [c.strip() for c in lines[k].strip().strip("|").split("|")]
    assert header[0] == "`model_type`" and header[3:5] == ["operator variants", "exact variants"], header
    rows = {}
    for s in lines[k + 2:]:
        if not s.startswith("|"):
            break
        cells = [c.strip() for c in s.strip().strip("|").split("|")]
        assert len(cells) == len(header), s
        (mt,) = re.findall(r"`([^`]+)`", cells[0])
        assert mt not in rows, f"model_type {mt} has two rows"
        rows[mt] = (tuple(re.findall(r"`([^`]+)`", cells[3])), tuple(re.findall(r"`([^`]+)`", cells[4])),
                    cells[1].strip("`"))
    return rows


def table_mismatches(rows: dict, families: dict) -> list[str]:
    """What differs between the README table and ``{model_type: FamilySpec}``."""
    out = [f"no row for registered model_type {mt!r}" for mt in sorted(set(families) - set(rows))]
    out += [f"row {mt!r} is not a registered model_type" for mt in sorted(set(rows) - set(families))]
    for mt in sorted(set(rows) & set(families)):
        variants, exact, hf_class = rows[mt]
        spec = families[mt]
        if hf_class != spec.hf_class:
            out.append(f"{mt}: table HF class {hf_class} != registry {spec.hf_class}")
        if variants != tuple(spec.variants):
            out.append(f"{mt}: table variants {variants} != registry {tuple(spec.variants)}")
        if exact != tuple(spec.exact_variants):
            out.append(f"{mt}: table exact variants {exact} != registry {tuple(spec.exact_variants)}")
    return out


def test_the_readme_has_python_blocks_and_one_placeholder():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 10
    placeholders = set(re.findall(r'ia\.load\("([^"]+)"', README.read_text()))
    assert placeholders <= {PLACEHOLDER}, placeholders  # anything else could not run here
    for b in blocks:
        if b.once:  # a once-block must not need the per-family checkpoint
            assert PLACEHOLDER not in b.code, f"README block at line {b.line} is marked once but loads {PLACEHOLDER}"


def test_every_block_is_scheduled():
    blocks = python_blocks(README.read_text())
    plan = schedule(blocks, FAMILIES)
    ran = {b.line for bs in plan.values() for b in bs}
    assert ran == {b.line for b in blocks}, "some README blocks run in no pass"
    first = FULL_PASSES[0]
    assert [b.line for b in plan[first]] == [b.line for b in blocks]
    # A block run in every pass must see the same bindings in every pass: no name it reads
    # may have been bound last by a once-block.
    last_binder: dict[str, Block] = {}
    for b in blocks:
        tree = ast.parse(b.code)
        own = bound_names(tree)
        if not b.once:
            stale = sorted(n for n in loaded_names(tree) - own if n in last_binder and last_binder[n].once)
            assert not stale, (f"README block at line {b.line} runs for every family but reads {stale}, "
                               f"last bound by once-block(s) at line(s) {sorted({last_binder[n].line for n in stale})}")
        for n in own:
            last_binder[n] = b


def test_supported_model_types_table_matches_registry():
    rows = table_rows(README.read_text())
    assert not table_mismatches(rows, FAMILIES), table_mismatches(rows, FAMILIES)


def test_table_check_catches_a_new_family_and_changed_variants():
    rows = table_rows(README.read_text())
    spec = next(iter(FAMILIES.values()))
    added = {**FAMILIES, "new_family": spec}
    assert table_mismatches(rows, added) == ["no row for registered model_type 'new_family'"]
    changed = {**FAMILIES, spec.model_type: dataclasses.replace(spec, variants=spec.variants + ("extra",))}
    assert len(table_mismatches(rows, changed)) == 1
    fewer_exact = {**FAMILIES, spec.model_type: dataclasses.replace(spec, exact_variants=spec.exact_variants[:0])}
    assert len(table_mismatches(rows, fewer_exact)) == 1


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_readme_blocks_run(model_type, tmp_path, monkeypatch):
    spec = FAMILIES[model_type]
    cfg = spec.config.from_hf(spec.tiny)
    ckpt = tmp_path / "ckpt"
    ia.save(spec.lm(cfg, spec.init_params(cfg, 0)), ckpt)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for b in schedule(python_blocks(README.read_text()), FAMILIES)[model_type]:
        code = b.code.replace(PLACEHOLDER, str(ckpt))
        try:
            exec(compile(code, f"README.md:{b.line}", "exec"), ns)
        except Exception as e:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"README block at line {b.line} failed for {model_type}: "
                                 f"{type(e).__name__}: {e}") from e
    if model_type in FULL_PASSES:
        for name in ("layers.png", "relevance.png", "channels.png", "curves.png", "report.html"):
            assert (tmp_path / name).stat().st_size > 0, name
