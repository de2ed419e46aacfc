"""The package's layers, as the README's module map draws them: imports only go down, never in a cycle.

* two floors the tree shows: ``core/`` (the ground floor: types, env, device discipline, host copies, state,
  progress) imports nothing of the course but itself; ``lab/`` (the lesson and measurement helpers) and
  ``checks/`` stand on top, and no engine floor (``core``, ``memory``, ``cache``, ``kernels``, ``model``,
  ``serving``, ``disagg``) ever imports them;
* ``core.types`` imports nothing of the course; ``memory/`` stands on ``core`` only;
* ``serving/`` never imports ``memory/``: it reaches a memory manager through the ``MemoryManager`` protocol;
* nothing outside ``memory/`` reaches into a manager or past its written doors (``tests/core/test_doors.py``);
* nothing in ``lesson_utils`` imports the tooling (``course_tools``) or the notebook machinery (nbformat,
  nbclient, ipykernel): Colab installs the runtime package alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lesson_utils"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports count too), as absolute names."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # "from pkg import module"
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {m: {i for i in imports_of(p) if i in MODULES and i not in (m, "lesson_utils")} for m, p in MODULES.items()}


def layer_of(module: str) -> str:
    """``lesson_utils.memory.swap`` -> ``memory``; ``lesson_utils.core.types`` -> ``types`` (the one module of the
    ground floor that stands on nothing); a module at the package's root is a layer of its own."""
    parts = module.split(".")
    if parts[1:3] == ["core", "types"]:
        return "types"
    return parts[1] if len(parts) > 1 else ""


BASE = {"core", "types"}  # the ground floor anyone may stand on
ALLOWED = {  # layer -> the layers it may import (besides itself and BASE)
    "types": set(),
    "core": set(),
    "memory": set(),
    "cache": {"memory", "kernels"},
    "kernels": set(),  # checked against cache/attention.py's references in the tests, not importing them
    "model": {"cache"},
    "serving": {"cache", "model"},
    "disagg": {"cache", "memory", "model", "serving"},
    "api": {"cache", "memory", "model", "serving"},  # lesson 13's server drives an engine through its public surface
    "lab": {"cache", "memory", "kernels", "model", "serving", "disagg", "api"},  # the helpers measure the engine
    "checks": {"cache", "memory", "kernels", "model", "serving", "disagg", "lab", "api"},
}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for m, deps in graph.items():
        layer = layer_of(m)
        if layer not in ALLOWED:
            bad += [(m, "a layer of its own: put it in a floor")] if layer else []
            continue
        ok = ALLOWED[layer] | {layer} | (BASE if layer != "types" else set())
        bad += [(m, d) for d in deps if layer_of(d) not in ok]
    return bad


def test_a_layer_imports_nothing_above_it():
    assert upward_imports(GRAPH) == []


def test_the_layer_rule_can_fail():
    assert upward_imports({"lesson_utils.serving.engine": {"lesson_utils.memory.sharing"}}) != []
    assert upward_imports({"lesson_utils.memory.swap": {"lesson_utils.serving.scheduler"}}) != []
    assert upward_imports({"lesson_utils.core.types": {"lesson_utils.core.env"}}) != []


def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d) :] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state:
                found = visit(d, path + [d])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_cycle_anywhere_in_the_repository():
    """The package, the tooling (``course_tools``) and the tests' helpers together: no module reaches itself (a
    function-level import counts: it is a cycle that only waits to be called)."""
    roots = [PACKAGE, ROOT / "course_tools", ROOT / "tests" / "helpers"]
    modules = {module_name(p): p for r in roots for p in r.rglob("*.py")}
    graph = {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}
    for m in graph:  # a package's __init__ is not an edge to its own modules
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    assert _cycle(graph) is None, "import cycle: " + " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the search can fail


def test_the_runtime_package_needs_no_tooling():
    for m, p in MODULES.items():
        bad = {i for i in imports_of(p) if i.split(".")[0] in ("course_tools", "nbformat", "nbclient", "ipykernel")}
        assert not bad, f"{m} imports {sorted(bad)}: the tooling lives in course_tools (extra [tools])"


def test_the_public_import_paths_hold():
    """The public import paths notebooks, checkers and instructors rely on, whatever the layout inside: the kernels'
    entry points, a checker module with check_ functions for every lesson, and the run_all tool."""
    import importlib

    from lesson_utils import kernels

    assert callable(kernels.paged_attention_decode) and callable(kernels.write_kv_to_cache)
    lessons = sorted(int(p.name[:2]) for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    for n in lessons:
        checks = importlib.import_module(f"lesson_utils.checks.lesson{n:02d}")
        assert [f for f in dir(checks) if f.startswith("check_")], (
            f"lesson {n:02d}'s checker module has no check_ function"
        )
    assert importlib.util.find_spec("course_tools.run_all") is not None  # the README names it as run_all's successor


def test_every_subpackage_ships_in_the_wheel():
    """Colab installs a wheel, not this folder: a subpackage setuptools does not find is missing there."""
    import fnmatch

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(str(ROOT), include=include))
    on_disk = {
        ".".join(d.relative_to(ROOT).parts)
        for top in ("lesson_utils", "course_tools")
        for d in [ROOT / top, *(ROOT / top).rglob("*")]
        if d.is_dir() and any(d.glob("*.py")) and "__pycache__" not in d.parts
    }
    assert on_disk <= found, f"not packaged: {sorted(on_disk - found)} (an __init__.py missing?)"
    assert all(any(fnmatch.fnmatch(p, pat) for pat in include) for p in found)


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def size_problems(roots=(PACKAGE, ROOT / "course_tools")) -> list[str]:
    """Modules over 400 lines, and functions over 80 lines whose docstring does not say why (``Long on purpose``)."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            text = path.read_text()
            where = path.relative_to(root.parent)
            if len(text.splitlines()) > MAX_MODULE_LINES:
                found.append(f"{where}: {len(text.splitlines())} lines (at most {MAX_MODULE_LINES}): split it")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES and "Long on purpose" not in (ast.get_docstring(node) or ""):
                        found.append(f"{where}:{node.lineno}: {node.name} is {length} lines with no reason given")
    return found


def test_modules_and_functions_stay_small():
    assert size_problems() == [], "\n".join(size_problems())


def test_the_size_rule_can_fail(tmp_path):
    (tmp_path / "big.py").write_text("x = 1\n" * 401)
    body = "".join(f"    y{i} = {i}\n" for i in range(85))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n\ndef g():\n    'Long on purpose: a reason.'\n{body}")
    problems = size_problems([tmp_path])
    assert len(problems) == 2 and "big.py: 401 lines" in problems[0] and "f is 86 lines" in problems[1]
