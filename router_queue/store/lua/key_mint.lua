-- key_mint.lua: a new API key, its record, its place in its workspace's key
-- index and the audit line, in one step.
--
-- KEYS[1] rq:apikey:{sha256(key)}  KEYS[2] rq:key:{key id}
-- KEYS[3] rq:keys:{workspace}      KEYS[4] rq:keyaudit:{workspace}
-- KEYS[5] rq:ws:{workspace}
-- ARGV[1] what the key resolves to: the workspace id, or "-" for a legacy key
-- ARGV[2] key id  ARGV[3] the key's SHA-256  ARGV[4] label  ARGV[5] now (s)
-- ARGV[6] the audit line (JSON)  ARGV[7] audit lines kept
-- ARGV[8] "1" when the workspace must exist (every key but a legacy one)
-- ARGV[9] a legacy key's namespace (its own pseudo-workspace), else ""
-- returns {"MINTED"} | {"MISSING"} (no such workspace)
--       | {"TAKEN"} (the hash is known already: never, for 256-bit keys)

if ARGV[8] == "1" and redis.call("EXISTS", KEYS[5]) == 0 then
  return {"MISSING"}
end
if not redis.call("SET", KEYS[1], ARGV[1], "NX") then
  return {"TAKEN"}
end
redis.call("HSET", KEYS[2], "workspace", ARGV[1], "hash", ARGV[3], "label", ARGV[4], "created_at", ARGV[5])
if ARGV[9] ~= "" then
  redis.call("HSET", KEYS[2], "namespace", ARGV[9])
end
redis.call("ZREMRANGEBYSCORE", KEYS[3], "-inf", ARGV[5])  -- rotated-out keys past their overlap
redis.call("ZADD", KEYS[3], "+inf", ARGV[2])
redis.call("LPUSH", KEYS[4], ARGV[6])
redis.call("LTRIM", KEYS[4], 0, tonumber(ARGV[7]) - 1)
return {"MINTED"}
