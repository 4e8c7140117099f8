-- key_revoke.lua: an API key stops working (every front door refuses it once
-- its cache of resolved keys, a few seconds at most, has let it go); its
-- record leaves the index and the audit line is written, in one step, and
-- the key's channel (keys.key_events_channel) tells the connections held open
-- with it (event streams, synchronous calls) to check it again now.
--
-- KEYS[1] rq:apikey:{sha256(key)}  KEYS[2] rq:key:{key id}
-- KEYS[3] rq:keys:{workspace}      KEYS[4] rq:keyaudit:{workspace}
-- ARGV[1] what the key resolves to (the workspace id, or "-")  ARGV[2] key id
-- ARGV[3] the audit line (JSON)  ARGV[4] audit lines kept
-- returns {"REVOKED"} | {"MISSING"} (revoked already, past its rotation's
--         overlap, or another workspace's)

if redis.call("GET", KEYS[1]) ~= ARGV[1] then
  return {"MISSING"}
end
redis.call("DEL", KEYS[1], KEYS[2])
redis.call("ZREM", KEYS[3], ARGV[2])
redis.call("LPUSH", KEYS[4], ARGV[3])
redis.call("LTRIM", KEYS[4], 0, tonumber(ARGV[4]) - 1)
redis.call("PUBLISH", KEY_APIKEY_EVENTS .. ARGV[2], "REVOKED")
return {"REVOKED"}
