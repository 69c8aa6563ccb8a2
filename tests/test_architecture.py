"""The layering of DESIGN §3, checked from the source: dependencies point one way, no import cycles.

Every `import`/`from ... import` counts, at module level or inside a function, and so do imports under
`if TYPE_CHECKING:`: an annotation that needs an upward import is a seam in the wrong place.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
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


# -- typed records where data crosses modules ---------------------------------------------------------------

def _stats_records() -> list[type]:
    from loramux.engine.stats import DecodeGaps, EngineStats, SchedulerSnapshot, SlotWaits
    from loramux.server.metrics import ServerSnapshot
    return [EngineStats, SlotWaits, DecodeGaps, SchedulerSnapshot, ServerSnapshot]


def test_stats_and_snapshots_are_frozen_records():
    """What the engine and the server count crosses into metrics as frozen dataclasses, and every producer
    says so in its return type: none hands out a string-keyed dict that a reader would `.get(...)` from."""
    from loramux.engine.runtime import Engine
    from loramux.engine.scheduler import Scheduler
    from loramux.engine.stats import EngineStats, SchedulerSnapshot, SlotWaits
    from loramux.server.metrics import ServerSnapshot
    from loramux.server.state import ServerState
    for rec in _stats_records():
        assert dataclasses.is_dataclass(rec) and rec.__dataclass_params__.frozen, rec  # type: ignore[attr-defined]
    # the engine thread's running counts copy into EngineStats field by field: a field only on the record
    # would stay 0 for ever, one only on the counts fails the copy
    from loramux.engine.stats import Counters
    assert [f.name for f in dataclasses.fields(Counters)] == [f.name for f in dataclasses.fields(EngineStats)]
    producers = {Engine.stats: EngineStats, Scheduler.snapshot: SchedulerSnapshot,
                 Scheduler.slot_wait_quantiles: SlotWaits, ServerState.snapshot: ServerSnapshot}
    for fn, rec in producers.items():
        assert typing.get_type_hints(fn)["return"] is rec, fn.__qualname__
    dicts = []  # any other `stats`/`snapshot` of the engine or the server that returns a dict
    for p in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "server").rglob("*.py")]:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name in ("stats", "snapshot") and node.returns is not None \
                    and "dict" in ast.unparse(node.returns).lower():
                dicts.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert dicts == []


def test_metrics_read_stats_by_attribute_only():
    """server/metrics.py reads no figure by string key (`s["x"]`, `s.get("x", 0)`, `getattr(s, "x", 0)`): a
    renamed field would read as a KeyError at best and as 0 at worst. (Prometheus' own sample labels are
    read by a variable key, `labels.get(name)`, which is allowed: they are not figures.)"""
    tree = ast.parse((ROOT / "server" / "metrics.py").read_text(encoding="utf-8"))
    keyed = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            keyed.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant):
            keyed.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            keyed.append(f"{node.lineno}: {ast.unparse(node)}")  # getattr(s, "x", 0): the same silent 0
        if isinstance(node, (ast.arg, ast.AnnAssign, ast.FunctionDef)):
            ann = node.annotation if not isinstance(node, ast.FunctionDef) else node.returns
            if ann is not None and "dict[str, Any]" in ast.unparse(ann):
                keyed.append(f"{node.lineno}: annotated {ast.unparse(ann)}")
    assert keyed == []


def _record_attribute_reads(path: Path, records: dict[str, type]) -> list[tuple[int, str, type, str]]:
    """Every `x.a.b` in the file whose root `x` is a parameter or local annotated with a record type (or
    assigned from such a chain), as (line, chain, the class the last name is read on, that name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []

    def chain(node: ast.expr) -> list[str] | None:
        names = []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None

    def resolve(env: dict[str, type], names: list[str]) -> tuple[type, str, object] | None:
        """The record the chain's last name is read on, that name, and the type it is declared with."""
        owner, cls = None, env.get(names[0])
        for name in names[1:]:
            if cls is None or not dataclasses.is_dataclass(cls):  # past the records (a Mapping's .items)
                return None
            owner, cls = cls, typing.get_type_hints(cls).get(name)
        return (owner, names[-1], cls) if owner is not None else None

    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        env = {a.arg: records[ast.unparse(a.annotation)] for a in fn.args.args
               if a.annotation is not None and ast.unparse(a.annotation) in records}
        for st in sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign))), key=lambda n: n.lineno):
            target = st.targets[0] if isinstance(st, ast.Assign) else st.target
            if not isinstance(target, ast.Name):
                continue
            if isinstance(st, ast.AnnAssign) and ast.unparse(st.annotation) in records:
                env[target.id] = records[ast.unparse(st.annotation)]
            elif st.value is not None and (c := chain(st.value)) and (r := resolve(env, c)) \
                    and isinstance(r[2], type):
                env[target.id] = r[2]
        for node in ast.walk(fn):
            c = chain(node) if isinstance(node, ast.Attribute) else None
            if c and c[0] in env and (r := resolve(env, c)):
                out.append((node.lineno, ".".join(c), r[0], r[1]))
    return out


def test_every_metric_reads_a_field_that_exists_on_its_record():
    """By introspection: each attribute metrics.py reads on a stats record is a field (or property) of that
    record, so renaming a field without its reader fails here, before any scrape would read 0."""
    from loramux.server.metrics import PhaseSeconds
    records = {rec.__name__: rec for rec in [*_stats_records(), PhaseSeconds]}
    reads = _record_attribute_reads(ROOT / "server" / "metrics.py", records)
    missing = [f"metrics.py:{line} {c} ({cls.__name__} has no {name!r})" for line, c, cls, name in reads
               if name not in {f.name for f in dataclasses.fields(cls)}
               and not isinstance(getattr(cls, name, None), property)]
    assert missing == []
    # the reads seen are the metrics' own (the walk found them): every record's figures are read somewhere
    seen = {(cls, name) for _, _, cls, name in reads}
    assert {cls for cls, _ in seen} == set(records.values()), seen
    assert len(seen) >= 25, sorted(f"{c.__name__}.{n}" for c, n in seen)


def test_every_exported_figure_comes_from_its_field():
    """Render /metrics' text from a snapshot in which every figure is a distinct number: each family shows
    the number of its own field (a family that read a renamed or wrong field would show another, or fail)."""
    from loramux.engine.stats import DecodeGaps, EngineStats, SchedulerSnapshot, SlotWaits
    from loramux.server.metrics import Metrics, ServerSnapshot
    counters = EngineStats(**{f.name: 100 + i for i, f in enumerate(dataclasses.fields(EngineStats))})
    counters = dataclasses.replace(counters, prompt_tokens=1000)  # more than the reused ones
    eng = SchedulerSnapshot(waiting=3, running=5, kv_used=64, kv_total=256, running_adapters={"a": 2},
                            waiting_adapters={"b": 1}, slot_waits=SlotWaits(0.25, 0.75, 2.0, 14), counters=counters,
                            kv_guarded_decodes=7, decode_gaps=DecodeGaps(0.001, 0.0125, 0.5, 40))
    snap = ServerSnapshot(engine=eng, resident=("a", "c"), known=9, waiting_not_resident=("b",), max_lora=4,
                          evictions=11, loads={"ok": 12, "error": 13}, in_flight=6)
    m = Metrics(lambda: snap)
    m.add_phase_times(2.0, 4.0)
    text = m.render().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    want = {
        "vllm:num_requests_waiting": 3, "vllm:num_requests_running": 5, "vllm:kv_cache_usage_perc": 0.25,
        "vllm:gpu_cache_usage_perc": 0.25, "loramux_kv_cache_usage_ratio": 0.25, "loramux_resident_adapters": 2,
        "loramux_known_adapters": 9, "loramux_requests_in_flight": 6, "loramux_slot_wait_p50_seconds": 0.25,
        "loramux_slot_wait_p99_seconds": 0.75, "loramux_slot_wait_max_steps": 14,
        "loramux_bank_decodes_total": counters.bank_decodes, 'loramux_adapter_requests_running{adapter="a"}': 2,
        "loramux_decode_gap_max_seconds": 0.5, "loramux_decode_gap_p99_seconds": 0.0125,
        'loramux_adapter_requests_waiting{adapter="b"}': 1,
        "loramux_adapter_switches_total": counters.adapter_switches, "loramux_decode_steps_total": counters.decode_steps,
        "loramux_adapter_evictions_total": 11, "loramux_kv_guarded_decodes_total": 7,
        "loramux_kv_guard_failures_total": counters.kv_guard_failures, "loramux_kv_clears_total": counters.kv_clears,
        "llamacpp:prompt_tokens_total": counters.prompt_tokens - counters.prompt_tokens_reused,
        "llamacpp:prompt_tokens_cached_total": counters.prompt_tokens_reused,
        "llamacpp:tokens_predicted_total": counters.generated_tokens, "llamacpp:n_decode_total": counters.decode_steps,
        "llamacpp:prompt_seconds_total": 2.0, "llamacpp:tokens_predicted_seconds_total": 4.0,
        "llamacpp:predicted_tokens_seconds": counters.generated_tokens / 4.0, "llamacpp:requests_processing": 5,
        "llamacpp:requests_deferred": 3, "llamacpp:kv_cache_usage_ratio": 0.25,
        'loramux_adapter_loads_total{result="ok"}': 12, 'loramux_adapter_loads_total{result="error"}': 13,
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,c",waiting_lora_adapters="b"}': None,
    }
    got = {k: values.get(k) for k in want}
    assert {k: v for k, v in got.items() if want[k] is not None} == {k: v for k, v in want.items() if v is not None}
    assert got[next(k for k, v in want.items() if v is None)] is not None  # the info series is there


def test_request_input_is_frozen_and_apart_from_its_state():
    """`Request` is split: what it was submitted with is a frozen `RequestInput`, which no state field of
    `Request` repeats; the batch hand-off to the bank and the guard is a named `BatchEntry`, not a bare
    tuple spelled out in signatures."""
    from loramux.engine.phases import BatchEntry
    from loramux.engine.request import Request, RequestInput
    assert RequestInput.__dataclass_params__.frozen  # type: ignore[attr-defined]
    inputs, state = {f.name for f in dataclasses.fields(RequestInput)}, {f.name for f in dataclasses.fields(Request)}
    assert {"prompt", "params", "phases", "share"} <= inputs and not inputs & state, inputs & state
    assert BatchEntry._fields == ("n_tokens", "slot_scales")
    bare = [f"{p.name}: {t}" for p in (ROOT / "engine" / "scheduler.py", ROOT / "engine" / "bank.py")
            for t in ("tuple[int, list[tuple[int, float]]]", "tuple[int, Sequence[tuple[int, float]]]")
            if t in p.read_text(encoding="utf-8")]
    assert bare == []


def _declared_error_attributes() -> dict[str, set[str]]:
    """Each error class of errors.py, with the instance attributes its own or its bases' methods set."""
    import loramux.errors as errors
    tree = ast.parse(Path(errors.__file__).read_text(encoding="utf-8"))
    own = {c.name: {t.attr for n in ast.walk(c) if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
           for c in tree.body if isinstance(c, ast.ClassDef)}
    return {name: set().union(*(own.get(k.__name__, set()) for k in getattr(errors, name).__mro__))
            for name in own}


def test_error_fields_are_declared_not_attached():
    """An error's structured fields are its constructor's: no module sets an attribute on an error of
    errors.py (bound by `x = SomeError(...)` or `except SomeError as x`) that the class does not declare."""
    declared = _declared_error_attributes()
    attached = []
    for p in ROOT.rglob("*.py"):
        for fn in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            bound: dict[str, str] = {}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) \
                        and n.value.func.id in declared:
                    bound.update({t.id: n.value.func.id for t in n.targets if isinstance(t, ast.Name)})
                elif isinstance(n, ast.ExceptHandler) and n.name and isinstance(n.type, ast.Name) and n.type.id in declared:
                    bound[n.name] = n.type.id
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else []
                for t in [e for g in targets for e in (g.elts if isinstance(g, ast.Tuple) else [g])]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in bound \
                            and t.attr not in declared[bound[t.value.id]]:
                        attached.append(f"{p.relative_to(ROOT)}:{t.lineno} {bound[t.value.id]}.{t.attr}")
    assert attached == []
    assert {"field", "fields"} <= declared["AdapterError"] and "field" in declared["GGUFFormatError"]


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
