-- luacheck's settings for the Redis scripts (router_queue/store/lua). Redis
-- has no `require`: a script runs with the definitions of lua/lib/*.lua it
-- uses in front of it (store/scripts.py, the linker), so luacheck checks each
-- script as Redis runs it, assembled, and names each warning's source file and
-- line: `python3 -m pytest tests/unit/test_luacheck.py` (scripts/test installs
-- luacheck; the test is skipped where it is missing).
std = "lua51"
-- What Redis gives every script.
read_globals = {"redis", "KEYS", "ARGV", "cjson", "cmsgpack", "bit", "struct"}
-- A script's argument positions are generated for every name its caller
-- passes (scripts.lua_arg_names), ARG_REST included, read or not.
ignore = {"211/ARG_.*"}
max_line_length = 160
