-- key_mint.lua: a new API key, its record, its place in its workspace's key
-- index and the audit line, in one step.
--
-- KEYS[1] rq:apikey:{sha256(key)}  KEYS[2] rq:key:{key id}
-- KEYS[3] rq:keys:{workspace}      KEYS[4] rq:keyaudit:{workspace}
-- KEYS[5] rq:workspaces (the workspace must be one of them: a global key,
--         as the others here, so that the step reads no workspace's own keys)
-- ARGV by name (ARGV[ARG_WORKSPACE] and so on; apikeys.py, MINT_ARGS):
--   workspace: what the key resolves to, the workspace id, or "-" for a legacy key
--   id  hash (the key's SHA-256)  label  now (s)
--   audit_line (JSON)  audit_kept: audit lines kept
--   must_exist: "1" when the workspace must exist (every key but a legacy one)
--   namespace: a legacy key's (its own pseudo-workspace), else ""
-- returns {"MINTED"} | {"MISSING"} (no such workspace)
--       | {"TAKEN"} (the hash is known already: never, for 256-bit keys)

if ARGV[ARG_MUST_EXIST] == "1" and redis.call("SISMEMBER", KEYS[5], ARGV[ARG_WORKSPACE]) == 0 then
  return {"MISSING"}
end
if not redis.call("SET", KEYS[1], ARGV[ARG_WORKSPACE], "NX") then
  return {"TAKEN"}
end
redis.call("HSET", KEYS[2], "workspace", ARGV[ARG_WORKSPACE], "hash", ARGV[ARG_HASH], "label", ARGV[ARG_LABEL], "created_at", ARGV[ARG_NOW])
if ARGV[ARG_NAMESPACE] ~= "" then
  redis.call("HSET", KEYS[2], "namespace", ARGV[ARG_NAMESPACE])
end
redis.call("ZREMRANGEBYSCORE", KEYS[3], "-inf", ARGV[ARG_NOW])  -- rotated-out keys past their overlap
redis.call("ZADD", KEYS[3], "+inf", ARGV[ARG_ID])
redis.call("LPUSH", KEYS[4], ARGV[ARG_AUDIT_LINE])
redis.call("LTRIM", KEYS[4], 0, tonumber(ARGV[ARG_AUDIT_KEPT]) - 1)
return {"MINTED"}
