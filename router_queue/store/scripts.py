"""The Lua scripts, assembled for Redis: each script's text after its
arguments' names and what it uses of the key layout (``keys.lua_layout``),
the webhook id and the record's fields (``lua_declared.py``, from
``webhooks/ids.py`` and ``requests/record.py``) and the shared definitions
in ``lua/lib/*.lua``, each lib file naming the files it uses
(``-- requires:``), and, for a script that owes workspace effects, where
they go: the ``lua/effects/*.lua`` its consistency model names
(``effects.py``), so the script is handed a target, not a flag. Redis has
no ``require``: this linker is it. A script error Redis answers names the
source file and line (``lib/ledger.lua:57``), not the assembled text's."""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

from . import keys
from .cluster import SlotScript, register_script
from .lua_declared import lua_admitted_fields, lua_webhook_id, lua_webhook_listed


class LuaLinkError(Exception):
    """A script or lib file that cannot be assembled: a name used and defined
    nowhere, a lib file using another it does not require, a requires cycle."""


def load_script(client: redis.Redis, name: str, args: tuple[str, ...] = (), target: str = ""):
    """Register ``lua/{name}.lua`` assembled (:func:`assemble`) with its
    arguments' names (``lua_arg_names``) and ``lua/effects/{target}.lua``,
    if named; its errors name their source line."""
    assembled = assemble(name, args, target)
    script = register_script(client, assembled.text)
    explained = _EXPLAINED.get(type(script))
    if explained is not None:  # (a test's stand-in stays as it is)
        script.__class__ = explained
        script.assembled = assembled
    return script


@dataclass(frozen=True)
class Definition:
    """A top-level ``local`` of a Lua text and its lines down to the next one."""

    name: str
    source: str  # the file under lua/ ("lib/ledger.lua"), or what generated it
    line: int  # its first line's number in ``source``
    text: str


@dataclass(frozen=True)
class LibFile:
    """A file of ``lua/lib/``: its name ("ledger"), the files it requires, its definitions."""

    name: str
    requires: tuple[str, ...]
    definitions: tuple[Definition, ...]


@dataclass(frozen=True)
class Assembled:
    """A script's text as Redis runs it, and where each of its lines comes from."""

    name: str
    text: str
    #: (first assembled line, source, that line's number in source), by first line.
    pieces: tuple[tuple[int, str, int], ...]

    def source_of(self, line: int) -> str:
        """``source:line`` for line ``line`` of the assembled text."""
        i = bisect.bisect_right([first for first, _, _ in self.pieces], line) - 1
        if i < 0:
            return f"{self.name}.lua (assembled):{line}"
        first, source, source_line = self.pieces[i]
        return f"{source}:{source_line + line - first}"


def _lua(path: str) -> str:
    return resources.files(__package__).joinpath("lua", path).read_text()


#: A top-level definition: ``local function name(`` or ``local NAME =``.
_DEFINITION = re.compile(r"^local (?:function )?([A-Za-z_][A-Za-z0-9_]*)")
_LUA_COMMENT = re.compile(r"--.*$", re.M)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"' + r"|'(?:\\.|[^'\\\n])*'")
#: A lib file's declaration of the lib files it uses, among its first comment lines.
_REQUIRES = re.compile(r"^-- requires:(.*)$", re.M)


def _definitions(text: str, source: str) -> tuple[Definition, ...]:
    """``text``'s top-level definitions, in order."""
    found: list[Definition] = []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        defined = _DEFINITION.match(line)
        if defined:
            found.append(Definition(defined.group(1), source, number, line))
        elif found:
            found[-1] = Definition(found[-1].name, source, found[-1].line, found[-1].text + line)
    return tuple(found)


def _words(text: str) -> set[str]:
    """The names ``text`` uses outside comments and strings."""
    return set(_WORD.findall(_STRING.sub('""', _LUA_COMMENT.sub("", text))))


@functools.cache
def lib_files() -> dict[str, LibFile]:
    """``lua/lib/*.lua`` by name (:func:`read_lib`)."""
    return read_lib(resources.files(__package__).joinpath("lua", "lib"))


def read_lib(folder: Any) -> dict[str, LibFile]:
    """The ``*.lua`` files of ``folder`` by name, each checked: a name it uses
    that another lib file defines is in a file it requires, and the requires
    name files that exist, without a cycle."""
    files: dict[str, LibFile] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".lua"):
            continue
        name, text = entry.name[:-4], entry.read_text()
        declared = _REQUIRES.search(text.split("\nlocal ", 1)[0])
        if not declared:
            raise LuaLinkError(f"lib/{entry.name}: no '-- requires:' line at its top (empty for none)")
        requires = tuple(r.strip() for r in declared.group(1).split(",") if r.strip())
        files[name] = LibFile(name, requires, _definitions(text, f"lib/{entry.name}"))
    owner: dict[str, str] = {}
    for lib in files.values():
        for d in lib.definitions:
            if d.name in owner:
                raise LuaLinkError(f"{d.source}:{d.line}: {d.name} is defined in lib/{owner[d.name]}.lua too")
            owner[d.name] = lib.name
    for lib in files.values():
        for required in lib.requires:
            if required not in files:
                raise LuaLinkError(f"lib/{lib.name}.lua requires {required!r}: there is no lib/{required}.lua")
        for d in lib.definitions:
            used = _words(d.text)
            for other, where in owner.items():
                if where != lib.name and where not in lib.requires and other in used:
                    at = d.line + next(i for i, line in enumerate(d.text.splitlines()) if other in _words(line))
                    raise LuaLinkError(f"{d.source}:{at}: {d.name} uses {other}, defined in lib/{where}.lua, "
                                       f"which lib/{lib.name}.lua does not require (add it to its '-- requires:')")
    _in_order(files)  # raises on a cycle
    return files


def _in_order(files: dict[str, LibFile]) -> list[str]:
    """The lib files' names, each after those it requires."""
    order: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise LuaLinkError(f"lib files require each other in a cycle: {' -> '.join(visiting + [name])}")
        visiting.append(name)
        for required in files[name].requires:
            visit(required)
        visiting.pop()
        order.append(name)

    for name in files:
        visit(name)
    return order


def _generated() -> tuple[tuple[str, str], ...]:
    """What Python generates for the scripts, as (text, what generated it);
    read at each load (a test may change a declaration)."""
    return ((keys.lua_layout(), "(generated: keys.lua_layout)"),
            (lua_webhook_id(), "(generated: lua_declared.lua_webhook_id)"),
            (lua_admitted_fields(), "(generated: lua_declared.lua_admitted_fields)"),
            (lua_webhook_listed(), "(generated: lua_declared.lua_webhook_listed)"))


@functools.cache
def _definitions_after(generated: tuple[tuple[str, str], ...]) -> tuple[Definition, ...]:
    """Every definition a script may use, in an order where each comes after
    those it uses: ``generated``'s, then the lib files' by their requires."""
    files = lib_files()
    return (tuple(d for text, source in generated for d in _definitions(text, source))
            + tuple(d for name in _in_order(files) for d in files[name].definitions))


def all_definitions() -> tuple[Definition, ...]:
    """Every definition a script may use, in order (:func:`_definitions_after`)."""
    return _definitions_after(_generated())


def lib_for(body: str) -> str:
    """The text of the definitions ``body`` uses (:func:`definitions_for`)."""
    return "".join(d.text for d in definitions_for(body))


def definitions_for(body: str) -> tuple[Definition, ...]:
    """:func:`_uses_of` among every definition a script may use."""
    return _uses_of(body, all_definitions())


def _uses_of(body: str, chunks: tuple[Definition, ...]) -> tuple[Definition, ...]:
    """The definitions ``body`` uses, and those they use, in dependency order.
    Redis runs a script's whole text on every call, so each of the lib's
    50-odd definitions would cost every call its closure (about 14 µs a call
    for all of them, measured); a script pays for what it uses. Names are
    matched as whole words outside comments and strings (no lib file has "--"
    inside a string)."""
    wanted: set[str] = set()
    pending = [body]
    while pending:
        words = _words(pending.pop())
        for d in chunks:
            if d.name not in wanted and d.name in words:
                wanted.add(d.name)
                pending.append(d.text)
    return tuple(d for d in chunks if d.name in wanted)


def assemble(name: str, args: tuple[str, ...] = (), target: str = "") -> Assembled:
    """:func:`_assemble`, for what Python generates now."""
    return _assemble(name, args, _generated(), target)


@functools.cache
def _assemble(name: str, args: tuple[str, ...], generated: tuple[tuple[str, str], ...], target: str) -> Assembled:
    return link(name, _lua(f"{name}.lua"), args, _definitions_after(generated) + target_definitions(target))


@functools.cache
def target_definitions(target: str) -> tuple[Definition, ...]:
    """``lua/effects/{target}.lua``'s definitions (none for ""): where a
    step's workspace effects go (``ws_target``), linked after the lib files,
    whose names they may use, and before the script, which calls them."""
    if not target:
        return ()
    path = f"effects/{target}.lua"
    return _definitions(_lua(path), path)


def link(name: str, body: str, args: tuple[str, ...], definitions: tuple[Definition, ...]) -> Assembled:
    """``body`` (script ``name``) as Redis runs it: its arguments' names, the
    ``definitions`` it uses (:func:`_uses_of`), then its own text; checked that
    every function it calls and every ``ARG_*`` it reads is defined."""
    parts: list[tuple[str, str, int]] = []
    if args:
        parts.append((lua_arg_names(args), "(generated: scripts.lua_arg_names)", 1))
    parts += [(d.text, d.source, d.line) for d in _uses_of(body, definitions)]
    parts.append((body, f"{name}.lua", 1))
    pieces, line = [], 1
    for text, source, first in parts:
        pieces.append((line, source, first))
        line += text.count("\n")
    assembled = Assembled(name, "".join(text for text, _, _ in parts), tuple(pieces))
    _check_defined(assembled)
    return assembled


#: What Redis's Lua offers every script (Lua 5.1's library, Redis's globals).
LUA_GLOBALS = frozenset(
    "assert error getmetatable ipairs next pairs pcall rawequal rawget rawset select setmetatable tonumber "
    "tostring type unpack xpcall string table math redis KEYS ARGV cjson cmsgpack bit struct".split())
_LUA_KEYWORDS = frozenset("and break do else elseif end false for function if in local nil not or repeat "
                          "return then true until while".split())
_CALLED = re.compile(r"(?<![\w.:])([A-Za-z_]\w*)\s*\(")
_DECLARED = (re.compile(r"\blocal\s+function\s+([A-Za-z_]\w*)"), re.compile(r"\blocal\s+([\w\s,]+?)\s*(?:=|$)", re.M),
             re.compile(r"\bfunction\s*[\w.:]*\s*\(([^)]*)\)"), re.compile(r"\bfor\s+([\w\s,]+?)\s+in\b"))


def _check_defined(assembled: Assembled) -> None:
    """Raise :class:`LuaLinkError` for a function called or an ``ARG_*`` read
    that nothing in ``assembled`` defines (a lib definition missing or renamed)."""
    code = _STRING.sub('""', _LUA_COMMENT.sub("", assembled.text))
    declared = set(LUA_GLOBALS)
    for pattern in _DECLARED:
        for found in pattern.findall(code):
            declared.update(n.strip() for n in found.split(","))
    lines = code.splitlines()
    for number, line in enumerate(lines, 1):
        for name in _CALLED.findall(line) + re.findall(r"\bARG_[A-Z0-9_]+\b", line):
            if name not in declared and name not in _LUA_KEYWORDS:
                raise LuaLinkError(f"{assembled.source_of(number)}: {name} is used by {assembled.name}.lua but "
                                   "defined nowhere (not in lua/lib/, the generated definitions, its arguments or "
                                   "its effects' target, lua/effects/)")


def lua_arg_names(args: tuple[str, ...]) -> str:
    """Lua constants naming a script's ARGV positions: ``ARG_ID`` for "id" and
    so on, in the order ``argv`` passes them, and ``ARG_REST``, the first ARGV
    after them (admit's rate windows). Constants, so a name costs a script
    nothing per call."""
    if not args:
        return ""
    return ("-- The arguments' positions (generated by router_queue/store/scripts.py, lua_arg_names)\n"
            + "".join(f"local ARG_{name.upper()} = {i}\n" for i, name in enumerate(args, 1))
            + f"local ARG_REST = {len(args) + 1}\n")


def argv(args: tuple[str, ...], **values: Any) -> list[Any]:
    """A script's ARGV: ``values`` in the order its names ``args`` declare
    (``load_script``). A name missing or not declared raises ``KeyError``."""
    if len(values) != len(args):
        raise KeyError(f"not declared: {sorted(values.keys() - set(args))}; missing: "
                       f"{[name for name in args if name not in values]}")
    return list(map(values.__getitem__, args))


#: A line of the script as Redis names it in an error ("user_script:12",
#: "@user_script:12"; fakeredis's Lua: '[string "<python>"]:12').
_ERROR_LINE = re.compile(r'@?(?:user_script|\[string "[^"\]]*"\]):(\d+)')


def explain(script: Any, error: redis.exceptions.ResponseError) -> redis.exceptions.ResponseError:
    """``error`` as ``script`` raised it (one :func:`load_script` made), its
    assembled line numbers named as their source's (``lib/ledger.lua:57``);
    any other error as it is."""
    assembled = getattr(script, "assembled", None)
    message = str(error)
    if assembled is None or isinstance(error, redis.exceptions.NoScriptError) or not _ERROR_LINE.search(message):
        return error
    text = _ERROR_LINE.sub(lambda m: assembled.source_of(int(m.group(1))), message)
    return type(error)(f"{text} (in {assembled.name}.lua as assembled by store/scripts.py)")


class _Explained:
    """A script whose errors name their source lines: the ``try`` costs a call
    nothing; the translation runs only on an error."""

    assembled: Assembled

    def __call__(self, keys=None, args=None, client=None):
        try:
            return super().__call__(keys, args, client)
        except redis.exceptions.NoScriptError:
            raise
        except redis.exceptions.ResponseError as error:
            raise explain(self, error) from None


class ExplainedScript(_Explained, Script):
    """redis-py's script, its errors explained."""


class ExplainedSlotScript(_Explained, SlotScript):
    """A cluster's script (``cluster.SlotScript``), its errors explained."""


#: The script kinds ``register_script`` makes, and each one explained.
_EXPLAINED: dict[type, type] = {Script: ExplainedScript, SlotScript: ExplainedSlotScript}
