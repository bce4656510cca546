"""README.md's dependency claims hold against the pyprojects: its table names every distribution
with exactly the dependencies its pyproject.toml declares, and every `pip install` line installs
only distributions of this repository (with extras they declare), packages a distribution depends
on, or the one tool the README's commands need (nox)."""

import re
import shlex
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FOLDERS = ("core", "reference_numpy", "conformance", "backend_torch", "backend_jax", "backend_mlx")
TOOLS = {"nox"}  # installed to run the README's two commands, not a dependency of anything
pytestmark = pytest.mark.skipif(not README.is_file(), reason="README.md is not beside this checkout")


def _name(requirement: str) -> str:
    """The normalized project name of a requirement: 'jax[cpu]>=0.4' -> 'jax'."""
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _projects() -> dict:
    """folder -> its [project] table."""
    return {folder: tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"] for folder in FOLDERS}


def _table() -> dict:
    """README's distribution table: distribution name -> the names in its "depends on" cell."""
    rows = re.findall(r"^\| `(attnres-[a-z]+)` \(`attnres_[a-z]+`(?:, `attnres_[a-z]+`)*\) \|[^|]*\| ([^|]*) \|$",
                      README.read_text(), re.M)
    return {name: {_name(d) for d in deps.split(",")} for name, deps in rows}


def _install_lines():
    """(line, tokens) of every `pip install` command in README's bash blocks, comments cut."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.M | re.S):
        for line in block.splitlines():
            code = line.split("  #", 1)[0]
            for command in code.split("&&"):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    out.append((line, words[2:]))
    return out


def test_table_lists_every_distribution_with_its_declared_dependencies():
    projects, table = _projects(), _table()
    assert sorted(table) == sorted(p["name"] for p in projects.values()), table
    for folder, project in projects.items():
        declared = {_name(r) for r in project.get("dependencies", [])}
        assert table[project["name"]] == declared, (folder, table[project["name"]], declared)


def test_no_backend_depends_on_the_suite():
    projects = _projects()
    for folder in ("backend_torch", "backend_jax", "backend_mlx"):
        assert "attnres-conformance" not in {_name(r) for r in projects[folder]["dependencies"]}, folder
        assert "attnres-conformance" not in _table()[projects[folder]["name"]]


def test_install_lines_name_only_declared_packages_and_extras():
    projects = _projects()
    depended_on = {_name(r) for p in projects.values() for r in p.get("dependencies", [])}
    lines = _install_lines()
    installed_folders = set()
    assert len(lines) >= 6, lines
    for line, words in lines:
        # options dropped, and the value of each long option (--index-url URL); -e's folder kept
        words = [w for i, w in enumerate(words) if not w.startswith("-") and not (i and words[i - 1].startswith("--"))]
        for word in words:
            folder, _, extras = word.partition("[")
            if folder.rstrip("/") in projects:
                declared = set(projects[folder.rstrip("/")].get("optional-dependencies", {}))
                asked = set(re.findall(r"\w+", extras))
                mentioned = set(re.findall(r"\[(\w+)\]", line.split("  #", 1)[1])) if "  #" in line else set()
                assert asked | mentioned <= declared, (line, asked | mentioned, declared)
                installed_folders.add(folder.rstrip("/"))
            else:
                assert _name(word) in depended_on | TOOLS, (line, word)
    assert installed_folders == set(FOLDERS), installed_folders
