"""The module graph of moonep_ops and csrc_cute, read from the source with `ast`: no import cycle
(function-level imports count too), fakes that depend on the checks alone, and `import moonep_ops`
without CuTe DSL (docs/design-notes.md, "Packages")."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moonep_ops", "csrc_cute")
# what a fake kernel may import, directly or through what it imports (besides the other fakes)
FAKE_DEPENDENCIES = {"moonep_ops.checks", "moonep_ops.registry", "csrc_cute", "csrc_cute.status"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of PACKAGES (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _known(name: str, modules) -> str | None:
    """`name` or its longest prefix that is one of `modules` (an attribute import names its module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The modules of `modules` that `name` imports anywhere in its file, function bodies included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub; `from mod import attr` the module mod
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in (_known(t, modules) for t in targets) if t is not None and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, files) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_graph_reads_relative_absolute_and_lazy_imports():
    graph = import_graph()
    assert {"moonep_ops.checks", "moonep_ops.fake", "moonep_ops.registry"} <= graph["moonep_ops.ops"]
    assert "moonep_ops.fake.dispatch" in graph["moonep_ops.fake"]  # from . import dispatch
    assert "csrc_cute.dispatch" in graph["moonep_ops.ops"]         # inside the CUDA entry point
    assert "moonep_ops.checks" in graph["csrc_cute.dispatch"]       # absolute, at module level
    assert "moonep_ops.ops" in graph["moonep_ops.group"]            # inside cuda_kernels_available


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_fakes_depend_on_the_checks_alone():
    graph = import_graph()
    for name in graph:
        if name == "moonep_ops.fake" or name.startswith("moonep_ops.fake."):
            extra = {m for m in reachable(graph, name) if not m.startswith("moonep_ops.fake")} - FAKE_DEPENDENCIES
            assert not extra, f"{name} imports {sorted(extra)}: fakes depend on moonep_ops.checks (and the registry)"


def test_import_moonep_ops_does_not_load_cute_dsl():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", "import moonep_ops, sys; assert 'cutlass' not in sys.modules, "
                    "[m for m in sys.modules if m.startswith('cutlass')][:5]"], cwd=ROOT, env=env, check=True)


def test_the_dsl_imports_without_jax_and_jax_still_imports_after(tmp_path):
    """csrc_cute keeps the CuTe DSL's JAX bridge from importing JAX (0.9 s of a warm start, csrc_cute/__init__.py);
    the user's own later `import jax` still works. A stand-in `jax` package on the path plays the installed one."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("IMPORTED_BY_THE_USER = True\n")
    # the stand-in goes before the installed packages (and any PYTHONPATH that makes the DSL importable)
    path = [str(ROOT), str(tmp_path)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    code = ("import sys, moonep_ops, csrc_cute.plan, cutlass.jax\n"
            "assert 'cutlass' in sys.modules and 'jax' not in sys.modules, sorted(sys.modules)[:3]\n"
            "assert not cutlass.jax.is_available()\n"
            "import jax\n"
            "assert jax.IMPORTED_BY_THE_USER\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)
