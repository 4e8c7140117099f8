-- member_limited.lua: a member of a provider's pool answered 429 (or refused
-- our credential): pause it until ``until`` (a later pause is kept), count it,
-- and, for a 429, halve its learned cap (multiplicative decrease; member_take
-- grows it back). ``what``: "rate_limited" or "revoked". A 429 that names its
-- ``model`` pauses that model alone on the member ("paused_until|{model}":
-- Vertex AI's and OpenAI's quotas are per model), which member_take and the
-- pool's capacity per model (PoolCapacity) read; one naming none ("") pauses
-- the member, as a refused credential takes it out, for every model.
-- KEYS: the pool's state hash   ARGV: named (below)
-- returns the member's learned cap after this
local state = KEYS[1]
local member, what = ARGV[ARG_MEMBER], ARGV[ARG_WHAT]
local field = member .. (what == "revoked" and ":revoked_until" or ":paused_until")
if what == "rate_limited" and ARGV[ARG_MODEL] ~= "" then
  field = field .. "|" .. ARGV[ARG_MODEL]
end
if tonumber(ARGV[ARG_UNTIL]) > tonumber(redis.call("HGET", state, field) or 0) then
  redis.call("HSET", state, field, ARGV[ARG_UNTIL])
end
redis.call("HINCRBY", state, member .. ":" .. what, 1)
local cap = tonumber(redis.call("HGET", state, member .. ":cap") or ARGV[ARG_CAP])
if what == "rate_limited" then
  cap = math.max(1, math.floor(cap / 2))
  redis.call("HSET", state, member .. ":cap", cap, member .. ":grown_at", ARGV[ARG_NOW])
end
return cap
