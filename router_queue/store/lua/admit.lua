-- admit.lua: admit a new request in one atomic step: its record, its place in
-- its provider's schedule, its idempotency reservation and the hold on its
-- price; then grant() gives it (or whoever the schedule names) a free slot.
-- Refusals (not enabled, backlog full, insufficient credits) write nothing,
-- so the Idempotency-Key stays free for a later try.
--
-- KEYS[1] rq:req:{id}            KEYS[2] rq:queue:{provider}
-- KEYS[3] rq:seq:{provider}      KEYS[4] rq:sched:{provider}
-- KEYS[5] rq:ws:{workspace}      KEYS[6] rq:idem:{workspace}:{keyhash}
-- KEYS[7] rq:ledger:{workspace}  KEYS[8] rq:draining
-- KEYS[9] rq:running:{provider}  KEYS[10] the broker's list for the provider
-- KEYS[11] rq:req:{original}  KEYS[12] rq:body:{original}: the failed
--          request a retry submits again (the new request's own keys when
--          this is no retry: not read)
-- KEYS[13] rq:deadlines:{provider} (lib.lua: the caller's deadlines)
-- KEYS[14] rq:history:{workspace}  KEYS[15] rq:history:{workspace}:{model} (lib.lua, history_add)
-- KEYS[16] rq:body:{id}
-- KEYS[17] rq:open:{workspace} (written on a split store: what its start and
--          end owe the workspace, ws_settle.lua)
-- KEYS[18..] the caller's rate-window counters, with a (limit, window
--          seconds) pair each in ARGV from ARG_REST, after the named ones
--          (ratelimit.py): counted first
-- ARGV by name (ARGV[ARG_ID] and so on; requests.py, ADMIT_ARGS, whose order
-- the generated ARG_* constants give):
--   body                 JSON text; "" for a retry, whose body is the original's
--   id, workspace, model, provider
--   now                  unix seconds
--   fingerprint          of (model, canonical body); "" when no Idempotency-Key
--   idem_ttl             the idempotency reservation's TTL (s)
--   require_enabled      "1" when the workspace must have queued delivery on
--   grant_until          until when a grant waits for its worker before the
--                        reaper publishes it again (unix seconds)
--   price                credits held until the request is charged or released
--   max_queued           most requests the workspace may have waiting, unless
--                        it sets its own max_queued
--   template             the provider's Celery message template (lib.lua,
--                        grant), or "" when the front door publishes grants
--   cap                  the provider's cap on requests in flight
--   priority             within the workspace: "high" | "normal" | "low"
--   write_deadline       Unix seconds (Redis's clock) past which nothing is
--                        written: the front door has answered 503; "" for none
--   webhook_url          X-Comfy-Webhook-Url (checked by the front door), or ""
--                        for the workspace's default, if it has one
--   response_url         the request's response_url, for the webhook's event
--   max_queued_bytes     most body bytes the workspace may have stored for
--                        requests not yet completed, unless it sets its own
--   max_pending_webhooks most webhook events the workspace may have pending
--                        (owed, or to be owed by a request not yet completed),
--                        unless it sets its own
--   retry_of             the id of the request this one retries, or ""
--   start_deadline_at    Unix seconds (X-Comfy-Start-Deadline), or ""
--   deadline_at          Unix seconds (X-Comfy-Deadline), or ""
--   traceparent          the submit's W3C traceparent (tracing.py), or ""
--   webhook_events       X-Comfy-Webhook-Events, checked and canonical
--                        ("started,progress,completed" or a subset), or ""
--                        for the workspace's default, else "completed"
--   retention            seconds the history lists a request after its
--                        admission: older entries are trimmed here
--   split                "1" on a store split into per-slot steps: the
--                        request's start ("q") and end ("e") are owed to the
--                        workspace until ws_settle.lua applies them
-- returns {"ADMITTED", id, position, granted ids to publish...} | {"REPLAY", id}
--       | {"IDEM_CONFLICT"} | {"NOT_ENABLED"} | {"BACKLOG_FULL"}
--       | {"NO_WEBHOOK_SECRET", "header" | "default"} | {"NO_WEBHOOK"}
--       | {"QUEUED_BYTES_FULL"} | {"PENDING_WEBHOOKS_FULL"}
--       | {"INSUFFICIENT_CREDITS", available} | {"DRAINING"}
--       | {"RATE_LIMITED", window index, ms left} | {"EXPIRED"}
--       | {"RETRY_MISSING"} (no such request of this caller and model)
--       | {"NOT_RETRYABLE", its status} (not COMPLETED with an error_type)
--       | {"RETRY_BODY_GONE"} (its body is no longer kept)
-- Admissions and refusals are counted by the front door (web/admission.py),
-- in its own process, from what this returns.

local function refused(reason)
  return {reason}
end

if past_deadline(ARGV[ARG_WRITE_DEADLINE]) then
  return {"EXPIRED"}
end

local spent = spend_rate(18, ARG_REST)
if spent then
  return {"RATE_LIMITED", spent[1], spent[2]}
end

if ARGV[ARG_FINGERPRINT] ~= "" then
  local held = redis.call("GET", KEYS[6])
  if held then
    local sep = string.find(held, "|", 1, true)
    if string.sub(held, 1, sep - 1) ~= ARGV[ARG_FINGERPRINT] then
      return {"IDEM_CONFLICT"}
    end
    return {"REPLAY", string.sub(held, sep + 1)}
  end
end

-- A retry submits the body of a request of this caller and model that
-- failed (COMPLETED with an error_type), kept until its retention ends.
local body = ARGV[ARG_BODY]
if ARGV[ARG_RETRY_OF] ~= "" then
  local original = redis.call("HMGET", KEYS[11], "status", "workspace", "model", "error_type", "body")
  if not original[1] or original[2] ~= ARGV[ARG_WORKSPACE] or original[3] ~= ARGV[ARG_MODEL] then
    return {"RETRY_MISSING"}
  end
  if original[1] ~= "COMPLETED" or not original[4] or original[4] == "" then
    return {"NOT_RETRYABLE", original[1] == "COMPLETED" and "SUCCEEDED" or original[1]}
  end
  body = redis.call("GET", KEYS[12]) or original[5]
  if not body then
    return {"RETRY_BODY_GONE"}
  end
end

if redis.call("SISMEMBER", KEYS[8], ARGV[ARG_PROVIDER]) == 1 then
  return refused("DRAINING")
end
-- The workspace's hash, once: what admission checks, the counts it adds to
-- (written back in one HSET below: nothing in this script writes them in
-- between), the schedule's weight and max_in_flight (lib.lua, ws_limits) and
-- until when the history's streams last (lib.lua, history_renewals).
local ws = redis.call("HMGET", KEYS[5], "queue_enabled", "queued", "max_queued", "credits", "held", "webhook_url",
  "webhook_secret", "queued_bytes", "max_queued_bytes", "webhooks_pending", "max_pending_webhooks", "webhook_events",
  "weight", "max_in_flight", "history_until", "history_until|" .. ARGV[ARG_MODEL])
if ARGV[ARG_REQUIRE_ENABLED] == "1" and ws[1] ~= "1" then
  return refused("NOT_ENABLED")
end
-- A webhook (the request's own, else the workspace's default) needs the
-- workspace's signing secret: without one every attempt would fail for a day
-- and the caller never learn why, so the submit is refused instead.
local webhook = ARGV[ARG_WEBHOOK_URL] ~= "" and ARGV[ARG_WEBHOOK_URL] or ws[6]
if webhook == "" then
  webhook = false
end
-- Events chosen for no webhook at all would be dropped without a word.
if ARGV[ARG_WEBHOOK_EVENTS] ~= "" and not webhook then
  return refused("NO_WEBHOOK")
end
if webhook and not ws[7] then
  refused("NO_WEBHOOK_SECRET")
  return {"NO_WEBHOOK_SECRET", ARGV[ARG_WEBHOOK_URL] ~= "" and "header" or "default"}
end
if tonumber(ws[2] or "0") >= tonumber(ws[3] or ARGV[ARG_MAX_QUEUED]) then
  return refused("BACKLOG_FULL")
end
-- The body's bytes count against the workspace's quota until it is deleted
-- (lib.lua, give_back_body: its completion, whatever ends it).
local bytes = #body
if tonumber(ws[8] or "0") + bytes > tonumber(ws[9] or ARGV[ARG_MAX_QUEUED_BYTES]) then
  return refused("QUEUED_BYTES_FULL")
end
-- A request with a webhook holds one of the workspace's pending events from
-- now until its last event is delivered or given up (lib.lua, webhook_ended),
-- however many events it chose, so a submit-and-cancel flood is bounded
-- however fast its requests end.
if webhook and tonumber(ws[10] or "0") >= tonumber(ws[11] or ARGV[ARG_MAX_PENDING_WEBHOOKS]) then
  return refused("PENDING_WEBHOOKS_FULL")
end
local price = tonumber(ARGV[ARG_PRICE])
local available = tonumber(ws[4] or "0") - tonumber(ws[5] or "0")
if price > 0 and available < price then
  refused("INSUFFICIENT_CREDITS")
  return {"INSUFFICIENT_CREDITS", tostring(available)}
end

local seq = redis.call("INCR", KEYS[3])
-- The record's fields, collected here and written in one HSET once the
-- schedule has decided whether it is granted at once (with its granted_at).
local record = {
  "id", ARGV[ARG_ID], "workspace", ARGV[ARG_WORKSPACE], "model", ARGV[ARG_MODEL], "provider", ARGV[ARG_PROVIDER],
  "status", "IN_QUEUE", "seq", seq, "created_at", ARGV[ARG_NOW], "hold", price,
  "priority", ARGV[ARG_PRIORITY], "body_bytes", bytes}
if ARGV[ARG_TRACEPARENT] ~= "" then
  append(record, "traceparent", ARGV[ARG_TRACEPARENT])
end
-- The body apart: every other field is short, so the record stays a compact
-- listpack while the request waits (keys.py, body()).
redis.call("SET", KEYS[16], body)
if ARGV[ARG_RETRY_OF] ~= "" then
  append(record, "retry_of", ARGV[ARG_RETRY_OF])
end
if ARGV[ARG_START_DEADLINE_AT] ~= "" then
  append(record, "start_deadline_at", ARGV[ARG_START_DEADLINE_AT])
  redis.call("ZADD", KEYS[13], ARGV[ARG_START_DEADLINE_AT], "start|" .. ARGV[ARG_ID])
end
if ARGV[ARG_DEADLINE_AT] ~= "" then
  append(record, "deadline_at", ARGV[ARG_DEADLINE_AT])
  redis.call("ZADD", KEYS[13], ARGV[ARG_DEADLINE_AT], "run|" .. ARGV[ARG_ID])
end
redis.call("ZADD", KEYS[2], seq, ARGV[ARG_ID])
-- The workspace's counts, as HINCRBY would leave them, from the values read
-- above in this same step: one fewer write per count.
local counts = {"queued", tonumber(ws[2] or "0") + 1, "queued_bytes", tonumber(ws[8] or "0") + bytes}
if price > 0 then
  local held = tonumber(ws[5] or "0") + price
  append(counts, "held", held)
  redis.call("XADD", KEYS[7], "*", "type", "hold", "request_id", ARGV[ARG_ID], "amount", price,
    "balance", tonumber(ws[4] or "0"), "held", held, "at", ARGV[ARG_NOW])
end
if webhook then
  append(counts, "webhooks_pending", tonumber(ws[10] or "0") + 1)
end
local renew = history_renewals(ARGV[ARG_MODEL], ARGV[ARG_NOW], ARGV[ARG_RETENTION], ws[15], ws[16], counts)
redis.call("HSET", KEYS[5], unpack(counts))
if webhook then
  append(record, "webhook_url", webhook, "webhook_response_url", ARGV[ARG_RESPONSE_URL], "webhook_counted", 1)
  local events = ARGV[ARG_WEBHOOK_EVENTS] ~= "" and ARGV[ARG_WEBHOOK_EVENTS] or ws[12]
  if events and events ~= "" and events ~= "completed" then
    append(record, "webhook_events", events)  -- absent: "completed"
  end
end
if ARGV[ARG_FINGERPRINT] ~= "" then
  -- the key's hash alone (64 characters): the whole key name would push the
  -- record out of its compact encoding
  append(record, "idem", string.match(KEYS[6], "[^:]+$"))
  redis.call("SET", KEYS[6], ARGV[ARG_FINGERPRINT] .. "|" .. ARGV[ARG_ID], "EX", ARGV[ARG_IDEM_TTL])
end
history_add(KEYS[14], KEYS[15], ARGV[ARG_ID], ARGV[ARG_NOW], ARGV[ARG_RETENTION], renew)
if ARGV[ARG_SPLIT] == "1" then
  redis.call("HSET", KEYS[17], ARGV[ARG_ID], "qe")
  append(record, "open", 1)  -- its effects are owed through the open entry (lib.lua, owe_ws)
end

local S = sched_ctx(KEYS[4], KEYS[9], KEYS[10], ARGV[ARG_CAP], ARGV[ARG_NOW], ARGV[ARG_GRANT_UNTIL], ARGV[ARG_TEMPLATE])
S.limits[ARGV[ARG_WORKSPACE]] = limits_of(ws[13], ws[14])
-- Nobody waiting ahead and a slot free: granted at once (lib.lua,
-- grant_directly), its granted_at written with the record.
local granted, rank = grant_directly(S, ARGV[ARG_WORKSPACE], ARGV[ARG_ID], record)
-- The record before grant(): it reads the status of the request it grants.
redis.call("HSET", KEYS[1], unpack(record))
if not granted then
  enqueue(S, ARGV[ARG_WORKSPACE], ARGV[ARG_ID], seq, ARGV[ARG_PRIORITY])
  granted = grant(S)
  rank = position(S.base, ARGV[ARG_WORKSPACE], ARGV[ARG_ID])
end
local reply = with_granted("ADMITTED", granted)
table.insert(reply, 2, ARGV[ARG_ID])
table.insert(reply, 3, rank)
return reply
