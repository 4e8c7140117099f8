-- lib.lua: the accounting every script that moves a request shares. store.py
-- prepends it to each script at load, so holds, charges, releases and the
-- per-workspace waiting count are written in one place.
-- Callers pass the workspace hash (rq:ws:{ws}) and its ledger
-- (rq:ledger:{ws}) among their KEYS.

-- One fewer request of this workspace is waiting IN_QUEUE.
local function left_queue(ws_key)
  if redis.call("HINCRBY", ws_key, "queued", -1) < 0 then
    redis.call("HSET", ws_key, "queued", 0)
  end
end

-- Settle the credits held for a request at admission, once: "charge" turns
-- the hold into a charge (the provider billed us), "release" gives it back.
-- The record's hold is zeroed in the same step, so retries, duplicate
-- deliveries and racing completions can never settle twice.
local function settle(req_key, ws_key, ledger_key, request_id, how, now)
  local hold = tonumber(redis.call("HGET", req_key, "hold") or "0")
  if hold <= 0 then
    return
  end
  redis.call("HSET", req_key, "hold", 0)
  local held = redis.call("HINCRBY", ws_key, "held", -hold)
  local credits
  if how == "charge" then
    redis.call("HSET", req_key, "charged", hold)
    credits = redis.call("HINCRBY", ws_key, "credits", -hold)
  else
    credits = tonumber(redis.call("HGET", ws_key, "credits") or "0")
  end
  redis.call("XADD", ledger_key, "*", "type", how, "request_id", request_id, "amount", hold,
    "balance", credits, "held", held, "at", now)
end


-- Tell whoever holds a connection for this request (the synchronous route)
-- that it is COMPLETED. The channel is keys.done_channel() in keys.py.
local function announce_completed(request_id)
  redis.call("PUBLISH", "rq:done:" .. request_id, "COMPLETED")
end

-- End a request that produced no output the provider billed (cancelled while
-- queued, timed out in the queue, given up after its workers kept dying):
-- COMPLETED with its bucket, out of every index, its hold released, kept for
-- the retention window, announced. k holds the keys: req, queue, due, ws,
-- ledger, and running when it may hold a provider slot.
local function finish_unbilled(k, request_id, now, retention, was_queued, error_type, detail)
  if was_queued then
    left_queue(k.ws)
  end
  redis.call("HSET", k.req, "status", "COMPLETED", "completed_at", now, "error_type", error_type, "detail", detail)
  settle(k.req, k.ws, k.ledger, request_id, "release", now)
  redis.call("EXPIRE", k.req, retention)
  redis.call("ZREM", k.queue, request_id)
  redis.call("ZREM", k.due, request_id)
  if k.running then
    redis.call("ZREM", k.running, request_id)
  end
  announce_completed(request_id)
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
