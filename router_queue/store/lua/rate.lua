-- rate.lua: count one call in the caller's rate windows (ratelimit.py), for
-- the routes whose own script does not count it.
-- KEYS: the window counters   ARGV: (limit, window seconds) per counter
-- returns false when allowed | {window index, ms left in it} when spent
return spend_rate(1, 1) or false
