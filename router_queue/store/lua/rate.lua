-- rate.lua: count one call in the caller's rate windows (ratelimit.py), for
-- the routes whose own script does not count it.
-- KEYS: the window counters   ARGV: (limit, window seconds) per counter
-- returns {window index, ms left in it} when one is spent
--       | {0, {count, ms left}...}: counted, and where each window stands
--         (its RateLimit header field: ratelimit.py; ms left -1: no expiry)
local spent = spend_rate(1, 1)
if spent then
  return spent
end
local windows = rate_windows(1)
table.insert(windows, 1, 0)
return windows
