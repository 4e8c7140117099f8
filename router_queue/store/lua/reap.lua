-- reap.lua: take the slots whose lease ran out, for the sweeper to publish
-- again, in one step: each is looked at again at again_at (a re-publish that
-- is lost too comes back), and a lease renewed meanwhile is never touched,
-- because only members still past now are taken.
--
-- KEYS[1] P:running:{provider}
-- ARGV by name (requests_maintenance.py, REAP_ARGS): now (s)  again_at (look again then, s)
--   limit (at most this many)
-- returns {id, started, id, started, ...}; started "1": its worker died or
-- hung (the request is IN_PROGRESS), "0": a grant whose message was lost

local ids = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", ARGV[ARG_NOW], "LIMIT", 0, tonumber(ARGV[ARG_LIMIT]))
local out = {}
for _, id in ipairs(ids) do
  redis.call("ZADD", KEYS[1], "XX", ARGV[ARG_AGAIN_AT], id)
  local status = redis.call("HGET", key_request(id), "status")
  out[#out + 1] = id
  out[#out + 1] = (status and status ~= "IN_QUEUE") and "1" or "0"
end
return out
