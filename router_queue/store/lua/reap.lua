-- reap.lua: take the slots whose lease ran out, for the sweeper to publish
-- again, in one step: each is looked at again at ARGV[2] (a re-publish that
-- is lost too comes back), and a lease renewed meanwhile is never touched,
-- because only members still past ARGV[1] are taken.
--
-- KEYS[1] P:running:{provider}
-- ARGV[1] now (s)  ARGV[2] look again at (s)  ARGV[3] at most this many
-- returns {id, started, id, started, ...}; started "1": its worker died or
-- hung (the request is IN_PROGRESS), "0": a grant whose message was lost

local ids = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", ARGV[1], "LIMIT", 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  redis.call("ZADD", KEYS[1], "XX", ARGV[2], id)
  local status = redis.call("HGET", key_request(id), "status")
  out[#out + 1] = id
  out[#out + 1] = (status and status ~= "IN_QUEUE") and "1" or "0"
end
return out
