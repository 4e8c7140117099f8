-- lib/util.lua: what every part shares: building a hash's fields (append, read_fields),
-- pub/sub to whoever follows a request (announce*), a caller's deadline on a
-- write (past_deadline) and its rate windows (spend_rate).
-- requires:

-- Appends its further arguments to the list `fields` (a hash's field-value
-- pairs, collected to be written in one HSET).
local function append(fields, ...)
  for i = 1, select("#", ...) do
    fields[#fields + 1] = (select(i, ...))
  end
end

-- The hash's fields `names` (and `more`, if given) in one HMGET, as a table
-- by name (false for a field the hash lacks).
local function read_fields(key, names, more)
  local all = {unpack(names)}
  for _, name in ipairs(more or {}) do
    all[#all + 1] = name
  end
  local values = redis.call("HMGET", key, unpack(all))
  local byname = {}
  for i, name in ipairs(all) do
    byname[name] = values[i]
  end
  return byname
end

-- Tell whoever follows this request (a held synchronous call, an event
-- stream) that it changed: "IN_PROGRESS", "PROGRESS" or "COMPLETED". They
-- read its status again. The channel is keys.events_channel() in keys.py.
local function announce(request_id, what)
  redis.call("PUBLISH", KEY_EVENTS .. request_id, what)
end

local function announce_completed(request_id)
  announce(request_id, "COMPLETED")
end

local function announce_changed(request_id)
  announce(request_id, "PROGRESS")
end

-- Tell the event streams of a provider's waiting requests that positions
-- moved (a slot was granted or a granted request started): they read their
-- position again, each at most once a second (router_queue/web/stream.py).
local function announce_moved(sched_base)
  redis.call("PUBLISH", KEY_PROVIDER_EVENTS .. string.match(sched_base, ":sched:(.+)$"), "MOVED")
end

-- True when a write arrives past the deadline its caller gave it (ARGV, Unix
-- seconds; "" for none), by Redis's own clock: the caller has stopped
-- waiting and told its client the write failed, so it must not happen now.
local function past_deadline(deadline)
  if deadline == nil or deadline == "" then
    return false
  end
  local t = redis.call("TIME")
  return tonumber(t[1]) + tonumber(t[2]) / 1000000 > tonumber(deadline)
end

-- Where the caller's rate windows stand, for its RateLimit field
-- (ratelimit.Meter): {count, ms left} of each of KEYS[first_key] onwards, read
-- in the round trip that counted the call.
local function rate_windows(first_key)
  local windows = {}
  for i = first_key, #KEYS do
    windows[#windows + 1] = {tonumber(redis.call("GET", KEYS[i])), redis.call("PTTL", KEYS[i])}
  end
  return windows
end

-- Count this call in the caller's fixed rate windows (ratelimit.py): the
-- counters are KEYS[first_key] onwards, each one's (limit, window seconds) a
-- pair in ARGV from first_arg. Every window counts the call until one is
-- found spent; returns nil when allowed, else {that window's index, ms left}.
local function spend_rate(first_key, first_arg)
  local i = 0
  while KEYS[first_key + i] do
    local key = KEYS[first_key + i]
    local window = ARGV[first_arg + 2 * i + 1]
    local count = redis.call("INCR", key)
    if count == 1 then
      redis.call("EXPIRE", key, window)
    end
    if count > tonumber(ARGV[first_arg + 2 * i]) then
      local left = redis.call("PTTL", key)
      if left < 0 then  -- a counter left without its expiry: start its window now
        redis.call("EXPIRE", key, window)
        left = tonumber(window) * 1000
      end
      return {i + 1, left}
    end
    i = i + 1
  end
  return nil
end
