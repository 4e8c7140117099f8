-- admit.lua: admit a new request in one atomic step: its record, its place in
-- its provider's schedule, its idempotency reservation and the hold on its
-- price; then grant() gives it (or whoever the schedule names) a free slot.
-- Refusals (not enabled, backlog full, insufficient credits) write nothing,
-- so the Idempotency-Key stays free for a later try.
--
-- KEYS[1] rq:req:{id}            KEYS[2] rq:queue:{provider}
-- KEYS[3] rq:seq:{provider}      KEYS[4] rq:sched:{provider}
-- KEYS[5] rq:ws:{workspace}      KEYS[6] rq:idem:{workspace}:{keyhash}
-- KEYS[7] rq:ledger:{workspace}  KEYS[8] rq:metrics:{provider}  KEYS[9] rq:draining
-- KEYS[10] rq:running:{provider} KEYS[11] the broker's list for the provider
-- KEYS[12] rq:req:{original}  KEYS[13] rq:body:{original}: the failed
--          request a retry submits again (the new request's own keys when
--          this is no retry: not read)
-- KEYS[14] rq:deadlines:{provider} (lib.lua: the caller's deadlines)
-- KEYS[15] rq:history:{workspace}  KEYS[16] rq:history:{workspace}:{model} (lib.lua, history_add)
-- KEYS[17..] the caller's rate-window counters, with a (limit, window
--          seconds) pair each in ARGV[27..] (ratelimit.py): counted first
-- ARGV[1] id  ARGV[2] workspace  ARGV[3] model  ARGV[4] provider
-- ARGV[5] body (JSON text; "" for a retry, whose body is the original's)
-- ARGV[6] now (unix seconds)
-- ARGV[7] fingerprint of (model, canonical body); "" when no Idempotency-Key
-- ARGV[8] idempotency TTL (s)    ARGV[9] "1" when the workspace must have
--                                        queued delivery switched on
-- ARGV[10] until when a grant waits for its worker before the reaper
--          publishes it again (unix seconds)
-- ARGV[11] price (credits) held until the request is charged or released
-- ARGV[12] most requests the workspace may have waiting, unless the
--          workspace sets its own max_queued
-- ARGV[13] the provider's Celery message template (lib.lua, grant), or ""
--          when the front door publishes what was granted
-- ARGV[14] the provider's cap on requests in flight
-- ARGV[15] priority within the workspace: "high" | "normal" | "low"
-- ARGV[16] deadline (Unix seconds, Redis's clock) past which nothing is
--          written: the front door has answered 503 by then; "" for none
-- ARGV[17] the request's webhook URL (X-Comfy-Webhook-Url, checked by the
--          front door), or "" for the workspace's default, if it has one
-- ARGV[18] the request's response_url, for the webhook's event
-- ARGV[19] most body bytes the workspace may have stored for requests not
--          yet completed, unless it sets its own max_queued_bytes
-- ARGV[20] most webhook events the workspace may have pending (owed, or to
--          be owed by a request not yet completed), unless it sets its own
--          max_pending_webhooks
-- ARGV[21] the id of the request this one retries, or ""
-- ARGV[22] start deadline (Unix seconds: X-Comfy-Start-Deadline), or ""
-- ARGV[23] deadline (Unix seconds: X-Comfy-Deadline), or ""
-- ARGV[24] the submit's W3C traceparent (tracing.py), or "" when tracing is off
-- ARGV[25] the webhook events the request chose (X-Comfy-Webhook-Events,
--          checked and canonical: "started,progress,completed" or a subset),
--          or "" for the workspace's default, else "completed"
-- ARGV[26] seconds the history lists a request after its admission (the
--          retention window): older entries are trimmed here
-- returns {"ADMITTED", id, position, granted ids to publish...} | {"REPLAY", id}
--       | {"IDEM_CONFLICT"} | {"NOT_ENABLED"} | {"BACKLOG_FULL"}
--       | {"NO_WEBHOOK_SECRET", "header" | "default"} | {"NO_WEBHOOK"}
--       | {"QUEUED_BYTES_FULL"} | {"PENDING_WEBHOOKS_FULL"}
--       | {"INSUFFICIENT_CREDITS", available} | {"DRAINING"}
--       | {"RATE_LIMITED", window index, ms left} | {"EXPIRED"}
--       | {"RETRY_MISSING"} (no such request of this caller and model)
--       | {"NOT_RETRYABLE", its status} (not COMPLETED with an error_type)
--       | {"RETRY_BODY_GONE"} (its body is no longer kept)
-- Admissions and refusals are counted in rq:metrics:{provider} on the way.

local function refused(reason)
  redis.call("HINCRBY", KEYS[8], "refused|" .. ARGV[3] .. "|" .. reason, 1)
  return {reason}
end

if past_deadline(ARGV[16]) then
  return {"EXPIRED"}
end

local spent = spend_rate(17, 27)
if spent then
  return {"RATE_LIMITED", spent[1], spent[2]}
end

if ARGV[7] ~= "" then
  local held = redis.call("GET", KEYS[6])
  if held then
    local sep = string.find(held, "|", 1, true)
    if string.sub(held, 1, sep - 1) ~= ARGV[7] then
      return {"IDEM_CONFLICT"}
    end
    return {"REPLAY", string.sub(held, sep + 1)}
  end
end

-- A retry submits the body of a request of this caller and model that
-- failed (COMPLETED with an error_type), kept until its retention ends.
local body = ARGV[5]
if ARGV[21] ~= "" then
  local original = redis.call("HMGET", KEYS[12], "status", "workspace", "model", "error_type", "body")
  if not original[1] or original[2] ~= ARGV[2] or original[3] ~= ARGV[3] then
    return {"RETRY_MISSING"}
  end
  if original[1] ~= "COMPLETED" or not original[4] or original[4] == "" then
    return {"NOT_RETRYABLE", original[1] == "COMPLETED" and "SUCCEEDED" or original[1]}
  end
  body = redis.call("GET", KEYS[13]) or original[5]
  if not body then
    return {"RETRY_BODY_GONE"}
  end
end

if redis.call("SISMEMBER", KEYS[9], ARGV[4]) == 1 then
  return refused("DRAINING")
end
local ws = redis.call("HMGET", KEYS[5], "queue_enabled", "queued", "max_queued", "credits", "held", "webhook_url",
  "webhook_secret", "queued_bytes", "max_queued_bytes", "webhooks_pending", "max_pending_webhooks", "webhook_events")
if ARGV[9] == "1" and ws[1] ~= "1" then
  return refused("NOT_ENABLED")
end
-- A webhook (the request's own, else the workspace's default) needs the
-- workspace's signing secret: without one every attempt would fail for a day
-- and the caller never learn why, so the submit is refused instead.
local webhook = ARGV[17] ~= "" and ARGV[17] or ws[6]
if webhook == "" then
  webhook = false
end
-- Events chosen for no webhook at all would be dropped without a word.
if ARGV[25] ~= "" and not webhook then
  return refused("NO_WEBHOOK")
end
if webhook and not ws[7] then
  refused("NO_WEBHOOK_SECRET")
  return {"NO_WEBHOOK_SECRET", ARGV[17] ~= "" and "header" or "default"}
end
if tonumber(ws[2] or "0") >= tonumber(ws[3] or ARGV[12]) then
  return refused("BACKLOG_FULL")
end
-- The body's bytes count against the workspace's quota until it is deleted
-- (lib.lua, drop_body: its completion, whatever ends it).
local bytes = #body
if tonumber(ws[8] or "0") + bytes > tonumber(ws[9] or ARGV[19]) then
  return refused("QUEUED_BYTES_FULL")
end
-- A request with a webhook holds one of the workspace's pending events from
-- now until its last event is delivered or given up (lib.lua, webhook_ended),
-- however many events it chose, so a submit-and-cancel flood is bounded
-- however fast its requests end.
if webhook and tonumber(ws[10] or "0") >= tonumber(ws[11] or ARGV[20]) then
  return refused("PENDING_WEBHOOKS_FULL")
end
local price = tonumber(ARGV[11])
local available = tonumber(ws[4] or "0") - tonumber(ws[5] or "0")
if price > 0 and available < price then
  refused("INSUFFICIENT_CREDITS")
  return {"INSUFFICIENT_CREDITS", tostring(available)}
end

local seq = redis.call("INCR", KEYS[3])
redis.call("HSET", KEYS[1],
  "id", ARGV[1], "workspace", ARGV[2], "model", ARGV[3], "provider", ARGV[4],
  "status", "IN_QUEUE", "seq", seq, "created_at", ARGV[6], "hold", price,
  "priority", ARGV[15], "body_bytes", bytes)
if ARGV[24] ~= "" then
  redis.call("HSET", KEYS[1], "traceparent", ARGV[24])
end
-- The body apart: every other field is short, so the record stays a compact
-- listpack while the request waits (keys.py, body()).
redis.call("SET", "rq:body:" .. ARGV[1], body)
if ARGV[21] ~= "" then
  redis.call("HSET", KEYS[1], "retry_of", ARGV[21])
end
if ARGV[22] ~= "" then
  redis.call("HSET", KEYS[1], "start_deadline_at", ARGV[22])
  redis.call("ZADD", KEYS[14], ARGV[22], "start|" .. ARGV[1])
end
if ARGV[23] ~= "" then
  redis.call("HSET", KEYS[1], "deadline_at", ARGV[23])
  redis.call("ZADD", KEYS[14], ARGV[23], "run|" .. ARGV[1])
end
redis.call("ZADD", KEYS[2], seq, ARGV[1])
redis.call("HINCRBY", KEYS[5], "queued", 1)
redis.call("HINCRBY", KEYS[5], "queued_bytes", bytes)
if price > 0 then
  local held = redis.call("HINCRBY", KEYS[5], "held", price)
  redis.call("XADD", KEYS[7], "*", "type", "hold", "request_id", ARGV[1], "amount", price,
    "balance", tonumber(ws[4] or "0"), "held", held, "at", ARGV[6])
end
if webhook then
  redis.call("HSET", KEYS[1], "webhook_url", webhook, "webhook_response_url", ARGV[18], "webhook_counted", 1)
  local events = ARGV[25] ~= "" and ARGV[25] or ws[12]
  if events and events ~= "" and events ~= "completed" then
    redis.call("HSET", KEYS[1], "webhook_events", events)  -- absent: "completed"
  end
  redis.call("HINCRBY", KEYS[5], "webhooks_pending", 1)
end
if ARGV[7] ~= "" then
  -- the key's hash alone (64 characters): the whole key name would push the
  -- record out of its compact encoding
  redis.call("HSET", KEYS[1], "idem", string.match(KEYS[6], "[^:]+$"))
  redis.call("SET", KEYS[6], ARGV[7] .. "|" .. ARGV[1], "EX", ARGV[8])
end
redis.call("HINCRBY", KEYS[8], "admitted|" .. ARGV[3], 1)
history_add(KEYS[15], KEYS[16], ARGV[1], ARGV[6], ARGV[26])

local S = sched_ctx(KEYS[4], KEYS[10], KEYS[11], ARGV[14], ARGV[6], ARGV[10], ARGV[13])
enqueue(S, ARGV[2], ARGV[1], seq, ARGV[15])
local granted = grant(S)
local reply = with_granted("ADMITTED", granted)
table.insert(reply, 2, ARGV[1])
table.insert(reply, 3, position(S.base, ARGV[2], ARGV[1]))
return reply
