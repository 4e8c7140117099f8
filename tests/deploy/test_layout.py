"""The README's architecture tree is the code's tree, file for file, and the
packages depend one way: workers on router_queue, never the reverse."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router_queue", "workers")


def _readme_tree() -> set[str]:
    """Every path the README's architecture block lists under our packages."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("\n## Architecture\n", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    listed: set[str] = set()
    parents: list[str] = []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0].split(" ")
        parents = parents[:depth]
        for name in names:
            path = "/".join([*parents, name.rstrip("/")])
            listed.add(path)
        if names[-1].endswith("/"):
            parents.append(names[-1].rstrip("/"))
    return {p for p in listed if p.split("/")[0] in PACKAGES}


def _is_docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def _code_tree() -> set[str]:
    found: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            relative = path.relative_to(ROOT)
            if "__pycache__" in relative.parts or path.suffix == ".pyc":
                continue
            if path.is_dir():
                found.add(str(relative))
            elif path.suffix in (".py", ".json") and not (path.name == "__init__.py" and _is_docstring_only(path)):
                found.add(str(relative))
    found.update(PACKAGES)
    return found - {p for p in found if "/lua/" in p or "/templates/" in p}


def test_the_readme_tree_lists_every_module_and_nothing_else():
    listed, present = _readme_tree(), _code_tree()
    assert not present - listed, f"in the code, not in the README's architecture tree: {sorted(present - listed)}"
    assert not listed - present, f"in the README's architecture tree, not in the code: {sorted(listed - present)}"


def test_router_queue_never_imports_workers():
    importers = []
    for path in (ROOT / "router_queue").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(m == "workers" or m.startswith("workers.") for m in modules):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == []


def test_the_serving_path_never_imports_the_dev_supervisor():
    for path in [*(ROOT / "router_queue" / "web").rglob("*.py"), ROOT / "router_queue" / "wsgi.py",
                 *(ROOT / "router_queue" / "store").rglob("*.py"), *(ROOT / "router_queue" / "broker").rglob("*.py")]:
        assert ".dev" not in re.findall(r"^\s*from (\S+) import", path.read_text(), re.M), path
        assert "router_queue.dev" not in path.read_text(), path


def test_only_the_store_knows_the_redis_key_layout():
    """The store is the only door to Redis: no module outside it builds a key
    (``store/keys.py``) or loads a script."""
    outside = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
               if "store" not in p.relative_to(ROOT).parts[:2] and "__pycache__" not in p.parts]
    offenders = []
    for path in outside:
        text = path.read_text()
        if re.search(r"^\s*from \S*store import keys|store\.keys|load_script", text, re.M):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
