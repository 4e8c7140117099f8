-- member_limited.lua: a member of a provider's pool answered 429 (or refused
-- our credential): pause it until ``until`` (a later pause is kept), count it,
-- and, for a 429, halve its learned cap (multiplicative decrease; member_take
-- grows it back). ``what``: "rate_limited" or "revoked". A 429 names its
-- ``model`` (or ""): that model's pause on the member is kept too, which
-- member_take reads for a request of that model (a fallback's other model
-- is not held by it); the member's own pause stays the pool's capacity's.
-- KEYS: the pool's state hash   ARGV: named (below)
-- returns the member's learned cap after this
local state = KEYS[1]
local member, what = ARGV[ARG_MEMBER], ARGV[ARG_WHAT]
local field = member .. (what == "revoked" and ":revoked_until" or ":paused_until")
local until_at = tonumber(ARGV[ARG_UNTIL])
if until_at > tonumber(redis.call("HGET", state, field) or 0) then
  redis.call("HSET", state, field, ARGV[ARG_UNTIL])
end
if what == "rate_limited" and ARGV[ARG_MODEL] ~= "" then
  local scoped = member .. ":paused_until|" .. ARGV[ARG_MODEL]
  if until_at > tonumber(redis.call("HGET", state, scoped) or 0) then
    redis.call("HSET", state, scoped, ARGV[ARG_UNTIL])
  end
end
redis.call("HINCRBY", state, member .. ":" .. what, 1)
local cap = tonumber(redis.call("HGET", state, member .. ":cap") or ARGV[ARG_CAP])
if what == "rate_limited" then
  cap = math.max(1, math.floor(cap / 2))
  redis.call("HSET", state, member .. ":cap", cap, member .. ":grown_at", ARGV[ARG_NOW])
end
return cap
