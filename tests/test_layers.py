"""The package's import structure: no cycle between modules (function-level imports
included), imports only downward through the layers, no module reaching into another
module's ``_private`` names, every ``__all__`` name bound. Static (AST) analysis of every
source file."""
from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("implicit_attn", "weights_convert")

# Layer of each top-level part of implicit_attn: a module may import only its own layer
# or lower ones (the root __init__ re-exports everything and sits above all). ``testing``
# (property-test helpers, needs the test extras) is the top: nothing else may import it.
LAYERS = {"version": 0, "ops": 0, "operator": 1, "kernels": 2, "nn": 2, "families": 3, "models": 3, "registry": 4, "io": 5,
          "convert": 5, "compile_cache": 5, "explain": 6, "demo": 7, "analyze": 7, "cli": 8, "testing": 9}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(path)] = path
    return out


MODULES = modules()


def resolve(name: str, node: ast.ImportFrom | None, current: str, is_pkg: bool) -> str:
    """Absolute module name of an import (relative ones resolved against ``current``)."""
    if node is None or node.level == 0:
        return name
    base = current.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(mod: str) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` of every import statement in
    ``mod``, at any depth (function-level imports included)."""
    path = MODULES[mod]
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(node.module or "", node, mod, is_pkg)
            for a in node.names:
                sub = f"{target}.{a.name}"
                # `from pkg import submodule` is an import of the submodule
                out.append((sub, None, node.lineno) if sub in MODULES else (target, a.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m.split(".")[0] in PACKAGES]


def internal_target(name: str) -> str | None:
    """The innermost known module of a dotted import target."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def graph() -> dict[str, set[str]]:
    g = {}
    for mod in MODULES:
        deps = set()
        for target, _, _ in imports(mod):
            t = internal_target(target)
            if t and t != mod:
                deps.add(t)
                # importing a.b.c runs a/__init__ and a/b/__init__ too
                parts = t.split(".")
                deps.update(".".join(parts[:k]) for k in range(1, len(parts)) if ".".join(parts[:k]) in MODULES)
        g[mod] = deps - {mod}
    return g


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph ``g`` as a path ``[a, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle():
    g = graph()
    # a package's __init__ importing its own submodules is how packages work; the edge
    # back from a submodule to its package is implied, not an import statement.
    g = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in g.items()}
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check works


def layer_of(mod: str) -> int | None:
    parts = mod.split(".")
    if parts[0] != "implicit_attn" or len(parts) == 1:
        return None
    return LAYERS[parts[1]]


def test_imports_go_down_the_layers():
    bad = []
    for mod in MODULES:
        lo = layer_of(mod)
        if lo is None:
            continue
        for target, _, line in imports(mod):
            t = internal_target(target)
            lt = None if t is None else layer_of(t)
            if t == "implicit_attn":
                bad.append(f"{mod}:{line} imports the package root")
            elif lt is not None and lt > lo:
                bad.append(f"{mod}:{line} (layer {lo}) imports {t} (layer {lt})")
    assert not bad, "\n".join(bad)


def test_every_part_has_a_layer():
    parts = {m.split(".")[1] for m in MODULES if m.startswith("implicit_attn.")}
    assert parts <= set(LAYERS), sorted(parts - set(LAYERS))


def test_weights_convert_depends_only_on_the_registry_and_checkpoint_io():
    allowed = {"implicit_attn.registry", "implicit_attn.nn.checkpoint"}
    for mod in (m for m in MODULES if m.startswith("weights_convert")):
        used = {internal_target(t) for t, _, _ in imports(mod)} - {None}
        assert used <= allowed, (mod, sorted(used - allowed))


def private_uses(path: Path, own: str | None) -> list[str]:
    """``from X import _name`` and ``alias._name`` where ``X``/``alias`` is another module of
    the project (dunder names excepted)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    aliases = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = resolve(node.module or "", node, own or "", is_pkg)
            if target.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    aliases[a.asname or a.name] = sub
                elif a.name.startswith("_") and not a.name.startswith("__") and target != own:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_names_across_modules():
    files = [(p, m) for m, p in MODULES.items()]
    files += [(p, None) for d in ("tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    bad = [f for p, m in files for f in private_uses(p, m)]
    assert not bad, "\n".join(bad)


def test_the_checks_see_a_planted_violation(tmp_path):
    """The private-name check is not vacuous: it flags both forms."""
    f = tmp_path / "x.py"
    f.write_text("from implicit_attn.operator.base import _hidden\nimport implicit_attn.ops as o\no._secret\n")
    f_rel = ROOT / "tests" / "_planted_check.py"
    f_rel.write_text(f.read_text())
    try:
        found = private_uses(f_rel, None)
    finally:
        f_rel.unlink()
    assert len(found) == 2, found


def module_bindings(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (in ``if`` / ``try`` blocks too): assignments,
    functions, classes and imports."""
    names, stack = set(), list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            stack += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


def all_names(tree: ast.Module) -> list[str]:
    """The string entries of a module's ``__all__`` (adjacent literals are one string, as Python
    reads them)."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                out += [n.value for n in ast.walk(node.value)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return out


def test_every_name_in_all_is_bound():
    """``from module import *`` fails on a name ``__all__`` lists but the module does not bind (a
    missing comma joins two names into one: ``kernels.pallas`` had ``"on_acceleratorDEFAULT_TILE"``)."""
    bad = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text())
        bound = module_bindings(tree)
        bad += [f"{mod}: {name}" for name in all_names(tree) if name not in bound]
    assert not bad, "\n".join(bad)
    planted = ast.parse('def a(): pass\nB = 1\n__all__ = ["a" "B"]\n')
    assert all_names(planted) == ["aB"] and "aB" not in module_bindings(planted)
