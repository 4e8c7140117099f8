-- key_rotate.lua: a successor for an API key, in one step: the new key (same
-- workspace, label and, for a legacy key, namespace), and the old one's end
-- at the close of the overlap (its rq:apikey and record expire then), or now;
-- the old key's channel (keys.key_events_channel) tells the connections held
-- open with it to check it again (and so learn when it stops).
--
-- KEYS[1] the old rq:apikey  KEYS[2] the old rq:key record
-- KEYS[3] the new rq:apikey  KEYS[4] the new rq:key record
-- KEYS[5] rq:keys:{workspace}  KEYS[6] rq:keyaudit:{workspace}
-- ARGV by name (ARGV[ARG_WORKSPACE] and so on; apikeys.py, ROTATE_ARGS):
--   workspace: what both keys resolve to (the workspace id, or "-")
--   old_id  old_hash (its SHA-256)  new_id  new_hash  now (s)  label
--   namespace: a legacy key's, else ""
--   until: when the old key stops (Unix s), until_ms the same in ms; both ""
--          when it stops at once
--   audit_line (JSON)  audit_kept: audit lines kept
-- returns {"ROTATED"} | {"MISSING"} | {"TAKEN"}
--       | {"ROTATED_ALREADY", its successor's id, when it stops (s)}

if redis.call("GET", KEYS[1]) ~= ARGV[ARG_WORKSPACE] then
  return {"MISSING"}
end
if redis.call("PTTL", KEYS[1]) >= 0 then
  local old = redis.call("HMGET", KEYS[2], "rotated_to", "expires_at")
  return {"ROTATED_ALREADY", old[1] or "", old[2] or ""}
end
if not redis.call("SET", KEYS[3], ARGV[ARG_WORKSPACE], "NX") then
  return {"TAKEN"}
end
redis.call("HSET", KEYS[4], "workspace", ARGV[ARG_WORKSPACE], "hash", ARGV[ARG_NEW_HASH], "label", ARGV[ARG_LABEL], "created_at", ARGV[ARG_NOW],
  "rotated_from", ARGV[ARG_OLD_ID])
if ARGV[ARG_NAMESPACE] ~= "" then
  redis.call("HSET", KEYS[4], "namespace", ARGV[ARG_NAMESPACE])
end
redis.call("ZREMRANGEBYSCORE", KEYS[5], "-inf", ARGV[ARG_NOW])  -- rotated-out keys past their overlap
redis.call("ZADD", KEYS[5], "+inf", ARGV[ARG_NEW_ID])
if ARGV[ARG_UNTIL] == "" then
  redis.call("DEL", KEYS[1], KEYS[2])
  redis.call("ZREM", KEYS[5], ARGV[ARG_OLD_ID])
else
  -- a key minted before the index has no record yet: these fields make one
  redis.call("HSET", KEYS[2], "workspace", ARGV[ARG_WORKSPACE], "hash", ARGV[ARG_OLD_HASH], "rotated_to", ARGV[ARG_NEW_ID],
    "expires_at", ARGV[ARG_UNTIL])
  redis.call("PEXPIREAT", KEYS[1], ARGV[ARG_UNTIL_MS])
  redis.call("PEXPIREAT", KEYS[2], ARGV[ARG_UNTIL_MS])
  redis.call("ZADD", KEYS[5], ARGV[ARG_UNTIL], ARGV[ARG_OLD_ID])
end
redis.call("LPUSH", KEYS[6], ARGV[ARG_AUDIT_LINE])
redis.call("LTRIM", KEYS[6], 0, tonumber(ARGV[ARG_AUDIT_KEPT]) - 1)
redis.call("PUBLISH", KEY_APIKEY_EVENTS .. ARGV[ARG_OLD_ID], "ROTATED")
return {"ROTATED"}
