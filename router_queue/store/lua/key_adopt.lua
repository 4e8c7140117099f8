-- key_adopt.lua: a key minted before keys had records and a per-workspace
-- index gets both (its creation time unknown), once; nothing else changes.
--
-- KEYS[1] rq:apikey:{sha256(key)}  KEYS[2] rq:key:{key id}  KEYS[3] rq:keys:{workspace}
-- ARGV by name (apikeys.py, ADOPT_ARGS): owner (what the key resolves to, read
--   just before; checked again here)  id (the key's)  hash (the key's SHA-256)
-- returns {"ADOPTED"} | {"KEPT"} (it has a record, or changed meanwhile)

if redis.call("GET", KEYS[1]) ~= ARGV[ARG_OWNER] or redis.call("EXISTS", KEYS[2]) == 1 then
  return {"KEPT"}
end
redis.call("HSET", KEYS[2], "workspace", ARGV[ARG_OWNER], "hash", ARGV[ARG_HASH], "label", "", "created_at", "")
redis.call("ZADD", KEYS[3], "+inf", ARGV[ARG_ID])
return {"ADOPTED"}
