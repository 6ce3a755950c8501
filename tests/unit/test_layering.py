"""The import graph, read from the source (every import: top-level, in functions, under TYPE_CHECKING):
no circle among the worker's modules, its layers import downward only, and ``sluice/`` (the shared
floor) imports neither service. docs/architecture.md draws the layers."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The worker's layers, top first. A module may import its own unit and any unit of a lower layer,
# never a unit of its own layer or of a higher one. A unit is a package or a set of modules.
WORKER_LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("worker.__main__", "worker.server", "worker.serving_processes", "worker.metrics"),),  # composition root
    (("worker.service",),),
    # the service renders prompts, the engine gets ids; the tensor-parallel ranks wrap the runner
    (("worker.engine",), ("worker.prompts",), ("worker.parallel",)),
    (("worker.output",), ("worker.sampling",), ("worker.model",)),
    (("worker.attention",), ("worker.quant",), ("worker.lora",)),
    (("worker.device",),),  # host <-> device copies, read by attention, model and sampling
    (("worker.config", "worker.errors", "worker.types"),),  # settings and the shared vocabulary
    (("worker.formats",),),  # the model families' text formats, read by settings, output, sampling, service
)
# Function-level imports of worker modules that are there for start-up time or an optional
# dependency, never to dodge a circle.
LAZY_IMPORTS = {
    ("worker.__main__", "worker.server"),  # torch loads only once the ports are claimed
    ("worker.__main__", "worker.parallel.ranks"),  # a follower node: no ports, torch loads then
    ("worker.attention.triton_decode", "worker.attention.triton_decode_kernels"),  # needs triton
    ("worker.model.fused", "worker.model.fused_kernels"),  # needs triton
    ("worker.lora.choice", "worker.lora.triton_ops"),  # needs triton
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: str) -> dict[str, Path]:
    """Every module of a top-level package, by dotted name (generated stubs left out)."""
    return {
        module_name(path): path
        for path in sorted((REPO / package).rglob("*.py"))
        if "v1" not in path.relative_to(REPO).parts
    }


def imports(path: Path, name: str) -> Iterator[tuple[str, bool]]:
    """``(imported module or name, inside a function)`` for each import in the file, relative ones
    resolved; ``from a import b`` yields both ``a`` and ``a.b`` (b may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                yield from ((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                yield base, in_function
                yield from ((f"{base}.{alias.name}", in_function) for alias in child.names)
            yield from visit(child, nested)

    yield from visit(ast.parse(path.read_text(encoding="utf-8")), False)


def worker_graph() -> dict[str, set[str]]:
    """Module -> the worker modules it imports (package ``__init__`` files included as modules)."""
    known = modules("worker")
    return {
        name: {target for target, _ in imports(path, name) if target in known and target != name}
        for name, path in known.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def unit_of(module: str) -> tuple[int, int] | None:
    """``(layer, unit)`` indexes of a worker module, None for the ``worker`` package itself."""
    for layer, units in enumerate(WORKER_LAYERS):
        for index, unit in enumerate(units):
            if any(module == prefix or module.startswith(prefix + ".") for prefix in unit):
                return layer, index
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_among_worker_modules() -> None:
    cycle = find_cycle(worker_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_every_worker_module_has_a_layer() -> None:
    missing = [name for name in modules("worker") if name != "worker" and unit_of(name) is None]
    assert not missing, f"add these to WORKER_LAYERS (and docs/architecture.md): {missing}"


def test_worker_layers_import_downward_only() -> None:
    wrong = []
    for source, targets in worker_graph().items():
        here = unit_of(source)
        for target in targets:
            there = unit_of(target)
            if here is None or there is None or here == there:
                continue
            if there[0] <= here[0]:
                wrong.append(f"{source} -> {target}")
    assert not wrong, "imports against the layer order: " + ", ".join(sorted(wrong))


def test_worker_packages_import_nothing() -> None:
    # An ``__init__.py`` holds a docstring only: importing a submodule never drags in its siblings.
    for name, path in modules("worker").items():
        if path.name == "__init__.py":
            assert not list(imports(path, name)), f"{path.relative_to(REPO)} should only describe its package"


def test_worker_imports_in_functions_are_only_the_known_lazy_ones() -> None:
    known = modules("worker")
    lazy = {
        (name, target)
        for name, path in known.items()
        for target, in_function in imports(path, name)
        if in_function and target in known and known[target].name != "__init__.py"
    }
    assert lazy <= LAZY_IMPORTS, f"import these at the top of the module: {sorted(lazy - LAZY_IMPORTS)}"


@pytest.mark.parametrize("service", ["worker", "edge"])
def test_sluice_imports_no_service(service: str) -> None:
    upward = sorted(
        f"{name} -> {target}"
        for name, path in modules("sluice").items()
        for target, _ in imports(path, name)
        if target == service or target.startswith(service + ".")
    )
    assert not upward, f"sluice/ is shared by both services and must not import {service}: {upward}"


def graph_of(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same top-level package it imports, with the packages above each
    (importing ``a.b.c`` runs ``a/b/__init__.py`` first)."""
    known = modules(package)
    return {
        name: {
            above
            for target, _ in imports(path, name)
            if target in known
            for above in packages_and_module(target)
            if above in known and above != name
        }
        for name, path in known.items()
    }


def packages_and_module(module: str) -> list[str]:
    """``a.b.c`` -> ``[a, a.b, a.b.c]``."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@pytest.mark.parametrize("package", ["edge", "sluice", "tools"])
def test_no_import_circle_among_other_packages(package: str) -> None:
    # A module's import of its own package runs nothing (Python ran the package first); a package
    # whose __init__ imports its modules runs them, so that edge counts.
    graph = {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph_of(package).items()
    }
    assert find_cycle(graph) is None, f"import circle: {find_cycle(graph)}"


# The edge's modules below its surfaces and routes: what every request goes through, the app's own
# helpers and settings, the OpenAPI document (the routes declare their operations to it). They
# serve the surfaces and the routes, and reach neither, even indirectly.
EDGE_BELOW_SURFACES = ("edge.http", "edge.settings", "edge.requests", "edge.openapi")
EDGE_ABOVE = ("edge.surfaces", "edge.routes")


def within(module: str, units: tuple[str, ...]) -> bool:
    return any(module == unit or module.startswith(unit + ".") for unit in units)


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` imports, directly or through others: module -> the one that imports it.
    A module's import of its own package runs nothing (the package ran first), so it is not followed."""
    via: dict[str, str] = {}
    pending = [start]
    while pending:
        source = pending.pop()
        for target in graph.get(source, ()):
            if source.startswith(target + ".") or target in via or target == start:
                continue
            via[target] = source
            pending.append(target)
    return via


def test_edge_core_reaches_no_surface_and_no_route() -> None:
    graph = graph_of("edge")
    wrong = sorted(
        f"{name} -> ... {via[target]} -> {target}"
        for name in graph
        if within(name, EDGE_BELOW_SURFACES)
        for via in [reachable(graph, name)]
        for target in via
        if within(target, EDGE_ABOVE)
    )
    assert not wrong, f"below the surfaces, these reach a surface or a route: {wrong}"


def test_reachable_follows_imports_but_not_a_modules_own_package() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "p.m": {"p"}, "p": {"p.m", "q"}}
    assert reachable(graph, "a") == {"b": "a", "c": "b"}
    assert reachable(graph, "p.m") == {}
    assert reachable(graph, "p") == {"p.m": "p", "q": "p"}


def test_edge_surfaces_import_no_other_surface() -> None:
    crossing = sorted(
        f"{name} -> {target}"
        for name, targets in graph_of("edge").items()
        if name.startswith("edge.surfaces.") and name.split(".")[2] != "shared"
        for target in targets
        if target.startswith("edge.surfaces.")
        and len(target.split(".")) > 2
        and target.split(".")[2]
        not in (name.split(".")[2], "shared", "answer", "generation", "tokens", "images")
    )
    assert not crossing, f"what two surfaces share belongs in edge/surfaces/shared/: {crossing}"


@pytest.mark.parametrize("package", ["worker", "edge", "sluice", "tools"])
def test_module_docstrings_are_short(package: str) -> None:
    # A docstring says what the module is; design notes live in docs/ (worker.md, edge-internals.md).
    long = []
    for name, path in modules(package).items():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
        if len(doc.strip().splitlines()) > 5:
            long.append(name)
    assert not long, f"move the design notes of these modules to docs/: {long}"


def test_architecture_doc_names_only_paths_that_exist() -> None:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    sections = {"## Worker": "worker", "## Edge": "edge"}
    stale = []
    for heading, root in sections.items():
        start = text.index(heading)
        end = min((text.index(h) for h in sections if text.index(h) > start), default=len(text))
        for line in text[start:end].splitlines():
            if not line.startswith("| `"):
                continue
            for part in line.split("|")[1].split(","):
                named = part.strip().strip("`")
                if named.endswith((".py", "/")) and not any(
                    (REPO / root / named).exists() or p.name == named for p in (REPO / root).rglob(named)
                ):
                    stale.append(f"{root}/{named}")
    assert not stale, f"docs/architecture.md names what is not in the tree: {stale}"


def test_architecture_doc_names_every_edge_package() -> None:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Edge") :]
    packages = {
        path.parent.relative_to(REPO / "edge").as_posix() + "/"
        for path in (REPO / "edge").rglob("__init__.py")
        if path.parent != REPO / "edge"
    }
    missing = sorted(
        p for p in packages if f"`{p}`" not in section and f"`{p.split('/')[0]}/`" not in section
    )
    assert not missing, f"docs/architecture.md's edge table should name: {missing}"


def test_architecture_doc_names_every_worker_module() -> None:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Worker") : text.index("## Edge")]
    rows = {line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| `")}
    named = {part.strip().strip("`") for row in rows for part in row.split(",")}
    missing = []
    for path in modules("worker").values():
        relative = path.relative_to(REPO / "worker").as_posix()
        package = relative.split("/")[0] + "/"
        if path.name == "__init__.py" or relative in named or package in named:
            continue
        if path.parent.name != "worker" and path.name in named:  # "a.py, b.py" rows name siblings bare
            continue
        missing.append(relative)
    assert not missing, f"docs/architecture.md's worker table should name: {missing}"


# ``docs/worker.md, "Section"`` or ``docs/worker.md ("Section")``, possibly across a line break.
DOC_SECTION_REFERENCE = re.compile(r'docs/([\w-]+\.md),?\s+\(?"([^"]+)"')


def doc_headings(doc: str) -> list[str]:
    """The headings of one file under docs/, without their ``#`` marks."""
    text = (REPO / "docs" / doc).read_text(encoding="utf-8")
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]


@pytest.mark.parametrize("package", ["worker", "edge", "sluice"])
def test_code_points_to_sections_that_exist(package: str) -> None:
    # Design notes live in docs/; a pointer to them names a heading there (a heading may go on,
    # as "Steps that overlap (`--overlap-steps`)" does), never the module's own docstring, which
    # holds a few lines only (test_module_docstrings_are_short).
    dangling = []
    for name, path in modules(package).items():
        text = path.read_text(encoding="utf-8")
        if "module docstring" in text:
            dangling.append(f"{name}: 'the module docstring'")
        for doc, section in DOC_SECTION_REFERENCE.findall(text):
            section = " ".join(section.split())
            if not (REPO / "docs" / doc).exists() or not any(
                heading.startswith(section) for heading in doc_headings(doc)
            ):
                dangling.append(f'{name}: docs/{doc}, "{section}"')
    assert not dangling, f"point these to a section of docs/ that holds the notes: {dangling}"
