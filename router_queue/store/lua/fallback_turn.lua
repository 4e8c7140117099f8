-- fallback_turn.lua: a request that named fallback models (X-Comfy-Fallback-
-- Models) met trouble on the model it runs on: every member of its pool
-- paused, out or full, or a member's 429, refusal or provider error
-- (store/model_fallback.py). The first trouble starts its clock
-- (fallback_since); once the trouble has lasted ``after`` seconds (or its
-- start deadline has come, if sooner) it turns to ``next``: model_ran names
-- it, model_price its price (lib/ledger.lua, settle, charges that, never
-- more than the hold), tried gains {model, member, error_type} for the model
-- it leaves, and the clock starts again. Guarded by ``model`` (the one the
-- caller runs on): two deliveries never turn twice. A generation its provider accepted
-- (upstream_ref) is followed to its end, never left for another model.
-- KEYS: P:req:{id}   ARGV: named (below)
-- returns {"TURNED", model now run} | {"WAIT", seconds until the turn is due, -1: never} | {"GONE"}
local req = KEYS[1]
local now, after = tonumber(ARGV[ARG_NOW]), tonumber(ARGV[ARG_AFTER])
local f = redis.call("HMGET", req, "status", "model", "model_ran", "fallback_since", "start_deadline_at",
  "tried", "fallback_last", "upstream_ref")
if f[1] ~= "IN_PROGRESS" then
  return {"GONE"}
end
local current = f[3] or f[2]
if current ~= ARGV[ARG_MODEL] then
  return {"TURNED", current}  -- another delivery turned it already
end
local member, error_type = ARGV[ARG_MEMBER], ARGV[ARG_ERROR_TYPE]
local last = f[7]
if member ~= "" then
  last = member .. "|" .. error_type
end
local since = tonumber(f[4])
local writes = {}
if not since then
  since = now
  writes = {"fallback_since", ARGV[ARG_NOW]}
end
local due = since + after
local start_by = tonumber(f[5])
if start_by and start_by < due then
  due = math.max(start_by, since)
end
local never = ARGV[ARG_NEXT] == "" or (f[8] and f[8] ~= "")
if never or now < due then
  if last and last ~= f[7] then
    writes[#writes + 1] = "fallback_last"
    writes[#writes + 1] = last
  end
  if #writes > 0 then
    redis.call("HSET", req, unpack(writes))
  end
  return {"WAIT", never and "-1" or tostring(math.max(due - now, 0))}
end
local seen_member, seen_error = cjson.null, error_type ~= "" and error_type or "pool_unavailable"
if last then
  local m, e = string.match(last, "^(.-)|(.*)$")
  seen_member, seen_error = m, e
end
local tried = f[6] and cjson.decode(f[6]) or {}
tried[#tried + 1] = {model = current, member = seen_member, error_type = seen_error}
redis.call("HSET", req, "model_ran", ARGV[ARG_NEXT], "tried", cjson.encode(tried), "model_price", ARGV[ARG_NEXT_PRICE])
redis.call("HDEL", req, "fallback_since", "fallback_last")
return {"TURNED", ARGV[ARG_NEXT]}
