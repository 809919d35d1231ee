"""The shape the platform promises: no branch on a sink's kind outside its own package, no
import circle in the core, the Dagster layer on the public surface, the core free of Dagster."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "platform" / "onceflow"
LAYER = [
    ROOT / "assets",
    ROOT / "resources",
    ROOT / "sensors",
    ROOT / "components",
    ROOT / "definitions.py",
]
KIND_CLASSES = {
    "DeltaSink": "sinks/delta",
    "DeltaGroup": "sinks/delta",
    "DeltaTableSink": "sinks/delta",
    "PostgresSink": "sinks/postgres",
    "PostgresGroup": "sinks/postgres",
}


def _files(*roots: Path) -> list[Path]:
    out: list[Path] = []
    for root in roots:
        out.extend([root] if root.is_file() else sorted(root.rglob("*.py")))
    return out


def _module(path: Path) -> str:
    rel = path.relative_to(CORE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def test_no_branch_on_a_sinks_kind_outside_its_package() -> None:
    found = []
    for path in _files(CORE, *LAYER):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"):
                continue
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            for name in names & set(KIND_CLASSES):
                if KIND_CLASSES[name] not in path.as_posix():
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} isinstance(…, {name})")
        for node in ast.walk(tree):
            # `sink.kind == "delta"` is a branch on the kind too.
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute):
                if node.left.attr == "kind" and "sinks/" not in path.as_posix():
                    consts = [c for c in node.comparators if isinstance(c, ast.Constant)]
                    if any(c.value in ("delta", "postgres") for c in consts):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} .kind == …")
    assert found == []


def _top_level_imports(
    tree: ast.Module, module: str, known: frozenset[str] = frozenset()
) -> set[str]:
    """Imports that run when the module is imported (not in functions or TYPE_CHECKING).

    `from pkg import mod` counts as an import of `pkg.mod` when that is a module in `known`.
    """
    out: set[str] = set()
    package = module if module.count(".") == 0 else module.rsplit(".", 1)[0]

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                continue
            if isinstance(stmt, ast.Import):
                out.update(a.name for a in stmt.names)
            elif isinstance(stmt, ast.ImportFrom):
                base = stmt.module or ""
                if stmt.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - stmt.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                subs = {f"{base}.{a.name}" for a in stmt.names}
                out.update(subs & known or {base})
            elif isinstance(stmt, (ast.If, ast.Try)):
                visit(stmt.body)
                visit(getattr(stmt, "orelse", []))

    visit(tree.body)
    return out


def _import_graph() -> dict[str, dict[str, list[str]]]:
    """Module → imported module of the core → where (`file:line`), counting every import:
    module level, in functions, under `TYPE_CHECKING`, relative ones and submodules named in
    `from pkg import mod`."""
    modules = {_module(p): p for p in _files(CORE)}
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in modules.items():
        edges: dict[str, list[str]] = {}
        for line, imported in _core_imports(ast.parse(path.read_text()), name):
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                edges.setdefault(imported, []).append(f"{path.relative_to(ROOT)}:{line}")
        graph[name] = edges
    return graph


def _circles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """One circle through each strongly connected part of `graph` (Tarjan), each as the
    `file:line` of the imports that close it. A package's `__init__` importing its own
    submodules counts too: importing the package runs them, so a circle through it is real."""

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                parts.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    circles = []
    for part in parts:
        # The shortest way back from the part's first module to itself, inside the part.
        start, inside = part[0], set(part)
        trail = {start: [start]}
        queue = [start]
        found: list[str] = []
        while queue and not found:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w not in inside:
                    continue
                if w == start:
                    found = [*trail[v], start]
                    break
                if w not in trail:
                    trail[w] = [*trail[v], w]
                    queue.append(w)
        circles.append([f"{a} -> {b} ({graph[a][b][0]})" for a, b in itertools.pairwise(found)])
    return circles


def test_the_circle_check_counts_every_import() -> None:
    """Imports in functions and under TYPE_CHECKING close a circle as much as any other."""
    a = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from onceflow.lineage import x\n"
    b = "def f():\n    from onceflow import ledger\n"
    graph = {
        name: {m: [f"{name}:{line}"] for line, m in _core_imports(ast.parse(text), name)}
        for name, text in (("onceflow.ledger", a), ("onceflow.lineage", b))
    }
    assert _circles(graph) == [
        [
            "onceflow.ledger -> onceflow.lineage (onceflow.ledger:3)",
            "onceflow.lineage -> onceflow.ledger (onceflow.lineage:2)",
        ]
    ]


def test_no_import_circle_counting_every_import() -> None:
    """No circle among the core's modules, whatever kind of import closes it: move the shared
    types down (e.g. `onceflow/sinks/contract.py`) rather than hide an import."""
    graph = _import_graph()
    # The graph is real: an import inside a function is in it.
    assert "onceflow.spark" in graph["onceflow.quality.validate"]
    assert {"onceflow.window.context", "onceflow.runs.run"} <= set(graph["onceflow.engine"])
    circles = _circles(graph)
    assert circles == [], "import circles:\n" + "\n".join(" | ".join(c) for c in circles)


# Where a sink kind's name may stand outside its own package: the package's public face, the
# reference jobs (user code) and the one registry that opens each kind's groups.
KIND_PACKAGES = ("delta", "postgres")
KIND_NAME_ALLOWED = ("__init__.py", "jobs/", "sinks/registry.py")


def _kind_names() -> dict[str, str]:
    """Every class a kind defines and every name its package exports → the kind's package."""
    names: dict[str, str] = {}
    for kind in KIND_PACKAGES:
        package = CORE / "sinks" / kind
        for path in _files(package):
            tree = ast.parse(path.read_text())
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    names[node.name] = f"sinks/{kind}"
        for node in ast.parse((package / "__init__.py").read_text()).body:
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
                names.update({n.value: f"sinks/{kind}" for n in node.value.elts})  # type: ignore[attr-defined]
    return names


def _kind_leaks(tree: ast.AST, module: str, where: str, names: dict[str, str]) -> list[str]:
    kinds = tuple(f"onceflow.sinks.{k}" for k in KIND_PACKAGES)
    found = [
        f"{where}:{line} imports {m}"
        for line, m in _core_imports(tree, module)
        if m in kinds or m.startswith(tuple(f"{k}." for k in kinds))
    ]
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if isinstance(node, ast.alias):
            name = node.asname or node.name
        if name in names:
            found.append(f"{where}:{node.lineno if hasattr(node, 'lineno') else '?'} names {name}")
    return list(dict.fromkeys(found))


def test_the_kind_check_flags_a_kind_outside_its_package() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from onceflow.sinks import delta\n"
        "if TYPE_CHECKING:\n"
        "    from onceflow.sinks.postgres.commit import Transaction\n"
        "def f(sink):\n"
        "    return isinstance(sink, sinks.PostgresSink)\n"
    )
    found = _kind_leaks(ast.parse(source), "onceflow.x", "x.py", _kind_names())
    assert found == [
        "x.py:2 imports onceflow.sinks.delta",
        "x.py:4 imports onceflow.sinks.postgres.commit",
        "x.py:4 names Transaction",
        "x.py:6 names PostgresSink",
    ]


def test_no_sink_kind_named_outside_its_package() -> None:
    """Outside `sinks/<kind>/` no module imports a kind's package or names its classes (but
    `onceflow/__init__.py`'s public names, the reference jobs and the sink registry)."""
    names = _kind_names()
    assert {"DeltaSink", "PostgresSink", "DeltaTableSink", "PostgresGroup"} <= set(names)
    found: list[str] = []
    for path in _files(CORE):
        rel = path.relative_to(CORE).as_posix()
        if rel.startswith(tuple(f"sinks/{k}/" for k in KIND_PACKAGES)):
            continue
        if rel == "__init__.py" or rel.startswith("jobs/") or rel == "sinks/registry.py":
            continue
        tree = ast.parse(path.read_text())
        found += _kind_leaks(tree, _module(path), str(path.relative_to(ROOT)), names)
    assert found == [], "sink kinds named outside their package:\n" + "\n".join(found)


def test_the_core_knows_nothing_of_dagster() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in _files(CORE)
        if any(
            m == "dagster" or m.startswith(("dagster.", "dagster_"))
            for m in _top_level_imports(ast.parse(p.read_text()), _module(p))
            | {
                n.names[0].name
                for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.Import)
            }
        )
    ]
    assert offenders == []


def test_the_dagster_layer_uses_no_private_core_module() -> None:
    private = []
    for path in _files(*LAYER):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onceflow"):
                if any(part.startswith("_") for part in (node.module or "").split(".")):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}")
                private += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert private == []


def test_one_compute_path() -> None:
    """Run, restatement and reconcile compute through `onceflow._compute.compute` only."""
    users = sorted(
        str(p.relative_to(CORE))
        for p in _files(CORE)
        if re.search(r"\bcompute\(", p.read_text()) and p.name != "_compute.py"
    )
    assert users == ["reconcile/_run.py", "window/compute.py"]
    # A restatement is applied by the engine, on the window's staged outputs.
    assert "engine.restate(" in (CORE / "restate.py").read_text()
    assert "outputs(" in (CORE / "runs" / "restate.py").read_text()


def test_the_dagster_layer_imports_only_dagsters_public_api() -> None:
    """No `dagster._core` (or any other private Dagster module), even for type checking:
    those move between Dagster releases without notice."""
    private = []
    for path in _files(*LAYER):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            private += [
                f"{path.relative_to(ROOT)}:{node.lineno} {name}"
                for name in names
                if name.split(".")[0].startswith("dagster")
                and any(part.startswith("_") for part in name.split(".")[1:])
            ]
    assert private == []


def test_the_engine_is_a_facade_over_one_module_per_stage() -> None:
    """A window's stages each a module of their own; the engine a facade; the modules of the
    window's way and of the ledger small."""
    stages = ["plan", "compute", "prepare", "commit", "complete"]
    assert all((CORE / "window" / f"{stage}.py").is_file() for stage in stages)
    assert len((CORE / "engine.py").read_text().splitlines()) < 300
    big = {
        str(p.relative_to(CORE)): n
        for p in _files(CORE / "window", CORE / "runs", CORE / "ledger.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert big == {}


# What the CLI and the Dagster layer may import of the core: the package's public face and the
# operations. Not even `onceflow.jobs` (the reference jobs): the layer finds jobs through
# `onceflow.load_jobs`, as any orchestrator would.
PRESENTER_IMPORTS = frozenset({"onceflow", "onceflow.ops"})
PRESENTERS = [CORE / "cli", *LAYER]


def _core_imports(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """Every import of the core in `tree`, wherever it stands (module level, in a function,
    under `if TYPE_CHECKING:`), as (line, module); `from onceflow import x` counts as
    `onceflow.x` when `x` is a module of the core."""
    package = module.rsplit(".", 1)[0] if "." in module else module
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (CORE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    CORE.parent / sub.replace(".", "/") / "__init__.py"
                ).exists()
                found.append((node.lineno, sub if is_module else base))
    core = [(line, m) for line, m in found if m == "onceflow" or m.startswith("onceflow.")]
    return list(dict.fromkeys(core))


def _beyond_the_boundary(tree: ast.AST, module: str, where: str) -> list[str]:
    # The CLI's modules also import each other.
    own = "onceflow.cli" if module.split(".")[:2] == ["onceflow", "cli"] else None
    return [
        f"{where}:{line} imports {name}"
        for line, name in _core_imports(tree, module)
        if name not in PRESENTER_IMPORTS and not (own and name.split(".")[:2] == own.split("."))
    ]


def test_the_boundary_check_counts_every_import() -> None:
    """The check below sees imports in functions, under TYPE_CHECKING, relative ones and
    submodules named in `from onceflow import …`, not only the module's top level."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from onceflow import Job, ops, windows\n"
        "if TYPE_CHECKING:\n"
        "    from onceflow.engine import Engine\n"
        "def f():\n"
        "    import onceflow.status\n"
        "    from .lineage import lineage\n"
        "    from onceflow.ops import format_windows\n"
    )
    found = _beyond_the_boundary(ast.parse(source), "onceflow.cli", "x.py")
    assert found == [
        "x.py:2 imports onceflow.windows",
        "x.py:4 imports onceflow.engine",
        "x.py:6 imports onceflow.status",
        "x.py:7 imports onceflow.lineage",
    ]


def test_the_cli_and_the_dagster_layer_import_only_onceflow_and_ops() -> None:
    """The CLI (onceflow/cli/), assets/, resources/, sensors/, components/ and definitions.py
    reach the core through `onceflow` and `onceflow.ops` only, so a second orchestrator needs
    nothing else."""
    found: list[str] = []
    seen = 0
    for path in _files(*PRESENTERS):
        module = _module(path) if path.is_relative_to(CORE) else path.stem
        tree = ast.parse(path.read_text())
        seen += len(_core_imports(tree, module))
        found += _beyond_the_boundary(tree, module, str(path.relative_to(ROOT)))
    assert seen > 20  # the walk found the layer's imports
    assert found == [], "import the name from `onceflow` or `onceflow.ops` instead: " + str(found)
