-- renew.lua: the holder of a request's lease extends it. Three uses:
--   heartbeat   ARGV[5] = "", ARGV[6] = ""      extend the lease
--   retry       ARGV[5] = the retry's resume key keep the lease through the
--                                               wait, for that retry alone
--   hand back   ARGV[4] = 0, ARGV[6] = "1"      end the lease now; the next
--                                               delivery resumes it, and it
--                                               does not count as a takeover
-- A holder whose lease was taken over changes nothing.
--
-- KEYS[1] P:req:{id}   KEYS[2] P:running:{provider}
-- ARGV[1] id  ARGV[2] token  ARGV[3] now (s)  ARGV[4] lease (s)
-- ARGV[5] successor resume key or ""   ARGV[6] "1" to hand back, or ""
-- returns 1 when renewed, 0 when the token no longer holds the request

local rec = redis.call("HMGET", KEYS[1], "status", "token")
if rec[1] ~= "IN_PROGRESS" or rec[2] ~= ARGV[2] then
  return 0
end
local until_ = tonumber(ARGV[3]) + tonumber(ARGV[4])
redis.call("HSET", KEYS[1], "lease_until", tostring(until_))
if ARGV[5] ~= "" then
  redis.call("HSET", KEYS[1], "successor", ARGV[5])
end
if ARGV[6] == "1" then
  redis.call("HSET", KEYS[1], "handed_back", "1")
end
redis.call("ZADD", KEYS[2], until_, ARGV[1])
return 1
