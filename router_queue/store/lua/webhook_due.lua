-- webhook_due.lua: the sweeper's pick of the webhook events due now (a new
-- one, a retry whose time came, one whose attempt's lease ran out: its worker
-- died). Each is pushed back to again_at in the same step, so the next sweep
-- publishes it again only if no attempt took it by then (a lost message).
--
-- KEYS[1] P:webhook:due:{provider} (or an earlier version's rq:webhooks:due)
-- ARGV by name (webhooks.py, DUE_ARGS): now (s)  again_at (s)  limit (most to take)
-- returns the request ids to publish

local due = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", ARGV[ARG_NOW], "LIMIT", 0, tonumber(ARGV[ARG_LIMIT]))
for _, request_id in ipairs(due) do
  redis.call("ZADD", KEYS[1], ARGV[ARG_AGAIN_AT], request_id)
end
return due
