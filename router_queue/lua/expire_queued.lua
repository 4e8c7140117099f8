-- expire_queued.lua: end a request that waited IN_QUEUE past its queue
-- timeout (COMPLETED queue_timeout, never dispatched, never billed). Run by
-- the reaper on the head of each queue; claim.lua makes the same check when a
-- delivery arrives.
--
-- KEYS[1] rq:req:{id}  KEYS[2] rq:queue:{provider}  KEYS[3] rq:due
-- KEYS[4] rq:ws:{workspace}  KEYS[5] rq:ledger:{workspace}
-- ARGV[1] id  ARGV[2] now (s)  ARGV[3] queue timeout (s)  ARGV[4] retention (s)
-- returns 1 when it timed the request out, else 0

local rec = redis.call("HMGET", KEYS[1], "status", "created_at")
if rec[1] ~= "IN_QUEUE" then
  if not rec[1] then
    redis.call("ZREM", KEYS[2], ARGV[1])
  end
  return 0
end
if tonumber(ARGV[2]) - tonumber(rec[2]) <= tonumber(ARGV[3]) then
  return 0
end
finish_unbilled({req = KEYS[1], queue = KEYS[2], due = KEYS[3], ws = KEYS[4], ledger = KEYS[5]},
  ARGV[1], ARGV[2], ARGV[4], true, "queue_timeout",
  "waited in the queue longer than the model's queue timeout; never run, never billed")
return 1
