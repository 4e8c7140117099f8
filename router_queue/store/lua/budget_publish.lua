-- budget_publish.lua: the sweeper's publishing of budget crossings due
-- (webhooks/budget_alerts.py, publish_owed), marked on each crossing in the
-- workspace's owed list in the step that finds it due: `pub`, until when its
-- message is in flight (a webhook lease). One crossing so has at most one
-- message in flight per lease, and one lost in the broker is published again
-- once its lease ends. budget_take.lua clears the mark as it takes the crossing.
--
-- KEYS[1] W:ws
-- ARGV by name (budgets.py, PUBLISH_ARGS): now (s), until (s); then, from
--   ARGV[ARG_REST], the crossings ("{scope}|{period}|{start}|{threshold}") the sweep read as due
-- returns those it marked: still owed, due (no attempt holds them, no backoff
--   runs) and with no message in flight

local text = redis.call("HGET", KEYS[1], "budget_owed")
if not text then
  return {}
end
local wanted = {}
for i = ARG_REST, #ARGV do
  wanted[ARGV[i]] = true
end
local now = tonumber(ARGV[ARG_NOW])
local owed, marked = cjson.decode(text), {}
for _, c in ipairs(owed) do
  local crossing = c.scope .. "|" .. c.period .. "|" .. c.start .. "|" .. c.threshold
  if wanted[crossing] and (tonumber(c.due) or 0) <= now and (tonumber(c.pub) or 0) <= now then
    c.pub = tonumber(ARGV[ARG_UNTIL])
    marked[#marked + 1] = crossing
  end
end
if #marked > 0 then
  redis.call("HSET", KEYS[1], "budget_owed", cjson.encode(owed))
end
return marked
