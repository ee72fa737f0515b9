"""docs/design.md's layout map against the tree: every module named, every name a module.

The map is the first fenced block of the page's "Packaging and layout" section: one line per folder
(``name/``) or file, indented two spaces a level, each with what it is for.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO

DESIGN = REPO / "docs" / "design.md"
ROOTS = ("pipec", "compiler", "model", "tp", "costs", "dsl", "schedules", "runtime", "tune", "views", "examples")
"""The folders that install as pipec's packages: the map names every module under them."""

_LINE = re.compile(r"(?P<indent> *)(?P<name>[A-Za-z0-9_.]+/?)(?: {2,}(?P<what>\S.*))?")


def map_lines(text: str) -> list[str]:
    """The lines of the layout map in the page's text."""
    section = text.split("\n## Packaging and layout\n", 1)
    assert len(section) == 2, "docs/design.md has no '## Packaging and layout' section"
    body = section[1].split("\n## ", 1)[0]
    fence = re.search(r"^```[^\n]*\n(.*?)^```", body, re.S | re.M)
    assert fence, "the 'Packaging and layout' section of docs/design.md has no fenced layout map"
    return fence.group(1).splitlines()


def parse_map(lines: list[str]) -> tuple[dict[str, str], list[str]]:
    """Path -> what it is for, for every folder and file the map names; and each line it cannot read."""
    named: dict[str, str] = {}
    problems: list[str] = []
    folders: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        m = _LINE.fullmatch(line.rstrip())
        depth, odd = divmod(len(m.group("indent")), 2) if m else (0, 1)
        if not m or odd or depth > len(folders) or not m.group("what"):
            problems.append(f"map line {number} is not 'NAME  what it is for' indented two spaces a level "
                            f"under its folder: {line!r}")
            continue
        del folders[depth:]
        path = "/".join([*folders, m.group("name").rstrip("/")])
        if path in named:
            problems.append(f"map line {number} names {path} again")
        named[path] = m.group("what")
        if m.group("name").endswith("/"):
            folders.append(m.group("name").rstrip("/"))
    return named, problems


def tree_modules() -> set[str]:
    """Every module of the packages, as a path from the repository's root."""
    return {p.relative_to(REPO).as_posix() for root in ROOTS for p in (REPO / root).rglob("*.py")
            if "__pycache__" not in p.parts}


def mismatches(named: dict[str, str], modules: set[str]) -> list[str]:
    """What the map and the tree disagree on, one line each."""
    out = [f"{m}: a module the layout map in docs/design.md does not name; add a line for it"
           for m in sorted(modules - set(named))]
    for path in sorted(named):
        if not (REPO / path).exists():
            out.append(f"{path}: named by the layout map in docs/design.md, but not in the tree; remove its line")
    out += [f"{p}/: a top-level folder of the map that is not one of pipec's packages {ROOTS}"
            for p in sorted(named) if "/" not in p and p not in ROOTS]
    return out


def test_the_layout_map_names_every_module_and_only_modules_that_exist():
    named, problems = parse_map(map_lines(DESIGN.read_text(encoding="utf-8")))
    assert problems == []
    assert set(ROOTS) <= set(named), sorted(set(ROOTS) - set(named))
    assert mismatches(named, tree_modules()) == []


def test_the_check_finds_a_missing_module_a_stale_line_and_a_bad_line():
    named, problems = parse_map([
        "compiler/    the compiler",
        "  driver.py  the driver",
        "  ir/        the ir",
        "    gone.py  not in the tree",
        "  bad.py",
        "   odd.py    three spaces",
    ])
    assert named == {"compiler": "the compiler", "compiler/driver.py": "the driver", "compiler/ir": "the ir",
                     "compiler/ir/gone.py": "not in the tree"}
    assert [p.split(" is not ")[0] for p in problems] == ["map line 5", "map line 6"]
    found = mismatches(named, {"compiler/driver.py", "compiler/request.py"})
    assert found == [
        "compiler/request.py: a module the layout map in docs/design.md does not name; add a line for it",
        "compiler/ir/gone.py: named by the layout map in docs/design.md, but not in the tree; remove its line",
    ]


@pytest.mark.parametrize("line", ["pipec/", "pipec/  ", "  cli.py  the cli"])
def test_a_line_without_a_purpose_or_a_folder_is_refused(line):
    _, problems = parse_map([line])
    assert len(problems) == 1 and problems[0].startswith("map line 1 ")
