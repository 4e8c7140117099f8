-- lib/ending.lua: what every ending of a request shares: the record's fields it
-- reads (ENDING_FIELDS), the caller's deadlines (forget_deadlines, passed) and
-- the unbilled ending (finish_unbilled).
-- requires: util, ledger, body, schedule, webhooks


--: The record's fields a request's ending reads (settle, give_back_body,
--: forget_deadlines, owe_webhook), read once by whatever ends it.
local ENDING_FIELDS = {"hold", "cost_state", "price", "body_bytes", "start_deadline_at", "deadline_at",
  "webhook_url", "webhook_events", "webhook_counted", "webhook_final", "body_of", "provider",
  "created_at", "model", "key_id", "model_ran", "model_price"}

-- The caller's deadlines (admit.lua records them): X-Comfy-Start-Deadline
-- ends a request not started by then queue_timeout (claim.lua at once,
-- expire_queued.lua from the sweeper); X-Comfy-Deadline cancels one not
-- completed by then, as the cancel route would (cancel.lua from the sweeper,
-- claim.lua at once). Each is a member of P:deadlines:{provider} ("start|id",
-- "run|id") scored by when it falls, until the request no longer needs it.
local START_DEADLINE_DETAIL =
  "not started by its start deadline (X-Comfy-Start-Deadline); never run, never billed"
local DEADLINE_DETAIL = "cancelled: its deadline (X-Comfy-Deadline) passed before it completed"

-- rec: the record's ENDING_FIELDS; a request admitted with neither deadline
-- has no member to forget (admit.lua writes each field with its member).
local function forget_deadlines(deadlines_key, request_id, rec)
  if deadlines_key and (rec.start_deadline_at or rec.deadline_at) then
    redis.call("ZREM", deadlines_key, "start|" .. request_id, "run|" .. request_id)
  end
end

-- Whether a deadline (a record field, Unix seconds, or false) has passed by now.
local function passed(value, now)
  if not value then
    return false
  end
  local at = tonumber(value)
  return at ~= nil and tonumber(now) > at
end

-- End a request that produced no output the provider billed (cancelled while
-- queued, timed out in the queue, given up after its workers kept dying):
-- COMPLETED with its bucket, out of the queue, the schedule and its slot, its
-- hold released, kept (its body too: it may be retried) for the retention
-- window, announced. k holds the keys
-- req, body (P:body:{id}), queue, deadlines (P:deadlines:{provider}, or nil), the
-- workspace id ws_id and where its effects go (ws_target); S the provider's
-- scheduler context (the caller runs grant(S) after, for the freed slot).
local function finish_unbilled(k, S, request_id, now, retention, was_queued, error_type, detail)
  local rec = read_fields(k.req, ENDING_FIELDS)
  local e = ws_effects(request_id, now)
  -- The record first: its write can grow memory, so a full Redis refuses the
  -- whole step (Redis refuses such a write only as a script's first).
  local fields = {"status", "COMPLETED", "completed_at", now, "error_type", error_type, "detail", detail}
  settle(e, "release", rec, fields)
  give_back_body(rec, fields, e)
  redis.call("HSET", k.req, unpack(fields))
  redis.call("EXPIRE", k.req, retention)
  if was_queued then
    e.queued = 1
    leave_schedule(S, k.ws_id, request_id)
    redis.call("ZREM", k.queue, request_id)  -- a started one left it when it started (claim.lua)
  else
    release_slot(S, k.ws_id, request_id, true)
  end
  drop_body(k.body, retention, true, rec, e, k.ws_id, now)
  forget_deadlines(k.deadlines, request_id, rec)
  owe_webhook(k.req, e, request_id, now, rec)
  owe_ws(k, e, "end")
  announce_completed(request_id)
end
