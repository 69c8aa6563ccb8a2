"""The layering of DESIGN §3, checked from the source: dependencies point one way, no import cycles.

Every `import`/`from ... import` counts, at module level or inside a function, and so do imports under
`if TYPE_CHECKING:`: an annotation that needs an upward import is a seam in the wrong place.
"""

from __future__ import annotations

import ast
from pathlib import Path

import loramux

ROOT = Path(loramux.__file__).parent

# Layers, lowest first. A module may import modules of its own layer or of lower layers only.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("errors", "ggml_types", "_progress", "config")),
    ("boundaries", ("_native", "gguf_io")),
    ("sources", ("sources",)),
    ("engine", ("engine",)),
    ("features", ("convert", "merging", "inspect", "probes", "probe_refs", "drift_report", "train", "evaluate", "client")),
    ("server", ("server",)),
    ("deploy", ("ray",)),
    ("cli", ("cli", "__main__")),
]
# The package itself only re-exports, lazily (`loramux.__getattr__`).
TOP = "loramux"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    base = ROOT.parent / dotted.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """Absolute loramux module names imported anywhere in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(TOP + "."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith(TOP):
                continue
            subs = [mod + "." + a.name for a in node.names if _is_module(mod + "." + a.name)]
            out.update(subs)
            if len(subs) < len(node.names):  # names defined in `mod` itself (not only its submodules)
                out.add(mod)
    out.discard(name)
    return {m for m in out if m != TOP}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


def _layer(mod: str) -> int:
    head = mod.split(".")[1] if mod.count(".") else ""
    for i, (_, names) in enumerate(LAYERS):
        if head in names:
            return i
    raise AssertionError(f"{mod} is in no layer of DESIGN §3: add it to LAYERS")


def test_every_module_has_a_layer():
    for mod in _graph():
        if mod != TOP:
            _layer(mod)


def test_dependencies_point_down():
    upward = []
    for mod, deps in _graph().items():
        if mod == TOP:
            continue
        for dep in deps:
            if _layer(dep) > _layer(mod):
                upward.append(f"{mod} ({LAYERS[_layer(mod)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})")
    assert upward == []


def test_no_import_cycles():
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == []


def test_nothing_imports_the_cli():
    offenders = [m for m, deps in _graph().items()
                 if not m.startswith((TOP + ".cli", TOP + ".__main__")) and any(d.startswith(TOP + ".cli") for d in deps)]
    assert offenders == []


def test_native_package_is_one_boundary():
    # `_native` is a package split by concept; all of its submodules sit in the boundaries layer.
    boundaries = [name for name, _ in LAYERS].index("boundaries")
    mods = [m for m in _graph() if m == TOP + "._native" or m.startswith(TOP + "._native.")]
    assert len(mods) > 1 and {_layer(m) for m in mods} == {boundaries}


def test_only_native_touches_ctypes():
    offenders = []
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "ctypes" or n.startswith("ctypes.") or n.startswith("llama_cpp") for n in names):
                if "_native" not in p.relative_to(ROOT).parts[:1]:  # the files of the _native package
                    offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []


def _mapped_modules() -> list[str]:
    """The module paths of docs/architecture.md's "Every module" table, in the order listed."""
    text = (ROOT.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Every module", 1)[1].split("\n## ", 1)[0]
    return [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]


def test_every_module_is_on_the_map_and_nothing_else():
    """docs/architecture.md lists each module of the package once, and no module that is gone."""
    mapped = _mapped_modules()
    present = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")}
    assert len(mapped) == len(set(mapped)), "a module is listed twice in docs/architecture.md"
    missing = sorted(present - set(mapped))
    gone = sorted(set(mapped) - present)
    assert not missing, f"add these to docs/architecture.md's 'Every module' table: {missing}"
    assert not gone, f"these are listed in docs/architecture.md but no longer exist: {gone}"


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments)."""
    out: set[str] = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            out |= {e.id for t in n.targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def _imported_from(tree: ast.Module, package: str) -> dict[str, str]:
    """Each name a module's top-level `from X import name` brings in, with the absolute module X."""
    out: dict[str, str] = {}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom):
            parts = package.split(".")
            mod = ".".join(parts[: len(parts) - (n.level - 1)] + ([n.module] if n.module else [])) if n.level \
                else (n.module or "")
            out.update({a.asname or a.name: mod for a in n.names})
    return out


def test_every_module_has_all_and_each_public_name_one_home():
    """`__all__` in every module (a package's may list what it re-exports: that is its job); a plain module's
    `__all__` names only what it defines; and nothing is imported from a plain module that only passes it
    on from another loramux module: import it from its home."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in ROOT.rglob("*.py") if p.name != "__main__.py"}
    info = {}
    for p, tree in trees.items():
        name = _module_name(p)
        package = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        info[name] = (p, tree, _defined(tree), _imported_from(tree, package))
    problems = []
    for name, (p, tree, defined, _) in info.items():
        exported = next(([e.value for e in getattr(n.value, "elts", []) if isinstance(e, ast.Constant)]
                         for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                         and any(isinstance(t, ast.Name) and t.id == "__all__"
                                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))), None)
        if exported is None:
            problems.append(f"{name}: no __all__")
        elif p.name != "__init__.py":
            problems += [f"{name}.__all__ lists {x!r}, which it does not define" for x in exported if x not in defined]
    for name, (_, _, _, imports) in info.items():
        for imported, source in imports.items():
            home = info.get(source)
            if home is None or home[0].name == "__init__.py" or imported in home[2] or f"{source}.{imported}" in info:
                continue
            origin = home[3].get(imported, "")
            if origin.startswith(TOP + ".") or origin == TOP:
                problems.append(f"{name} imports {imported} from {source}: import it from {origin}")
    assert not problems, "\n".join(problems)


# LRU bookkeeping that is not about adapters: the server's cache of parsed control-vector settings.
LRU_ELSEWHERE = {"loramux.server.state": "parsed control-vector settings, not adapters"}
RESIDENCY_OWNER = "loramux.engine.residency"


def _lru_marks(path: Path) -> list[str]:
    """What hand-written recency ordering looks like: an OrderedDict, move_to_end, popitem(last=False),
    a `last_used` stamp, a function or method that evicts."""
    marks = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Name) and node.id == "OrderedDict":
            marks.append(f"line {node.lineno}: OrderedDict")
        elif isinstance(node, ast.Attribute) and node.attr in ("move_to_end", "last_used", "OrderedDict"):
            marks.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "popitem" \
                and any(k.arg == "last" for k in node.keywords):
            marks.append(f"line {node.lineno}: popitem(last=...)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "evict" in node.name.lower() and node.name != "evictions":
            marks.append(f"line {node.lineno}: def {node.name}")
    return marks


def test_one_module_owns_residency_and_its_eviction_order():
    """Residency has one owner: only engine/residency.py orders adapters by recency or evicts them
    (its LruPolicy serves the loaded tier, the warm tier and the bank's slot choice)."""
    found = {}
    for p in sorted(ROOT.rglob("*.py")):
        mod = _module_name(p)
        if mod == RESIDENCY_OWNER or mod in LRU_ELSEWHERE:
            continue
        marks = _lru_marks(p)
        if marks:
            found[mod] = marks
    assert not found, f"recency ordering / eviction outside {RESIDENCY_OWNER}: {found}; use its LruPolicy"
    owner = ROOT / "engine" / "residency.py"
    assert any("def _evict" in m for m in _lru_marks(owner)) and "class LruPolicy" in owner.read_text()
    bank = (ROOT / "engine" / "bank.py").read_text()
    assert "LruPolicy()" in bank  # the slot choice is the same policy, not a min() over timestamps
