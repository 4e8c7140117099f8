-- member_take.lua: choose the member of a provider's pool a generation is sent
-- to, and hold one of its slots (store/members.py). The member with the most
-- headroom (its learned cap less its slots held) that is neither paused by a
-- 429 nor taken out; a request resumed with the member that holds its
-- generation (``prefer``) keeps it whatever its headroom. Slots whose lease
-- ran out (their worker died) are given back first, a few per call. A
-- member paused for ``model`` (its 429s: member_limited) is passed over, as
-- one paused for every model or taken out is; another model's pause is not
-- this request's (its quota is its own).
-- KEYS: the pool's state hash, its slot leases (zset "member|request id" -> until)
-- ARGV: named (below), then (member, cap) pairs in the catalog's order
-- returns {"TAKEN", member} or {"WAIT", seconds until one may have room}
local state, leases = KEYS[1], KEYS[2]
local now = tonumber(ARGV[ARG_NOW])
local request_id, prefer = ARGV[ARG_REQUEST_ID], ARGV[ARG_PREFER]
local model_paused = ":paused_until|" .. ARGV[ARG_MODEL]

for _, held in ipairs(redis.call("ZRANGEBYSCORE", leases, "-inf", now, "LIMIT", 0, 20)) do
  redis.call("ZREM", leases, held)
  local member = string.match(held, "^(.-)|")
  if member and tonumber(redis.call("HINCRBY", state, member .. ":in_flight", -1)) < 0 then
    redis.call("HSET", state, member .. ":in_flight", 0)
  end
end

local function take(member)
  local lease = member .. "|" .. request_id
  if redis.call("ZADD", leases, ARGV[ARG_LEASE_UNTIL], lease) == 1 then
    redis.call("HINCRBY", state, member .. ":in_flight", 1)
  end
  redis.call("HINCRBY", state, member .. ":taken", 1)
  return {"TAKEN", member}
end

local best, best_room, soonest, full = nil, 0, nil, false
for i = ARG_REST, #ARGV, 2 do
  local member, cap = ARGV[i], tonumber(ARGV[i + 1])
  local fields = redis.call("HMGET", state, member .. ":in_flight", member .. ":paused_until",
                            member .. ":cap", member .. ":grown_at", member .. ":revoked_until",
                            member .. model_paused)
  local paused_until = math.max(tonumber(fields[2] or 0), tonumber(fields[5] or 0), tonumber(fields[6] or 0))
  if member == prefer then
    return take(member)
  end
  if paused_until > now then
    if soonest == nil or paused_until < soonest then soonest = paused_until end
  else
    -- additive increase: a learned cap grows back by one per grow_every seconds without a 429
    local learned = tonumber(fields[3] or cap)
    local grown_at = tonumber(fields[4] or 0)
    if learned < cap and now - grown_at >= tonumber(ARGV[ARG_GROW_EVERY]) then
      learned = learned + 1
      redis.call("HSET", state, member .. ":cap", learned, member .. ":grown_at", now)
    end
    local room = math.min(learned, cap) - tonumber(fields[1] or 0)
    if room > best_room then best, best_room = member, room end
    full = true
  end
end
if best ~= nil then
  return take(best)
end
-- none has room: ask again shortly when one is merely full (a slot frees at
-- any time), else when the first pause ends
if full or soonest == nil then
  return {"WAIT", ARGV[ARG_FULL_WAIT]}
end
return {"WAIT", tostring(math.max(0.05, soonest - now))}
