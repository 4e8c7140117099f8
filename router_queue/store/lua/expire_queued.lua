-- expire_queued.lua: end a request that waited IN_QUEUE past its queue
-- timeout, or past its caller's start deadline (X-Comfy-Start-Deadline):
-- COMPLETED queue_timeout, never dispatched, never billed. Run by the sweeper
-- on the head of each queue and on the start deadlines due (lib.lua); claim.lua
-- makes the same checks when a granted request's delivery arrives.
--
-- KEYS[1] rq:req:{id}  KEYS[2] rq:queue:{provider}  KEYS[3] rq:sched:{provider}
-- KEYS[4] rq:ws:{workspace}  KEYS[5] rq:ledger:{workspace}
-- KEYS[6] rq:running:{provider}  KEYS[7] the broker's list for the provider
-- KEYS[8] rq:deadlines:{provider}  KEYS[9] rq:body:{id}
-- ARGV[1] id  ARGV[2] now (s)  ARGV[3] queue timeout (s)  ARGV[4] retention (s)
-- ARGV[5] workspace  ARGV[6] the provider's cap  ARGV[7] grant lease end (s)
-- ARGV[8] message template or ""
-- returns {"TIMED_OUT", granted ids to publish...} | {"KEPT"}

local rec = redis.call("HMGET", KEYS[1], "status", "created_at", "start_deadline_at")
if rec[1] ~= "IN_QUEUE" then
  if not rec[1] then
    redis.call("ZREM", KEYS[2], ARGV[1])
  end
  redis.call("ZREM", KEYS[8], "start|" .. ARGV[1])  -- started or gone: its start deadline no longer matters
  return {"KEPT"}
end
local detail = "waited in the queue longer than the model's queue timeout; never run, never billed"
if tonumber(ARGV[2]) - tonumber(rec[2]) <= tonumber(ARGV[3]) then
  if not passed(rec[3], ARGV[2]) then
    return {"KEPT"}
  end
  detail = START_DEADLINE_DETAIL
end
local S = sched_ctx(KEYS[3], KEYS[6], KEYS[7], ARGV[6], ARGV[2], ARGV[7], ARGV[8])
finish_unbilled({req = KEYS[1], body = KEYS[9], queue = KEYS[2], ws = KEYS[4], ledger = KEYS[5], deadlines = KEYS[8],
  ws_id = ARGV[5]}, S, ARGV[1], ARGV[2], ARGV[4], true, "queue_timeout", detail)
return with_granted("TIMED_OUT", grant(S))
