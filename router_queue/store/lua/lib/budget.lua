-- lib/budget.lua: credit budgets per UTC day, ISO week and calendar month, of
-- a workspace ("ws") and of each of its API keys (their ids), kept in the
-- workspace's hash: admission reads them in the HMGET it already makes
-- (budget_names), refuses a hold that would go over one (budget_check) and
-- writes the new spend and the thresholds crossed in the HSET it already makes
-- (budget_spend); a settled hold gives back what it did not charge
-- (budget_refund). Fields (store/budgets.py writes the limits):
--   budget|{scope}|{d|w|m}  the limit (credits; absent or 0: none)
--   budget|{scope}|alert_at  thresholds, per cent of each limit ("50,80,100")
--   spent|{scope}|{d|w|m}   "{period's first Unix day}|{credits held or charged}"
--   alerted|{scope}|{d|w|m} "{period's first Unix day}|{thresholds alerted, comma-separated}"
--   budget_owed             JSON list of crossings whose alert is still owed
-- Every scope's spend is kept, budgeted or not (three fields per key that
-- submits, in the HSET admission makes anyway): a budget set mid-period
-- counts what was already spent in it.
-- requires: util

--: The periods, by their field letter: a UTC day, an ISO week, a calendar month.
local BUDGET_PERIODS = {"d", "w", "m"}
--: Most crossings owed at once: older ones are dropped (a crossing is once per period).
local BUDGET_OWED_MAX = 100

-- (year, month, day) of a Unix day (days since 1970-01-01): H. Hinnant's
-- civil_from_days, in floats that hold whole numbers exactly.
local function civil_of(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  return y, m, d
end

-- The first Unix day of the period ("d", "w", "m") holding Unix seconds `at`:
-- 1970-01-01 was a Thursday, so (day + 3) % 7 is 0 on a Monday.
local function period_start(kind, at)
  local day = math.floor(tonumber(at) / 86400)
  if kind == "w" then
    return day - (day + 3) % 7
  elseif kind == "m" then
    local _, _, d = civil_of(day)
    return day - (d - 1)
  end
  return day
end

-- "{start}|{value}" as (start, value), or (nil, nil).
local function budget_pair(text)
  if not text then
    return nil, nil
  end
  local start, value = string.match(text, "^(%-?%d+)|(.*)$")
  return tonumber(start), value
end

-- Append to `names` the hash fields budget_check reads, for the workspace and
-- the caller's key (key_id, "" for none). Returns the scopes, in that order.
local function budget_names(names, key_id)
  local scopes = {"ws"}
  if key_id and key_id ~= "" then
    scopes[2] = key_id
  end
  for _, s in ipairs(scopes) do
    append(names, "budget|" .. s .. "|alert_at")
    for _, p in ipairs(BUDGET_PERIODS) do
      append(names, "budget|" .. s .. "|" .. p, "spent|" .. s .. "|" .. p, "alerted|" .. s .. "|" .. p)
    end
  end
  return scopes
end

-- A crossing owed (its alert: store/budgets.py sends it, or audits it).
local function owe_crossing(plan, s, p, start, limit, threshold, spent, now)
  plan.owed[#plan.owed + 1] = {scope = s, period = p, start = start, budget = limit, threshold = threshold,
    spent = spent, at = tonumber(now)}
end

-- The thresholds of `alert_at` ("50,80,100") the spend crosses going from
-- `before` to `after` of `limit`, and not yet alerted (alerted: the set of
-- those that were this period), owed (naming `shown` as the spend) and added
-- to `alerted`; only those of at least `least` per cent.
local function crossings(plan, c, alert_at, alerted, before, after, shown, least)
  for t in string.gmatch(alert_at or "", "%d+") do
    local line = c.limit * tonumber(t) / 100
    if not alerted[t] and tonumber(t) >= least and before < line and after >= line then
      alerted[t] = true
      owe_crossing(plan, c.s, c.p, c.start, c.limit, tonumber(t), shown, c.now)
    end
  end
end

-- The set of thresholds an alerted|… field names for the period `start`.
local function alerted_set(text, start)
  local at, list = budget_pair(text)
  local set = {}
  if at == start then
    for t in string.gmatch(list, "%d+") do
      set[t] = true
    end
  end
  return set
end

-- Write back an alerted set as its field's value.
local function alerted_text(start, set)
  local list = {}
  for t in pairs(set) do
    list[#list + 1] = t
  end
  table.sort(list, function(a, b) return tonumber(a) < tonumber(b) end)
  return start .. "|" .. table.concat(list, ",")
end

-- Check a hold of `price` against the budgets: `v` the HMGET's values,
-- budget_names' fields from index `at` on. Returns the plan (fields: the
-- hash's fields to write with the admission; owed: crossings; a row per
-- scope and period), or nil, the refusal {"BUDGET_EXCEEDED",
-- "workspace"|"key", "day"|"week"|"month", limit, spent} and the plan of what
-- a refusal still writes: a threshold of 100 or more of each budget that
-- refused it is crossed by the refused request (the budget is spent).
local function budget_check(scopes, v, at, price, now)
  local plan, refusal = {fields = {}, owed = {}}, nil
  local names = {d = "day", w = "week", m = "month"}
  for i, s in ipairs(scopes) do
    local base = at + (i - 1) * 10
    for j, p in ipairs(BUDGET_PERIODS) do
      local c = {s = s, p = p, start = period_start(p, now), limit = tonumber(v[base + 3 * j - 2] or "0") or 0,
        now = now, alert_at = v[base], alerted_field = v[base + 3 * j]}
      local spent_at, spent = budget_pair(v[base + 3 * j - 1])
      c.spent = spent_at == c.start and tonumber(spent) or 0
      if c.limit > 0 then
        c.over = c.spent + price > c.limit
        if c.over and not refusal then
          refusal = {"BUDGET_EXCEEDED", s == "ws" and "workspace" or "key", names[p], c.limit, c.spent}
        end
      end
      plan[#plan + 1] = c
    end
  end
  for _, c in ipairs(plan) do
    if c.limit > 0 and (not refusal or c.over) then
      local alerted, owed = alerted_set(c.alerted_field, c.start), #plan.owed
      if refusal then
        crossings(plan, c, c.alert_at, alerted, c.spent, math.huge, c.spent, 100)
      else
        crossings(plan, c, c.alert_at, alerted, c.spent, c.spent + price, c.spent + price, 0)
      end
      -- written only when it changed: a threshold crossed, or a new period
      if #plan.owed > owed or budget_pair(c.alerted_field) ~= c.start then
        append(plan.fields, "alerted|" .. c.s .. "|" .. c.p, alerted_text(c.start, alerted))
      end
    end
  end
  if refusal then
    return nil, refusal, plan
  end
  return plan
end

-- Owe a plan's crossings: appended to the hash's budget_owed list (its fields
-- written with `fields`, which the caller writes).
local function owe_crossings(ws_key, plan, fields)
  if #plan.owed == 0 then
    return
  end
  local owed = cjson.decode(redis.call("HGET", ws_key, "budget_owed") or "[]")
  for _, c in ipairs(plan.owed) do
    owed[#owed + 1] = c
  end
  while #owed > BUDGET_OWED_MAX do
    table.remove(owed, 1)
  end
  append(fields, "budget_owed", cjson.encode(owed))
end

-- The admission's budget fields (appended to `fields`, written with its
-- counts): each period's spend grown by `price`, the alerted thresholds,
-- the crossings owed.
local function budget_spend(ws_key, plan, price, fields)
  for _, c in ipairs(plan) do
    append(fields, "spent|" .. c.s .. "|" .. c.p, c.start .. "|" .. (c.spent + price))
  end
  for _, f in ipairs(plan.fields) do
    fields[#fields + 1] = f
  end
  owe_crossings(ws_key, plan, fields)
end

-- What a refused admission writes: the crossings it made (a full budget).
local function budget_refused(ws_key, plan)
  if not plan or #plan.owed == 0 then
    return
  end
  local fields = {}
  for _, f in ipairs(plan.fields) do
    fields[#fields + 1] = f
  end
  owe_crossings(ws_key, plan, fields)
  redis.call("HSET", ws_key, unpack(fields))
end

-- A settled hold that charged `refund` credits less than it held (a release
-- gives all back) is taken off the spend of the periods it was admitted in
-- (since: its admission's Unix s; key: its key id), when they are still the
-- periods kept.
local function budget_refund(ws_key, refund, since, key)
  if refund <= 0 or not since then
    return
  end
  local scopes, names = {"ws"}, {}
  if key and key ~= "" then
    scopes[2] = key
  end
  for _, s in ipairs(scopes) do
    for _, p in ipairs(BUDGET_PERIODS) do
      append(names, "spent|" .. s .. "|" .. p)
    end
  end
  local v = redis.call("HMGET", ws_key, unpack(names))
  local fields = {}
  for i, name in ipairs(names) do
    local start, spent = budget_pair(v[i])
    local p = string.sub(name, -1)
    if start and start == period_start(p, since) then
      append(fields, name, start .. "|" .. math.max(0, tonumber(spent) - refund))
    end
  end
  if #fields > 0 then
    redis.call("HSET", ws_key, unpack(fields))
  end
end
