"""The import graphs of engine/ and server/: acyclic; the kernels never import the rooms that use
them, and the server's route modules are imported by the app alone. And no product module is
longer than 400 lines.

Every `import` and `from ... import` in a module counts, wherever it is (inside functions too:
a lazy import still ties the modules together), except those under `if TYPE_CHECKING:`.
Relative imports are resolved; `from pkg import name` is an import of the submodule pkg.name
when that is a module, else of pkg. Importing a module imports its packages' `__init__`s too,
so a submodule import also counts as an import of each enclosing package.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a kernel (engine.kernels.*) may not import: the rooms above it.
KERNEL_FORBIDDEN = ("engine.model", "engine.io", "engine.text", "engine.runtime",
                    "engine.constrain", "engine.engine")


def module_names(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: path} of every .py under root/package (packages by __init__)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
    """The Import/ImportFrom nodes anywhere in tree, skipping `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _parents(name: str) -> set[str]:
    """The packages enclosing the module name (their __init__s run before it)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """{module: the package's modules it imports} over every module of root/package."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        own = _parents(name)
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[:len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                targets = []
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                # the deepest known module named by t (an attribute path ends at its module)
                parts = t.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    target = ".".join(parts)
                    # importing it runs its packages' __init__s too; the importer's own
                    # packages have run before it (unless it names one itself)
                    deps |= {target} | ((_parents(target) - own) & set(modules))
        deps.discard(name)
        graph[name] = deps
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's SCCs (iterative) of more than one module, or of one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in graph[v]:
                        out.append(sorted(comp))
    return out


def _cycle_report(graph, sccs) -> str:
    lines = []
    for comp in sccs:
        lines.append("cycle among: " + ", ".join(comp))
        members = set(comp)
        for m in comp:
            lines.append(f"  {m} -> " + ", ".join(sorted(graph[m] & members)))
    return "\n".join(lines)


def _assert_acyclic(package: str) -> None:
    graph = import_graph(ROOT, package)
    assert len(graph) > 20  # the walk found the package
    sccs = strongly_connected(graph)
    assert not sccs, f"import cycles in {package}/:\n" + _cycle_report(graph, sccs)


def test_engine_imports_are_acyclic():
    _assert_acyclic("engine")


def test_server_imports_are_acyclic():
    _assert_acyclic("server")


def test_server_routes_are_imported_by_the_app_alone():
    graph = import_graph(ROOT, "server")
    routes = {m for m in graph if m.startswith("server.routes.")}
    assert routes
    bad = [(m, d) for m in sorted(graph) for d in sorted(graph[m] & routes)
           if m not in ("server.app", "server.routes") and not m.startswith("server.routes.")]
    assert not bad, "route modules imported beside the app:\n" + "\n".join(
        f"  {m} -> {d}" for m, d in bad)


def test_kernels_import_no_model_room():
    graph = import_graph(ROOT, "engine")
    kernels = [m for m in graph if m == "engine.kernels" or m.startswith("engine.kernels.")]
    assert kernels
    bad = [(k, d) for k in kernels for d in sorted(graph[k])
           if any(d == f or d.startswith(f + ".") for f in KERNEL_FORBIDDEN)]
    assert not bad, "kernels importing the rooms above them:\n" + "\n".join(
        f"  {k} -> {d}" for k, d in bad)


def test_ops_import_no_kernel_or_model():
    graph = import_graph(ROOT, "engine")
    ops = [m for m in graph if m == "engine.ops" or m.startswith("engine.ops.")]
    assert ops
    allowed = ("engine.ops", "engine.plan")
    bad = [(m, d) for m in ops for d in sorted(graph[m])
           if not any(d == a or d.startswith(a + ".") for a in allowed)]
    assert not bad, "engine.ops importing beyond itself:\n" + "\n".join(
        f"  {m} -> {d}" for m, d in bad)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


def test_graph_builder_finds_a_cycle_through_a_function_level_import(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": """
            def f():
                from . import c
                return c
            """,
        "pkg/c.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg import d
            import pkg.a
            """,
        "pkg/d.py": "from pkg import c\n",
        "pkg/sub/__init__.py": "from .x import y\n",
        "pkg/sub/x.py": "from .. import d\ny = 1\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.c"}            # inside a function, relative
    assert graph["pkg.c"] == {"pkg.a"}            # TYPE_CHECKING's import of d left out
    assert graph["pkg.d"] == {"pkg.c"}            # `from pkg import c`: the submodule
    assert graph["pkg.sub"] == {"pkg.sub.x"}
    assert graph["pkg.sub.x"] == {"pkg.d"}        # `from .. import d` from pkg.sub.x
    assert strongly_connected(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    graph["pkg.c"] = set()
    assert strongly_connected(graph) == []


def test_graph_builder_counts_package_inits(tmp_path):
    # importing pkg.sub.x runs pkg/sub/__init__.py, which imports back: a cycle
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/m.py": "import pkg.sub.x\n",
        "pkg/sub/__init__.py": "from pkg.m import z\n",
        "pkg/sub/x.py": "",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.m"] == {"pkg.sub", "pkg.sub.x"}
    assert strongly_connected(graph) == [["pkg.m", "pkg.sub"]]


# The product's packages; generated protobuf code (`*_pb2.py`, `*_pb2_grpc.py`) aside.
PRODUCT = ("engine", "server", "lanes", "release", "sbom")
MAX_MODULE_LINES = 400


def test_no_product_module_is_longer_than_the_cap():
    long = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            n = len(path.read_text().splitlines())
            if n > MAX_MODULE_LINES:
                long[str(path.relative_to(ROOT))] = n
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
    assert (ROOT / "engine/runtime/loop.py").is_file()  # the walk looked at the tree
