-- history.lua: one page of a workspace's requests, newest first, with the
-- call counted in the caller's rate windows first (ratelimit.py). Reads only.
--
-- A page costs the same at any depth of the history: the stream is entered at
-- the cursor (O(log n)), and at most ARGV[5] entries are examined, of which
-- those whose record matches the filters are listed, up to ARGV[4]. A filter
-- that matches little returns a short (even empty) page with more = 1: the
-- caller goes on from the last entry examined, never past one unread.
--
-- KEYS[1] rq:history:{workspace} (a stream: lib.lua, history_add)
-- KEYS[2] rq:history:{workspace}:{model} to list one model (its entries
--         point into KEYS[1]), else KEYS[1] again
-- KEYS[3..] the caller's rate-window counters
-- ARGV[1] the workspace (a record of another is never listed)
-- ARGV[2] the newest entry to list: "+", or "(" .. a stream id (exclusive:
--         the cursor, or "{until ms}-0")
-- ARGV[3] the oldest: "-" or "{since ms}-0" (inclusive)
-- ARGV[4] most entries to list   ARGV[5] most stream entries to examine
-- ARGV[6] the status to list, or ""   ARGV[7] the error_type to list, or ""
-- ARGV[8..11] where "workspace", "provider", "status" and "error_type" are
--         among the record fields
-- ARGV[12] how many record fields follow   ARGV[13..] the fields (requests.py,
--         _FIELDS), then a (limit, window seconds) pair per rate-window counter
-- returns {"RATE_LIMITED", window index, ms left}
--       | {"OK", more (1 | 0), the last stream id examined,
--          {field values, queue position or false}...}

local nfields = tonumber(ARGV[12])
local spent = spend_rate(3, 13 + nfields)
if spent then
  return {"RATE_LIMITED", spent[1], spent[2]}
end
local fields = {unpack(ARGV, 13, 12 + nfields)}
local want, budget = tonumber(ARGV[4]), tonumber(ARGV[5])
local at_ws, at_provider, at_status, at_error = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]),
  tonumber(ARGV[11])
-- Up to budget + 1 entries: the one past the budget only tells whether there is more.
local found = redis.call("XREVRANGE", KEYS[2], ARGV[2], ARGV[3], "COUNT", budget + 1)
local by_model = KEYS[2] ~= KEYS[1]

-- The request an entry names (nil when its workspace entry is gone).
local function request_of(entry)
  if by_model then
    entry = redis.call("XRANGE", KEYS[1], entry[1], entry[1])[1]
  end
  local packed = entry and entry[2][2]
  return packed and #packed == 16 and unpack_id(packed) or nil
end

-- Whether a record's (workspace, status, error_type) is listed.
local function listed(ws, status, error_type)
  return status and ws == ARGV[1] and (ARGV[6] == "" or status == ARGV[6])
    and (ARGV[7] == "" or error_type == ARGV[7])
end
-- With a filter, most records examined are not listed: their three fields
-- are read first, and the whole record only for those that are.
local filtered = ARGV[6] ~= "" or ARGV[7] ~= ""

local page = {}
local n = #found
local examined, last = 0, ""
for i = 1, math.min(n, budget) do
  if #page >= want then
    break
  end
  examined, last = i, found[i][1]
  local id = request_of(found[i])
  local key = KEY_REQUEST .. (id or "")
  local values = false
  if not id then
    values = false
  elseif filtered then
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
      rank = position(KEY_SCHEDULE .. values[at_provider], ARGV[1], id)
    end
    page[#page + 1] = {values, rank}
  end
end
return {"OK", examined < n and 1 or 0, last, unpack(page)}
