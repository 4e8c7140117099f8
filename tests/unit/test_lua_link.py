"""The Lua linker (store/scripts.py): lib files resolved by what each
declares it requires, a name used and defined nowhere refused at load, and
a script's error naming the source file and line it came from."""

from __future__ import annotations

from importlib import resources

import pytest
import redis

from router_queue.store import scripts
from router_queue.store.connect import queue_script
from router_queue.store.scripts import LuaLinkError, load_script, read_lib

LIB = resources.files("router_queue.store").joinpath("lua", "lib")


def _line_of(path: str, text: str) -> int:
    """The number of the line of lua/``path`` holding ``text``."""
    lines = resources.files("router_queue.store").joinpath("lua", path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


@pytest.fixture
def script_text(monkeypatch):
    """Load ``lua/{name}.lua`` with the text given for a name starting "test_"."""
    texts: dict[str, str] = {}
    real = scripts._lua
    monkeypatch.setattr(scripts, "_lua", lambda path: texts.get(path) or real(path))
    return texts


def test_an_error_in_a_lib_definition_names_its_lib_file_and_line(client, script_text):
    script_text["test_lib_error.lua"] = "-- test_lib_error.lua\nreturn read_fields(KEYS[1], nil)\n"
    with pytest.raises(redis.exceptions.ResponseError) as raised:
        load_script(client, "test_lib_error")(keys=["k"])
    assert f"lib/util.lua:{_line_of('lib/util.lua', 'local all = {unpack(names)}')}" in str(raised.value)


def test_an_error_in_a_script_names_the_script_and_its_own_line(client, script_text):
    script_text["test_own_error.lua"] = ("-- test_own_error.lua\nlocal fields = {}\nappend(fields, ARGV[ARG_N])\n"
                                         "error('no ' .. fields[1])\nreturn fields\n")
    with pytest.raises(redis.exceptions.ResponseError) as raised:
        load_script(client, "test_own_error", ("n",))(keys=["k"], args=["1"])
    assert "test_own_error.lua:4: no 1" in str(raised.value)


def test_a_script_that_runs_is_answered_as_before(client, script_text):
    script_text["test_fine.lua"] = "local f = {}\nappend(f, ARGV[ARG_A], ARGV[ARG_B])\nreturn f\n"
    assert load_script(client, "test_fine", ("a", "b"))(keys=["k"], args=["x", "y"]) == [b"x", b"y"]


def test_a_function_defined_nowhere_is_refused_at_load_naming_its_line(client, script_text):
    script_text["test_undefined.lua"] = "local x = 1\nreturn reed_fields(KEYS[1], {'a'})\n"
    with pytest.raises(LuaLinkError, match=r"test_undefined\.lua:2: reed_fields is used by test_undefined\.lua"):
        load_script(client, "test_undefined")


def test_an_argument_name_not_declared_is_refused_at_load(client, script_text):
    script_text["test_arg.lua"] = "return ARGV[ARG_NOWHERE]\n"
    with pytest.raises(LuaLinkError, match="ARG_NOWHERE"):
        load_script(client, "test_arg", ("somewhere",))


def test_a_script_carries_a_lib_files_requirements_before_it(script_text):
    script_text["test_order.lua"] = "return settle({}, 'charge', {}, {})\n"
    assembled = scripts.assemble("test_order")
    sources = [source for _, source, _ in assembled.pieces]
    assert sources == ["lib/util.lua", "lib/ledger.lua", "test_order.lua"]  # append, then settle
    assert assembled.source_of(len(assembled.text.splitlines())) == "test_order.lua:1"


def _lib(tmp_path, **files: str):
    for name, text in files.items():
        (tmp_path / f"{name}.lua").write_text(text)
    return read_lib(tmp_path)


def test_a_lib_file_using_another_it_does_not_require_is_refused(tmp_path):
    with pytest.raises(LuaLinkError, match=r"lib/b\.lua:4: g uses f, defined in lib/a\.lua, which lib/b\.lua "
                                           r"does not require"):
        _lib(tmp_path, a="-- requires:\nlocal function f() end\n",
             b="-- requires:\n\nlocal function g()\n  return f()\nend\n")
    assert _lib(tmp_path, b="-- requires: a\n\nlocal function g()\n  return f()\nend\n")["b"].requires == ("a",)


def test_lib_files_without_a_requires_line_or_in_a_cycle_are_refused(tmp_path):
    with pytest.raises(LuaLinkError, match="no '-- requires:' line"):
        _lib(tmp_path, a="local function f() end\n")
    with pytest.raises(LuaLinkError, match="cycle"):
        _lib(tmp_path, a="-- requires: b\nlocal function f() return g() end\n",
             b="-- requires: a\nlocal function g() return f() end\n")
    with pytest.raises(LuaLinkError, match="there is no lib/c.lua"):
        _lib(tmp_path, a="-- requires: c\nlocal function f() end\n", b="-- requires:\n")


def test_the_shipped_lib_files_link():
    assert set(read_lib(LIB)) >= {"util", "ledger", "schedule", "webhooks", "history", "admission"}


def test_no_lua_file_is_over_400_lines():
    lua = resources.files("router_queue.store").joinpath("lua")
    files = [*lua.iterdir(), *LIB.iterdir()]
    long = {f.name: n for f in files if f.name.endswith(".lua") and (n := len(f.read_text().splitlines())) > 400}
    assert len(files) > 40 and not long


def test_an_error_from_a_pipelined_script_is_explained_by_its_caller(client, script_text):
    script_text["test_piped.lua"] = "local n = 1\nerror('piped ' .. n)\n"
    script = load_script(client, "test_piped")
    with pytest.raises(redis.exceptions.ResponseError):
        script(keys=["k"])  # loads it
    pipe = client.pipeline(transaction=False)
    queue_script(pipe, script, ["k"], [])
    with pytest.raises(redis.exceptions.ResponseError) as raised:
        pipe.execute()
    assert "test_piped.lua:2: piped 1" in str(scripts.explain(script, raised.value))
    assert scripts.explain(object(), raised.value) is raised.value  # not one of ours: as it is
