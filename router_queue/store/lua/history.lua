-- history.lua: one page of a workspace's requests, newest first, with the
-- call counted in the caller's rate windows first (ratelimit.py). Reads only.
--
-- A page costs the same at any depth of the history: the index is entered at
-- the cursor's score (O(log n)), and at most ARGV[6] entries are examined, of
-- which those whose record matches the filters are listed, up to ARGV[5]. A
-- filter that matches little returns a short (even empty) page with more = 1:
-- the caller goes on from the last entry examined, never past one unread.
--
-- KEYS[1] rq:history:{workspace} or rq:history:{workspace}:{model}
-- KEYS[2..] the caller's rate-window counters
-- ARGV[1] the workspace (a record of another is never listed)
-- ARGV[2] the newest score to list: "+inf", "(" .. until (exclusive), or
--         the cursor's score (see ARGV[3])
-- ARGV[3] the cursor's id, or "": entries at exactly the cursor's score are
--         listed only when their id sorts before it (ties are in reverse id
--         order), then those below the score
-- ARGV[4] the oldest score to list (inclusive)
-- ARGV[5] most entries to list   ARGV[6] most index entries to examine
-- ARGV[7] the status to list, or ""   ARGV[8] the error_type to list, or ""
-- ARGV[9..12] where "workspace", "provider", "status" and "error_type" are
--         among the record fields
-- ARGV[13] how many record fields follow   ARGV[14..] the fields (requests.py,
--         _FIELDS), then a (limit, window seconds) pair per rate-window counter
-- returns {"RATE_LIMITED", window index, ms left}
--       | {"OK", more (1 | 0), last score examined, last id examined,
--          {field values, queue position or false}...}

local nfields = tonumber(ARGV[13])
local spent = spend_rate(2, 14 + nfields)
if spent then
  return {"RATE_LIMITED", spent[1], spent[2]}
end
local fields = {unpack(ARGV, 14, 13 + nfields)}
local want, budget = tonumber(ARGV[5]), tonumber(ARGV[6])
local at_ws, at_provider, at_status, at_error = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11]),
  tonumber(ARGV[12])

-- Up to budget + 1 entries (id, score, id, score...): the one past the
-- budget only tells whether there is more.
local found = {}
local newest = ARGV[2]
if ARGV[3] ~= "" then
  local tied = redis.call("ZREVRANGEBYSCORE", KEYS[1], newest, newest, "WITHSCORES")
  for i = 1, #tied, 2 do
    if tied[i] < ARGV[3] and #found < 2 * (budget + 1) then
      found[#found + 1] = tied[i]
      found[#found + 1] = tied[i + 1]
    end
  end
  newest = "(" .. newest
end
local room = budget + 1 - #found / 2
if room > 0 then
  local rest = redis.call("ZREVRANGEBYSCORE", KEYS[1], newest, ARGV[4], "WITHSCORES", "LIMIT", 0, room)
  for _, v in ipairs(rest) do
    found[#found + 1] = v
  end
end

-- Whether a record's (workspace, status, error_type) is listed.
local function listed(ws, status, error_type)
  return status and ws == ARGV[1] and (ARGV[7] == "" or status == ARGV[7])
    and (ARGV[8] == "" or error_type == ARGV[8])
end
-- With a filter, most records examined are not listed: their three fields
-- are read first, and the whole record only for those that are.
local filtered = ARGV[7] ~= "" or ARGV[8] ~= ""

local page = {}
local n = #found / 2
local examined, last_score, last_id = 0, "", ""
for i = 1, math.min(n, budget) do
  if #page >= want then
    break
  end
  local id = found[2 * i - 1]
  local key = "rq:req:" .. id
  examined, last_id, last_score = i, id, found[2 * i]
  local values = false
  if filtered then
    local f = redis.call("HMGET", key, fields[at_ws], fields[at_status], fields[at_error])
    if listed(f[1], f[2], f[3]) then
      values = redis.call("HMGET", key, unpack(fields))
    end
  else
    values = redis.call("HMGET", key, unpack(fields))
  end
  if values and listed(values[at_ws], values[at_status], values[at_error]) then
    local rank = false
    if values[at_status] == "IN_QUEUE" then
      rank = position("rq:sched:" .. values[at_provider], ARGV[1], id)
    end
    page[#page + 1] = {values, rank}
  end
end
return {"OK", examined < n and 1 or 0, last_score, last_id, unpack(page)}
