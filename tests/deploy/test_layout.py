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


def _imports_of(path: Path) -> set[str]:
    """The router_queue modules ``path`` imports, as dotted names under router_queue."""
    package = list(path.relative_to(ROOT / "router_queue").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("router_queue."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("router_queue."):
            found.add(node.module.split(".", 1)[1])
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            if node.module:
                found.add(".".join([*base, node.module]))
            else:
                found.update(".".join([*base, a.name]) for a in node.names)
    return {name for name in found if name}


#: The bottom layer: the settings and what they read with; none imports
#: anything of ours outside this set.
BASE = {"errors", "states", "logs", "validation", "schemas", "redis_urls", "provider_credentials", "settings"}
#: What each part never imports: the packages depend one way, from the entry
#: points (cli, wsgi, dev) through web and services down to store and the base.
NEVER = {
    "catalog": {"store", "broker", "services", "webhooks", "web", "cli", "dev", "wsgi", "tracing"},
    "tracing": {"store", "broker", "services", "webhooks", "web", "cli", "dev", "wsgi"},
    # the store may read the webhooks feature's leaf modules (event kinds, an endpoint's origin)
    "store": {"broker", "services", "web", "cli", "dev", "wsgi"},
    "blobs": {"store", "broker", "services", "webhooks", "web", "cli", "dev", "wsgi"},
    "broker": {"services", "webhooks", "web", "cli", "dev", "wsgi"},
    "services": {"web", "cli", "dev", "wsgi"},
    "webhooks": {"web", "cli", "dev", "wsgi"},
    "web": {"cli", "dev", "wsgi"},
    "dev": {"cli", "wsgi"},
}


def test_low_layers_import_nothing_above_them():
    offenders = []
    for path in (ROOT / "router_queue").rglob("*.py"):
        part = path.relative_to(ROOT / "router_queue").parts[0].removesuffix(".py")
        imported = {name.split(".")[0] for name in _imports_of(path)} - {part}
        if part in BASE and imported - BASE:
            offenders.append((str(path.relative_to(ROOT)), sorted(imported - BASE)))
        if imported & NEVER.get(part, set()):
            offenders.append((str(path.relative_to(ROOT)), sorted(imported & NEVER[part])))
    assert offenders == []


def test_the_cli_builds_its_services_without_the_flask_app():
    import subprocess
    import sys
    probe = "import sys, router_queue.cli; print(sorted(m for m in sys.modules if m in " \
            "('router_queue.web.app', 'router_queue.wsgi', 'router_queue.web.lane')))"
    shown = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "[]"


#: The packages whose docstrings are reference, not essays (the narrative is in docs/).
DOCUMENTED = ("router_queue", "workers", "bench")
#: Lines a docstring may span, its quotes included.
DOCSTRING_LINES = 12


def test_no_docstring_runs_to_an_essay():
    """A module's, class's or function's docstring says what it is, why, and
    its non-obvious contract; history, measurements and long explanations go
    to docs/ (ARCHITECTURE.md, KEYS.md)."""
    offenders = []
    for package in DOCUMENTED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                first = node.body[0] if node.body else None
                if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                        and isinstance(first.value.value, str)):
                    continue
                lines = first.end_lineno - first.lineno + 1
                if lines > DOCSTRING_LINES:
                    offenders.append(f"{path.relative_to(ROOT)}:{first.lineno} "
                                     f"{getattr(node, 'name', '<module>')} ({lines} lines)")
    assert not offenders, f"docstrings over {DOCSTRING_LINES} lines (move the narrative to docs/): {offenders}"


def _key_pattern(function) -> str | None:
    """A regex for the key ``function`` builds, its family's tag left out and
    each parameter any ``{placeholder}`` (``keys.request``: ``:req:{id}``);
    None when it builds no key from placeholders."""
    import inspect

    marks = [f"{{{name}}}" for name in inspect.signature(function).parameters]
    try:
        built = function(*marks)
    except (TypeError, IndexError, ValueError):
        return None
    if not isinstance(built, str) or not built.startswith("{") or "}:" not in built:
        return None
    parts = [built.split("}:", 1)[1]]
    for mark in marks:
        parts = [piece for part in parts for piece in _split_keeping(part, mark)]
    return ":" + "".join(r"\{[^}`]*\}" if part in marks else re.escape(part) for part in parts)


def _split_keeping(text: str, mark: str) -> list[str]:
    pieces = text.split(mark)
    out = [pieces[0]]
    for piece in pieces[1:]:
        out += [mark, piece]
    return [piece for piece in out if piece]


def test_every_key_builder_is_in_the_key_layout_document():
    """docs/KEYS.md names every public function of store/keys.py (each key's
    builder, the prefixes and the Lua layout), or shows the key it builds."""
    import inspect

    from router_queue.store import keys

    document = (ROOT / "docs" / "KEYS.md").read_text()
    builders = [name for name, function in inspect.getmembers(keys, inspect.isfunction)
                if function.__module__ == keys.__name__ and not name.startswith("_")]
    assert len(builders) > 40, builders  # the enumeration itself still finds them
    missing = []
    for name in builders:
        pattern = _key_pattern(getattr(keys, name))
        if not re.search(rf"\b{name}\(", document) and not (pattern and re.search(pattern + "`", document)):
            missing.append(name)
    assert not missing, f"store/keys.py functions docs/KEYS.md neither names nor shows the key of: {missing}"


def _bench_imports(path: Path) -> set[str]:
    """The bench modules ``path`` imports (``from . import core``, ``from .core import ...``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith("bench")):
            module = (node.module or "").removeprefix("bench").lstrip(".")
            found.update([module] if module else [a.name for a in node.names])
    return found


def test_the_bench_has_one_core_and_no_import_circle():
    """bench/core.py imports no phase module, the phase modules never import
    each other in a circle, and there is one MeasurementError (core's)."""
    modules = {path.stem: _bench_imports(path) for path in (ROOT / "bench").glob("*.py")}
    assert modules["core"] == set(), modules["core"]

    def reaches(start: str, seen: set[str]) -> set[str]:
        for name in modules.get(start, set()) - seen:
            seen.add(name)
            reaches(name, seen)
        return seen

    circles = sorted(name for name in modules if name in reaches(name, set()))
    assert circles == [], f"bench modules that import themselves through others: {circles}"
    errors = [path.name for path in (ROOT / "bench").glob("*.py")
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.ClassDef) and node.name.endswith("Error")]
    assert errors == ["core.py"], errors


def _test_modules_imported_by(path: Path) -> set[str]:
    """The test modules (``test_*``) that ``path`` imports, however it names them."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            modules = [base] + [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        else:
            continue
        found |= {module for module in modules if module.rsplit(".", 1)[-1].startswith("test_")}
    return found


def test_no_test_module_imports_another():
    """A helper two test modules share lives in a support module (``*_support.py``,
    ``support.py``, ``harness.py``), never in one of the test modules."""
    reaching = {str(path.relative_to(ROOT)): sorted(imported)
                for path in sorted((ROOT / "tests").rglob("*.py"))
                if (imported := _test_modules_imported_by(path))}
    assert not reaching, f"test modules imported by other modules: {reaching}"
