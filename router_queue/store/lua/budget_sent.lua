-- budget_sent.lua: the end of an attempt at a budget crossing's alert
-- (store/budgets.py), by the attempt that took it (budget_take.lua; its
-- token): "ended" takes it off the workspace's owed list (delivered,
-- audited, given up); "failed" counts an attempt and keeps it BUSY until
-- `again_at` (the backoff); "released" gives the lease back uncounted (the
-- workspace's turn was full or the endpoint's circuit open). The list is the
-- admission's (lib/budget.lua, owe_crossings), which may have grown meanwhile.
--
-- KEYS[1] W:ws
-- ARGV by name (budgets.py, SENT_ARGS): crossing ("{scope}|{period}|{start}|{threshold}")
--   token, outcome ("ended" | "failed" | "released"), again_at (s; for "failed")
-- returns its attempts so far, -1 when it was no longer owed, -2 when another attempt holds it

local owed = cjson.decode(redis.call("HGET", KEYS[1], "budget_owed") or "[]")
for i, c in ipairs(owed) do
  if c.scope .. "|" .. c.period .. "|" .. c.start .. "|" .. c.threshold == ARGV[ARG_CROSSING] then
    if c.token ~= ARGV[ARG_TOKEN] then
      return -2
    end
    local attempts = c.attempts or 0
    c.token = nil
    if ARGV[ARG_OUTCOME] == "ended" then
      table.remove(owed, i)
    elseif ARGV[ARG_OUTCOME] == "failed" then
      attempts = attempts + 1
      c.attempts = attempts
      c.due = tonumber(ARGV[ARG_AGAIN_AT])
    else
      c.due = nil
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
