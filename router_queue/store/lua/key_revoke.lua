-- key_revoke.lua: an API key stops working (every front door refuses it once
-- its cache of resolved keys, a few seconds at most, has let it go); its
-- record leaves the index and the audit line is written, in one step, and
-- the key's channel (keys.key_events_channel) tells the connections held open
-- with it (event streams, synchronous calls) to check it again now.
--
-- KEYS[1] rq:apikey:{sha256(key)}  KEYS[2] rq:key:{key id}
-- KEYS[3] rq:keys:{workspace}      KEYS[4] rq:keyaudit:{workspace}
-- ARGV by name (apikeys.py, REVOKE_ARGS): owner (what the key resolves to: the
--   workspace id, or "-")  id (the key's)  audit_line (JSON)  audit_kept (lines kept)
-- returns {"REVOKED"} | {"MISSING"} (revoked already, past its rotation's
--         overlap, or another workspace's)

if redis.call("GET", KEYS[1]) ~= ARGV[ARG_OWNER] then
  return {"MISSING"}
end
redis.call("DEL", KEYS[1], KEYS[2])
redis.call("ZREM", KEYS[3], ARGV[ARG_ID])
redis.call("LPUSH", KEYS[4], ARGV[ARG_AUDIT_LINE])
redis.call("LTRIM", KEYS[4], 0, tonumber(ARGV[ARG_AUDIT_KEPT]) - 1)
redis.call("PUBLISH", KEY_APIKEY_EVENTS .. ARGV[ARG_ID], "REVOKED")
return {"REVOKED"}
