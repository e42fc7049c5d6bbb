"""The docs stay true (issue 34): README.md, CONTRIBUTING.md and docs/ checked against the repository.

- every docs/ page is reachable from the README by links, and listed in the README's manual table;
- every relative link resolves: the file exists and a ``#anchor`` names a heading of the page it points at;
- a repository path written in the prose (``watcher/daemon/executor.py``, a test id such as
  ``tests/test_docs.py::test_docstrings_name_modules_that_exist``) names a file that exists, and a test id names
  a test that file defines;
- nothing cites a contract file or a numbered section the repository does not have ("CONTRACT section 13":
  the contract is docs/contract.md, whose sections have names, not numbers);
- a package's or module's docstring that names a Python file names one that exists.

Plain files and the standard library only; each check reports every finding at once.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
#: the pages a reader is sent to; CHANGELOG.md is history and may name what no longer exists
PAGES = [README, REPO / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
#: the folders whose Python modules' docstrings are checked
SOURCE_TREES = ("watcher", "trainer", "bench", "tests", "contrib")
#: top-level folders of the repository a path in the prose may start with
REPO_FOLDERS = ("watcher", "trainer", "schemas", "docs", "tests", "bench", "contrib", ".ci", "queue")
#: a user's script in an example (``command: [python, train.py]``), not a module of the repository
EXAMPLE_SCRIPTS = {"train.py"}
#: written when a command runs, not kept in the repository (.gitignore)
GENERATED = ("bench/results/",)
FILE_SUFFIXES = (".py", ".md", ".sh", ".json", ".yaml", ".service", ".toml", ".txt")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HTML_HREF = re.compile(r"""<a\s[^>]*href=["']([^"']+)["']""", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:" + "|".join(re.escape(f) for f in REPO_FOLDERS) + r")/[A-Za-z0-9_./-]*[A-Za-z0-9_])"
    r"((?:::[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]\s]*\])?)*)"
)
SHORT_TEST_ID = re.compile(r"(?<![\w/.])::([A-Za-z_][A-Za-z0-9_]*)")
#: "CONTRACT section 13", "CONTRACT.md", "the contract, section 4", "contract §4"
CONTRACT_CITATION = re.compile(
    r"(?-i:\bCONTRACT(?:\.md)?\b)|\bcontract(?:\.md)?\b[^.\n]{0,12}?(?:\bsections?\s+\d+|§\s*\d+)", re.IGNORECASE
)
PY_NAME = re.compile(r"(?<![\w.-])((?:[A-Za-z0-9_]+/)*[A-Za-z_][A-Za-z0-9_]*\.py)\b")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each line outside fenced code blocks."""
    lines, in_fence = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append((number, line))
    return lines


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in the page's prose: inline, image, reference and HTML."""
    found = []
    for number, line in prose_lines(path):
        for pattern in (INLINE_LINK, IMAGE_LINK, REFERENCE_DEF, HTML_HREF):
            found.extend((number, m.group(1)) for m in pattern.finditer(line))
    return found


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)) or target.startswith("//")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation gone, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for _, target in links(page):
            if is_external(target):
                continue
            file_part = target.split("#", 1)[0]
            if not file_part.endswith(".md"):
                continue
            linked = (page.parent / file_part).resolve()
            if linked.is_file() and linked not in reached:
                reached.add(linked)
                todo.append(linked)
    unreached = [rel(p) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in reached]
    assert not unreached, f"docs pages no link path from README.md reaches: {unreached}"


def test_every_docs_page_is_listed_in_the_readmes_manual_table():
    text = README.read_text(encoding="utf-8")
    m = re.search(r"^## The manual\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert m, "README.md has no '## The manual' section"
    listed = {
        target for line in m.group(1).splitlines() if line.startswith("|") for target in INLINE_LINK.findall(line)
    }
    missing = [f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in listed]
    assert not missing, f"docs pages missing from the README's manual table: {missing}"


def test_the_contributing_guide_is_linked_from_the_readme():
    assert (REPO / "CONTRIBUTING.md").is_file()
    assert "CONTRIBUTING.md" in {t.split("#", 1)[0] for _, t in links(README)}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page: Path):
    problems = []
    for number, target in links(page):
        if is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        where = f"{rel(page)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where}: {linked.name} has no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)


def defined_tests(path: Path) -> set[str]:
    """Names of the functions and classes a test file defines (test ids may name either)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


def repo_path_problems(where: str, path_text: str, test_parts: list[str]) -> list[str]:
    path_text = path_text.rstrip(".")
    if not path_text.endswith(FILE_SUFFIXES) or path_text.startswith(GENERATED):
        return []  # a folder, a runtime file (queue/status.json is written by the watcher), or generated output
    if path_text.startswith("queue/") and not path_text.startswith("queue/examples/"):
        return []
    target = REPO / path_text
    if not target.exists():
        return [f"{where}: {path_text} does not exist"]
    if not test_parts or target.suffix != ".py":
        return []
    names = defined_tests(target)
    return [f"{where}: {path_text} defines no {name}" for name in test_parts if name not in names]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_paths_and_test_ids_in_the_prose_exist(page: Path):
    problems = []
    for number, line in prose_lines(page):
        last_file = None
        spans = []
        for m in REPO_PATH.finditer(line):
            parts = [re.sub(r"\[.*\]$", "", p) for p in m.group(2).split("::") if p]
            problems += repo_path_problems(f"{rel(page)}:{number}", m.group(1), parts)
            spans.append((m.start(), m.end(), m.group(1)))
        # "`tests/test_x.py::test_a`, `::test_b`": a bare ::name belongs to the file named before it on the line
        for m in SHORT_TEST_ID.finditer(line):
            if any(start <= m.start() < end for start, end, _ in spans):
                continue
            before = [p for start, _, p in spans if start < m.start()]
            last_file = before[-1] if before else None
            if last_file is None:
                problems.append(f"{rel(page)}:{number}: ::{m.group(1)} names no test file before it")
                continue
            problems += repo_path_problems(f"{rel(page)}:{number}", last_file, [m.group(1)])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_citation_of_a_contract_file_or_section_the_repository_lacks(page: Path):
    problems = [
        f"{rel(page)}:{number}: {m.group(0)!r} (the contract is docs/contract.md; its sections have names, not numbers)"
        for number, line in prose_lines(page)
        for m in CONTRACT_CITATION.finditer(line)
    ]
    assert not problems, "\n".join(problems)


def module_docstrings():
    for tree_name in SOURCE_TREES:
        for path in sorted((REPO / tree_name).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
            if doc:
                yield path, doc


def python_file_exists(name: str, module: Path) -> bool:
    """Whether a ``x.py`` a docstring names exists: a path (``faces/html.py``) from the module's folder, a folder
    above it, or the installed package's folders (watcher/, trainer/); a bare name beside the module or anywhere
    in the source trees."""
    if "/" in name:
        name = name.removeprefix("trainq/")
        folders = [f for f in module.parents if f == REPO or REPO in f.parents] + [REPO / "watcher", REPO / "trainer"]
        return any((folder / name).is_file() for folder in folders)
    if (module.parent / name).is_file():
        return True
    return any(any((REPO / tree).rglob(name)) for tree in SOURCE_TREES)


def test_docstrings_name_modules_that_exist():
    problems = []
    for path, doc in module_docstrings():
        for m in PY_NAME.finditer(doc):
            if m.group(1) not in EXAMPLE_SCRIPTS and not python_file_exists(m.group(1), path):
                problems.append(f"{rel(path)}: its docstring names {m.group(1)}, which does not exist")
    assert not problems, "\n".join(problems)


def test_python_sources_cite_no_contract_section_and_name_docs_pages_that_exist():
    """Docstrings and comments alike: a reader of the code follows them into the repository's docs."""
    this_file = Path(__file__).resolve()
    problems = []
    for tree_name in SOURCE_TREES:
        for path in sorted((REPO / tree_name).rglob("*.py")):
            if path.resolve() == this_file:
                continue  # it spells out the patterns it looks for
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                problems += [f"{rel(path)}:{number}: {m.group(0)!r}" for m in CONTRACT_CITATION.finditer(line)]
                problems += [
                    f"{rel(path)}:{number}: {m.group(0)} does not exist"
                    for m in re.finditer(r"(?<![\w/.-])docs/[\w.-]+\.md\b", line)
                    if not (REPO / m.group(0)).is_file()
                ]
    assert not problems, "\n".join(problems)


# -- the checks above must be able to fail: each is run once on a page written to be wrong --


def test_the_checks_find_what_is_wrong(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n## Flags and `codes`\n\n"
        "[ok](#flags-and-codes) [bad anchor](#nope) [gone](missing.md) ![img](pic.png)\n"
        "```\n[in a fence](also-missing.md)\n# not a heading\n```\n"
        "See CONTRACT section 13 and the contract, section 4.\n"
        "[ref]: elsewhere.md\n",
        encoding="utf-8",
    )
    assert [t for _, t in links(page)] == ["#flags-and-codes", "#nope", "missing.md", "pic.png", "elsewhere.md"]
    assert anchors(page) == {"a-page", "flags-and-codes"}
    assert len([m for _, line in prose_lines(page) for m in CONTRACT_CITATION.finditer(line)]) == 2
    assert repo_path_problems("x", "watcher/no_such_module.py", []) == ["x: watcher/no_such_module.py does not exist"]
    assert repo_path_problems("x", "tests/test_docs.py", ["test_no_such_test"]) == [
        "x: tests/test_docs.py defines no test_no_such_test"
    ]
    assert repo_path_problems("x", "tests/test_docs.py", ["test_the_checks_find_what_is_wrong"]) == []
    module = REPO / "tests" / "test_docs.py"
    assert python_file_exists("conftest.py", module)
    assert not python_file_exists("slurm_state.py", module)
    assert not python_file_exists("watcher/signals.py", module)
