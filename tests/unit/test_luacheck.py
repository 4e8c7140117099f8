"""luacheck (``.luacheckrc``) on every Lua file, as Redis runs it: each
script assembled by the linker (store/scripts.py), and the lib files' every
definition, each warning named by its source file and line. Skipped where
luacheck is missing (scripts/test installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest

from router_queue.store import scripts

ROOT = Path(__file__).resolve().parents[2]
LUA = resources.files("router_queue.store").joinpath("lua")
_WARNING = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<message>.*)$")


def _args(text: str) -> tuple[str, ...]:
    """The argument names ``text`` reads (``ARG_*``), as its caller would pass them."""
    return tuple(sorted({name.lower() for name in re.findall(r"\bARG_([A-Z0-9_]+)\b", text)} - {"rest"}))


#: Where a step's workspace effects go (lua/effects/): a script that owes them is linked with one.
TARGETS = sorted(p.name[:-4] for p in LUA.joinpath("effects").iterdir() if p.name.endswith(".lua"))


def _assembled() -> list[scripts.Assembled]:
    """Every script as Redis runs it (one that owes workspace effects, once
    per target), and a stand-in script using every lib definition."""
    definitions = scripts.all_definitions()
    found = []
    for entry in sorted(LUA.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".lua"):
            body = entry.read_text()
            targets = TARGETS if re.search(r"\bws_target\b", body) else [""]
            for target in targets:
                found.append(scripts.link(entry.name[:-4], body, _args(body + scripts.lib_for(body)),
                                          definitions + scripts.target_definitions(target)))
    every = "return {\n" + "".join(f"  {d.name},\n" for d in definitions) + "}\n"
    found.append(scripts.link("(every lib definition)", every, _args(scripts.lib_for(every)), definitions))
    return found


def luacheck_warnings(tmp: Path) -> list[str]:
    """luacheck's warnings on every assembled script, each as ``source:line:col: message``."""
    assembled = {f"{i:02d}.lua": a for i, a in enumerate(_assembled())}
    for file, a in assembled.items():
        (tmp / file).write_text(a.text)
    run = subprocess.run(["luacheck", "--config", str(ROOT / ".luacheckrc"), "--formatter", "plain", "--codes",
                          *assembled], cwd=tmp, capture_output=True, text=True, timeout=120)
    if run.returncode > 1:  # 1: warnings; more: errors (syntax, I/O)
        found = run.stdout + run.stderr
    else:
        found = run.stdout
    warnings = set()
    for line in found.splitlines():
        m = _WARNING.match(line)
        if m and m.group("file") in assembled:
            where = assembled[m.group("file")].source_of(int(m.group("line")))
            warnings.add(f"{where}:{m.group('col')}: {m.group('message')}")
        elif line.strip():
            warnings.add(line)
    return sorted(warnings)


@pytest.mark.skipif(shutil.which("luacheck") is None, reason="luacheck is not installed (scripts/test installs it)")
def test_luacheck_finds_nothing_in_any_lua_file(tmp_path):
    warnings = luacheck_warnings(tmp_path)
    assert not warnings, "luacheck:\n" + "\n".join(warnings)
