-- renew.lua: the holder of a request's lease extends it (heartbeat), or ends
-- it at once (lease of 0 s) to hand the request back on a warm shutdown.
-- A holder whose lease was taken over renews nothing.
--
-- KEYS[1] rq:req:{id}   KEYS[2] rq:running:{provider}
-- ARGV[1] id  ARGV[2] token  ARGV[3] now (s)  ARGV[4] lease (s)
-- returns 1 when renewed, 0 when the token no longer holds the request

local rec = redis.call("HMGET", KEYS[1], "status", "token")
if rec[1] ~= "IN_PROGRESS" or rec[2] ~= ARGV[2] then
  return 0
end
local until_ = tonumber(ARGV[3]) + tonumber(ARGV[4])
redis.call("HSET", KEYS[1], "lease_until", tostring(until_))
redis.call("ZADD", KEYS[2], until_, ARGV[1])
return 1
