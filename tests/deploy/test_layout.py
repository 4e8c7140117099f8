"""docs/ARCHITECTURE.md's tree of the code is the code's tree, file for file, and the
packages depend one way: workers on router_queue, never the reverse."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router_queue", "workers")


def _documented_tree() -> set[str]:
    """Every path docs/ARCHITECTURE.md's "The code, file by file" block lists under our packages."""
    document = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = document.split("\n## The code, file by file\n", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
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


def test_the_architecture_tree_lists_every_module_and_nothing_else():
    listed, present = _documented_tree(), _code_tree()
    assert not present - listed, f"in the code, not in docs/ARCHITECTURE.md's tree: {sorted(present - listed)}"
    assert not listed - present, f"in docs/ARCHITECTURE.md's tree, not in the code: {sorted(listed - present)}"


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


def _imports_of(path: Path, source: str | None = None) -> set[str]:
    """The router_queue modules ``path`` imports (or ``source`` would, there), as dotted names under router_queue."""
    package = list(path.relative_to(ROOT / "router_queue").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
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
BASE = {"errors", "states", "logs", "validation", "schemas", "redis_urls", "provider_credentials", "provider_pools",
        "settings", "urls"}
#: What each module never imports, by dotted name under router_queue ("x.*":
#: the package x and every module in it; the most specific pattern of a module
#: that matches it holds). The packages depend one way, from the entry points
#: (cli, wsgi, dev) through web, webhooks and services down to store and the base.
_ENTRY = {"cli.*", "dev.*", "wsgi"}
NEVER = {
    "catalog": {"store.*", "broker.*", "services", "webhooks.*", "web.*", "tracing", *_ENTRY},
    "tracing": {"store.*", "broker.*", "services", "webhooks.*", "web.*", *_ENTRY},
    "store.*": {"broker.*", "services", "webhooks.*", "web.*", *_ENTRY},
    "blobs.*": {"store.*", "broker.*", "services", "webhooks.*", "web.*", *_ENTRY},
    "broker.*": {"services", "webhooks.*", "web.*", *_ENTRY},
    "services": {"webhooks.*", "web.*", *_ENTRY},
    # the feature's leaves (the body, the URL checks, the retry schedule) read no store and no services
    "webhooks.event": {"store.*", "broker.*", "services", "webhooks.delivery", "web.*", *_ENTRY},
    "webhooks.safety": {"store.*", "broker.*", "services", "webhooks.delivery", "web.*", *_ENTRY},
    "webhooks.lookup": {"store.*", "broker.*", "services", "webhooks.delivery", "web.*", *_ENTRY},
    "webhooks.retry_policy": {"store.*", "broker.*", "services", "webhooks.delivery", "web.*", *_ENTRY},
    "webhooks.*": {"web.*", *_ENTRY},
    "web.*": set(_ENTRY),
    "dev.*": {"cli.*", "wsgi"},
}


def _matches(name: str, pattern: str) -> bool:
    """``name`` is ``pattern``, or in the package ``pattern`` names by ``x.*``."""
    if pattern.endswith(".*"):
        return name == pattern[:-2] or name.startswith(pattern[:-1])
    return name == pattern


def _never_for(module: str) -> set[str]:
    """The patterns ``module`` never imports: its most specific rule's (an exact name over a package's)."""
    rules = sorted((p for p in NEVER if _matches(module, p)), key=lambda p: (p.endswith(".*"), -len(p)))
    return NEVER[rules[0]] if rules else set()


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT / "router_queue").with_suffix("").parts).removesuffix(".__init__")


def layer_offenders(paths, source: str | None = None) -> list[tuple[str, list[str]]]:
    """(file, the modules it imports against the rules above) for each offending file of ``paths``
    (or for ``source`` in its place)."""
    offenders = []
    for path in paths:
        module = _module_of(path)
        part = module.split(".")[0]
        imported = {name for name in _imports_of(path, source) if name.split(".")[0] != part}
        above_base = sorted(name for name in imported if name.split(".")[0] not in BASE)
        if part in BASE and above_base:
            offenders.append((str(path.relative_to(ROOT)), above_base))
        never = _never_for(module)
        against = sorted(name for name in _imports_of(path, source) if any(_matches(name, p) for p in never))
        if against:
            offenders.append((str(path.relative_to(ROOT)), against))
    return offenders


def test_low_layers_import_nothing_above_them():
    assert layer_offenders((ROOT / "router_queue").rglob("*.py")) == []


@pytest.mark.parametrize(("module", "line"), [
    ("store/requests.py", "from ..webhooks.event import PROGRESS_EVENT_EVERY_S"),
    ("store/webhooks.py", "from ..webhooks.endpoints import origin"),
    ("store/accounts.py", "from router_queue.webhooks import event"),
    ("webhooks/event.py", "from ..store import keys"),
    ("urls.py", "from .store import keys"),
])
def test_the_rule_refuses_the_imports_that_ran_back_up(module, line):
    """The store read two of the webhooks feature's modules once; the rule names modules, so it refuses them."""
    path = ROOT / "router_queue" / module
    assert [found for _, found in layer_offenders([path], source=line)] != []


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


#: Lines a module of the service's packages may have: past it, a module holds more than one job.
MODULE_LINES = 600


def test_no_module_holds_more_than_one_job():
    """A module over ``MODULE_LINES`` is split by who calls it (as the request store is)."""
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
             for package in PACKAGES for path in (ROOT / package).rglob("*.py") if "__pycache__" not in path.parts}
    assert sizes, "no modules found"
    offenders = {path: lines for path, lines in sizes.items() if lines > MODULE_LINES}
    assert not offenders, f"modules over {MODULE_LINES} lines (split them): {offenders}"


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
