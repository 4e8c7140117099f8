-- renew.lua: the holder of a request's lease extends it. Three uses:
--   heartbeat   successor "", hand_back ""      extend the lease
--   retry       successor: the retry's resume key keep the lease through the
--                                               wait, for that retry alone
--   hand back   lease_s 0, hand_back "1"         end the lease now; the next
--                                               delivery resumes it, and it
--                                               does not count as a takeover
-- A holder whose lease was taken over changes nothing.
--
-- KEYS[1] P:req:{id}   KEYS[2] P:running:{provider}
-- ARGV by name (requests_delivery.py, RENEW_ARGS): id  token  now (s)  lease_s
--   successor (a resume key, or "")  hand_back ("1" to hand back, or "")
-- returns 1 when renewed, 0 when the token no longer holds the request

local status, token = unpack(redis.call("HMGET", KEYS[1], "status", "token"))
if status ~= "IN_PROGRESS" or token ~= ARGV[ARG_TOKEN] then
  return 0
end
local until_ = tonumber(ARGV[ARG_NOW]) + tonumber(ARGV[ARG_LEASE_S])
redis.call("HSET", KEYS[1], "lease_until", tostring(until_))
if ARGV[ARG_SUCCESSOR] ~= "" then
  redis.call("HSET", KEYS[1], "successor", ARGV[ARG_SUCCESSOR])
end
if ARGV[ARG_HAND_BACK] == "1" then
  redis.call("HSET", KEYS[1], "handed_back", "1")
end
redis.call("ZADD", KEYS[2], until_, ARGV[ARG_ID])
return 1
