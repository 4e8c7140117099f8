-- budget_sent.lua: a budget crossing's alert attempted (store/budgets.py):
-- taken off the workspace's owed list when it ended (delivered, audited,
-- given up), else its attempts counted. The list is the admission's
-- (lib/budget.lua, owe_crossings), which may have grown meanwhile.
--
-- KEYS[1] W:ws
-- ARGV by name (budgets.py, SENT_ARGS): crossing ("{scope}|{period}|{start}|{threshold}")
--   ended ("1": take it off; "0": count an attempt)
-- returns its attempts so far, or -1 when it was no longer owed

local owed = cjson.decode(redis.call("HGET", KEYS[1], "budget_owed") or "[]")
for i, c in ipairs(owed) do
  if c.scope .. "|" .. c.period .. "|" .. c.start .. "|" .. c.threshold == ARGV[ARG_CROSSING] then
    local attempts = (c.attempts or 0) + 1
    if ARGV[ARG_ENDED] == "1" then
      table.remove(owed, i)
    else
      c.attempts = attempts
    end
    if #owed == 0 then
      redis.call("HDEL", KEYS[1], "budget_owed")
    else
      redis.call("HSET", KEYS[1], "budget_owed", cjson.encode(owed))
    end
    return attempts
  end
end
return -1
