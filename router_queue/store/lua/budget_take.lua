-- budget_take.lua: a budget crossing's alert taken for one attempt
-- (store/budgets.py, webhooks/budget_alerts.py), under a lease kept on the
-- crossing itself in the workspace's owed list: its token and `due` (the
-- lease's end). A crossing whose `due` is ahead (an attempt holds it, or a
-- failed one's backoff runs) is BUSY: two workers never send it at once.
-- Taking it ends its message's flight (`pub`: budget_publish.lua), so once
-- this attempt ends it is published again if still owed.
--
-- KEYS[1] W:ws
-- ARGV by name (budgets.py, TAKE_ARGS): crossing ("{scope}|{period}|{start}|{threshold}")
--   token, now (s), lease_until (s)
-- returns {"TAKEN", crossing as JSON} | {"BUSY"} | {"NOT_OWED"}

local owed = cjson.decode(redis.call("HGET", KEYS[1], "budget_owed") or "[]")
for _, c in ipairs(owed) do
  if c.scope .. "|" .. c.period .. "|" .. c.start .. "|" .. c.threshold == ARGV[ARG_CROSSING] then
    if (tonumber(c.due) or 0) > tonumber(ARGV[ARG_NOW]) then
      return {"BUSY"}
    end
    c.token = ARGV[ARG_TOKEN]
    c.pub = nil
    c.due = tonumber(ARGV[ARG_LEASE_UNTIL])
    redis.call("HSET", KEYS[1], "budget_owed", cjson.encode(owed))
    return {"TAKEN", cjson.encode(c)}
  end
end
return {"NOT_OWED"}
