-- rate_add.lua: add calls counted in one process to the caller's rate windows
-- (rate_counts.py: the reads a replica serves), and say where they stand.
-- KEYS: the window counters   ARGV: (calls to add, window seconds) per counter
-- returns {count, ms left} per counter: the window's count with these added
local windows = {}
for i, key in ipairs(KEYS) do
  local window = ARGV[2 * i]
  local count = redis.call("INCRBY", key, ARGV[2 * i - 1])
  local left = redis.call("PTTL", key)
  if left < 0 then  -- a new window (or one left without its expiry): it starts now
    redis.call("EXPIRE", key, window)
    left = tonumber(window) * 1000
  end
  windows[i] = {count, left}
end
return windows
