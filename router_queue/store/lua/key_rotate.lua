-- key_rotate.lua: a successor for an API key, in one step: the new key (same
-- workspace, label and, for a legacy key, namespace), and the old one's end
-- at the close of the overlap (its rq:apikey and record expire then), or now.
--
-- KEYS[1] the old rq:apikey  KEYS[2] the old rq:key record
-- KEYS[3] the new rq:apikey  KEYS[4] the new rq:key record
-- KEYS[5] rq:keys:{workspace}  KEYS[6] rq:keyaudit:{workspace}
-- ARGV[1] what both keys resolve to (the workspace id, or "-")
-- ARGV[2] old key id  ARGV[3] old key's SHA-256  ARGV[4] new key id
-- ARGV[5] new key's SHA-256  ARGV[6] now (s)  ARGV[7] label
-- ARGV[8] a legacy key's namespace, else ""
-- ARGV[9] when the old key stops (Unix s), ARGV[10] the same in ms; both ""
--         when it stops at once
-- ARGV[11] the audit line (JSON)  ARGV[12] audit lines kept
-- returns {"ROTATED"} | {"MISSING"} | {"TAKEN"}
--       | {"ROTATED_ALREADY", its successor's id, when it stops (s)}

if redis.call("GET", KEYS[1]) ~= ARGV[1] then
  return {"MISSING"}
end
if redis.call("PTTL", KEYS[1]) >= 0 then
  local old = redis.call("HMGET", KEYS[2], "rotated_to", "expires_at")
  return {"ROTATED_ALREADY", old[1] or "", old[2] or ""}
end
if not redis.call("SET", KEYS[3], ARGV[1], "NX") then
  return {"TAKEN"}
end
redis.call("HSET", KEYS[4], "workspace", ARGV[1], "hash", ARGV[5], "label", ARGV[7], "created_at", ARGV[6],
  "rotated_from", ARGV[2])
if ARGV[8] ~= "" then
  redis.call("HSET", KEYS[4], "namespace", ARGV[8])
end
redis.call("ZREMRANGEBYSCORE", KEYS[5], "-inf", ARGV[6])  -- rotated-out keys past their overlap
redis.call("ZADD", KEYS[5], "+inf", ARGV[4])
if ARGV[9] == "" then
  redis.call("DEL", KEYS[1], KEYS[2])
  redis.call("ZREM", KEYS[5], ARGV[2])
else
  -- a key minted before the index has no record yet: these fields make one
  redis.call("HSET", KEYS[2], "workspace", ARGV[1], "hash", ARGV[3], "rotated_to", ARGV[4],
    "expires_at", ARGV[9])
  redis.call("PEXPIREAT", KEYS[1], ARGV[10])
  redis.call("PEXPIREAT", KEYS[2], ARGV[10])
  redis.call("ZADD", KEYS[5], ARGV[9], ARGV[2])
end
redis.call("LPUSH", KEYS[6], ARGV[11])
redis.call("LTRIM", KEYS[6], 0, tonumber(ARGV[12]) - 1)
return {"ROTATED"}
