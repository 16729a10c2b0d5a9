"""No import cycle between the modules of hybrid, cpu_kernels, gpu_kernels, placement and server.

Every module is ast-parsed and its imports resolved (relative ones too) to the project's modules: `from pkg
import name` is an edge to pkg.name when that is a module, else to pkg. Both module-level and function-level
imports count: one test walks the imports that run when a module is imported (a cycle there breaks an import
order), the other adds the imports inside functions (a cycle there is still two modules that need each other).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hybrid", "cpu_kernels", "gpu_kernels", "placement", "server")


def modules():
    """module name -> its file, for every module of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _module_level(tree):
    """The import nodes that run at import time: not inside a function (class bodies and ifs do run)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _all_imports(tree):
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _resolve(node, name, is_package, known):
    """The project modules an import node of module `name` refers to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module
    found = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in known:
            found.append(sub)
        elif target in known:
            found.append(target)
    return found


def import_graph(level_imports=_module_level):
    """module -> the set of project modules it imports (per `level_imports`)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {t for node in level_imports(tree) for t in _resolve(node, name, is_package, known)} - {name}
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def function_level_cycles():
    """The cycles when imports inside functions count too."""
    return cycles(import_graph(_all_imports))


def test_the_walk_sees_the_packages():
    graph = import_graph()
    assert "hybrid.config" in graph and "server.serve" in graph and "cpu_kernels.formats" in graph
    assert "hybrid.backends.cpu" in graph["hybrid.backends"]  # from .cpu import CpuBackend
    assert "cpu_kernels.formats" in graph["cpu_kernels.prefetch"]  # from .formats import format_for


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_formats_and_placement_do_not_reach_into_kernels_or_the_llm():
    """File formats hand over raw blocks (the engine maps types to kernels, hybrid/weight_formats.py);
    placement's command gets its LLM from the engine. synthetic.py makes test and demo models with the
    kernels' random blocks, so it may."""
    graph = import_graph(_all_imports)
    for name, imported in graph.items():
        if name.startswith("hybrid.formats") and name != "hybrid.formats.synthetic":
            assert not {m for m in imported if m.startswith("cpu_kernels")}, name
    assert "hybrid.llm" not in graph["placement.cli"]


def test_no_module_level_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_counting_imports_inside_functions():
    found = function_level_cycles()
    assert not found, "import cycles (imports inside functions included): " + "; ".join(" <-> ".join(c) for c in found)
