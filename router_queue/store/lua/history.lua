-- history.lua: the entries one page of a workspace's history may list, newest
-- first, with the call counted in the caller's rate windows first
-- (ratelimit.py). Reads only the workspace's keys (its records are read
-- after, in their provider's slot: requests_front.py, RequestStore.history).
--
-- A page costs the same at any depth of the history: the stream is entered at
-- the cursor (O(log n)), and at most `examined` entries are examined.
--
-- KEYS[1] W:history (a stream: lib/history.lua, history_add)
-- KEYS[2] W:history:{model} to list one model (its entries
--         point into KEYS[1]), else KEYS[1] again
-- KEYS[3..] the caller's rate-window counters
-- ARGV by name (requests_front.py, HISTORY_ARGS):
-- newest: the newest entry to list: "+", or "(" .. a stream id (exclusive:
--         the cursor, or "{until ms}-0")
-- oldest: "-" or "{since ms}-0" (inclusive)
-- examined: most stream entries to examine
-- then, from ARGV[ARG_REST], a (limit, window seconds) pair per rate-window counter
-- returns {"RATE_LIMITED", window index, ms left}
--       | {"OK", more past these (1 | 0), {{count, ms left} per rate-window
--          counter}: where the caller's windows stand once counted (the RateLimit
--          header field: ratelimit.py), {stream id, request id or ""}...}

local spent = spend_rate(3, ARG_REST)
if spent then
  return {"RATE_LIMITED", spent[1], spent[2]}
end
local budget = tonumber(ARGV[ARG_EXAMINED])
-- Up to budget + 1 entries: the one past the budget only tells whether there is more.
local found = redis.call("XREVRANGE", KEYS[2], ARGV[ARG_NEWEST], ARGV[ARG_OLDEST], "COUNT", budget + 1)
local by_model = KEYS[2] ~= KEYS[1]
local reply = {"OK", #found > budget and 1 or 0, rate_windows(3)}
for i = 1, math.min(#found, budget) do
  local entry = found[i]
  if by_model then
    entry = redis.call("XRANGE", KEYS[1], entry[1], entry[1])[1]
  end
  local packed = entry and entry[2][2]
  reply[#reply + 1] = {found[i][1], packed and #packed == 16 and unpack_id(packed) or ""}
end
return reply
