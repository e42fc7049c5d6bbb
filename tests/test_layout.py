"""The house keeps its wings: no import cycle in trainq.watcher, imports only point down the wings, rooms stay few.

The graph is read from the source with ``ast`` (every ``import``, at module level, inside functions and
under ``TYPE_CHECKING`` alike: a cycle hidden in a type hint is still a cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from conftest import REPO

WATCHER = REPO / "watcher"
#: the wings, lowest first: a module may import its own wing and the wings before it, never one after it
WINGS = ("spec", "supervisor", "faces", "slurm", "daemon", "cli")
#: most modules a folder under watcher/ may hold before it wants splitting (STYLE.md)
MAX_MODULES_PER_FOLDER = 20


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(WATCHER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["trainq", "watcher", *parts])


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The trainq.watcher modules ``path`` imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the trainq.watcher modules it imports."""
    files = {_module_name(p): p for p in WATCHER.rglob("*.py")}
    known = set(files)
    return {name: _imports(path, name, known) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None (depth-first search, white/grey/black)."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if colour.get(nxt) is None and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = 2
        return None

    for start in sorted(graph):
        if colour.get(start) is None and (found := visit(start)):
            return found
    return None


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[2] in WINGS else None


def test_the_watcher_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_it_is_shown() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_imports_only_point_down_the_wings() -> None:
    upward = []
    for module, deps in import_graph().items():
        own = _wing(module)
        for dep in deps:
            theirs = _wing(dep)
            if own and theirs and WINGS.index(theirs) > WINGS.index(own):
                upward.append(f"{module} -> {dep}")
    assert not upward, (
        "imports pointing up the wings (spec < supervisor < faces < slurm < daemon < cli):\n"
        + "\n".join(sorted(upward))
    )


def test_every_module_of_the_watcher_lives_in_a_wing() -> None:
    loose = sorted(p.name for p in WATCHER.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == [], f"watcher/ holds modules outside its wings: {loose}"
    assert sorted(p.name for p in WATCHER.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(WINGS)


def test_no_folder_under_watcher_holds_more_than_twenty_modules() -> None:
    crowded = {
        d.name: n
        for d in WATCHER.iterdir()
        if d.is_dir()
        if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER
    }
    assert not crowded, crowded


def test_the_daemon_never_imports_the_slurm_executor() -> None:
    graph = import_graph()
    daemon = [m for m in graph if _wing(m) == "daemon"]
    assert not [(m, d) for m in daemon for d in graph[m] if _wing(d) == "slurm"]


def test_nothing_in_the_repository_points_outside_it() -> None:
    """A clone is complete: no tracked file sends its reader to the steering folder beside the repository."""
    needle = "../" + "shared"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    tracked = (
        [REPO / n for n in listed.stdout.decode().split("\0") if n]
        if listed.returncode == 0
        else [p for p in REPO.rglob("*") if not {".git", ".venv"} & set(p.parts)]
    )
    offenders = []
    for path in tracked:
        if not path.is_file() or path.suffix in (".png", ".whl", ".gz"):
            continue
        try:
            if needle in path.read_text(encoding="utf-8", errors="ignore"):
                offenders.append(str(path.relative_to(REPO)))
        except OSError:
            continue
    assert offenders == []
