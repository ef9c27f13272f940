"""The package layout keeps its dependency rules (read from the source with `ast`, nothing is
imported): app -> actors -> kernels; inside app, protocol <- api <- config <- serving <- cli;
inside actors, folders by role that import only downwards (host -> engine -> executor ->
worker -> models -> distributed, core beside them, the shared types at the bottom), with Ray
in executor and host alone; no import cycle between modules (function-level imports
included), and the demo-model training code (app.demo, not installed) imported by nothing
else."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What each part of app/ may import from the others (app.demo: anything; nothing imports it).
ALLOWED = {
    "app.protocol": set(),
    "app.api": {"app.protocol"},
    "app.config": {"app.api"},  # ServerSettings, the HTTP-side options
    "app.serving": {"app.protocol", "app.api", "app.config"},
    "app.cli": {"app.protocol", "app.api", "app.config", "app.serving"},
}


# What each part of actors/ may import from the others. "actors" is the top-level modules that
# every part shares: the config, the request and output types, errors, logging.
ACTORS_ALLOWED = {
    "actors": set(),
    "actors.core": {"actors"},
    "actors.distributed": {"actors"},
    "actors.models": {"actors", "actors.distributed"},
    "actors.worker": {"actors", "actors.core", "actors.distributed", "actors.models"},
    "actors.executor": {"actors", "actors.core", "actors.distributed", "actors.worker"},
    "actors.engine": {"actors", "actors.core", "actors.executor", "actors.worker", "actors.models"},
    "actors.host": {"actors", "actors.core", "actors.engine", "actors.executor"},
}
SHARED = {"config", "errors", "logs", "outputs", "pooling_params", "request", "sampling_params"}
RAY_PARTS = {"actors.executor", "actors.host"}


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def app_graph(root: str = "app") -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (ROOT / root).rglob("*.py")}

    def owner(name: str) -> str | None:  # app.cli.main.build_parser -> app.cli.main
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {o for n in imports(p) if (o := owner(n)) and o != m} for m, p in modules.items()}


def part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def actors_part(module: str) -> str:
    """actors.core.scheduler -> actors.core; the shared top-level modules -> actors."""
    parts = module.split(".")
    return "actors" if len(parts) <= 2 and (len(parts) == 1 or parts[1] in SHARED) else ".".join(parts[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_app():
    assert cycles(app_graph()) == []


def test_app_parts_import_one_way():
    wrong = [f"{m} imports {d}" for m, deps in app_graph().items() for d in deps
             if part(m) in ALLOWED and part(d) != part(m) and part(d) not in ALLOWED[part(m)]]
    assert wrong == []


def test_nothing_served_imports_the_demo_training_code():
    wrong = [m for m, deps in app_graph().items()
             if part(m) != "app.demo" and any(part(d) == "app.demo" for d in deps)]
    assert wrong == []


def test_actors_and_kernels_never_import_app():
    for layer, below in (("actors", {"app"}), ("kernels", {"app", "actors"})):
        for path in (ROOT / layer).rglob("*.py"):
            bad = {n for n in imports(path) if n.split(".")[0] in below}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_actors_is_folders_by_role():
    found = {p.name for p in (ROOT / "actors").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found == {name.split(".")[1] for name in ACTORS_ALLOWED if "." in name}
    modules = {p.stem for p in (ROOT / "actors").glob("*.py")} - {"__init__"}
    assert modules == SHARED


def test_no_import_cycle_in_actors():
    assert cycles(app_graph("actors")) == []


def test_actors_parts_import_only_downwards():
    wrong = [f"{m} imports {d}" for m, deps in app_graph("actors").items() for d in deps
             if actors_part(d) != actors_part(m) and actors_part(d) not in ACTORS_ALLOWED[actors_part(m)]]
    assert wrong == []


def test_only_the_executor_and_the_host_import_ray():
    for path in (ROOT / "actors").rglob("*.py"):
        if actors_part(module_name(path)) in RAY_PARTS:
            continue
        assert not {n for n in imports(path) if n.split(".")[0] == "ray"}, f"{path.relative_to(ROOT)} imports Ray"
