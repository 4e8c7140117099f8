-- admit.lua: admit a new request in one atomic step: its record, its place in
-- its provider's schedule, its idempotency reservation and the hold on its
-- price; then grant() gives it (or whoever the schedule names) a free slot.
-- Refusals (not enabled, backlog full, insufficient credits) write nothing,
-- so the Idempotency-Key stays free for a later try. The workspace's part
-- and the provider's are lib/admission.lua's (Admission), which a store split into
-- per-slot steps runs as two scripts (admit_ws.lua, admit_place.lua).
--
-- KEYS[1] P:req:{id}            KEYS[2] P:queue:{provider}
-- KEYS[3] P:seq:{provider}      KEYS[4] P:sched:{provider} (its "draining" too)
-- KEYS[5] W:ws      KEYS[6] W:idem:{keyhash}
-- KEYS[7] W:ledger
-- KEYS[8] P:running:{provider}  KEYS[9] the broker's list for the provider
-- KEYS[10] P:req:{original}  KEYS[11] P:body:{original}: the failed
--          request a retry submits again (the new request's own keys when
--          this is no retry: not read)
-- KEYS[12] P:deadlines:{provider} (lib/ending.lua: the caller's deadlines)
-- KEYS[13] W:history  KEYS[14] W:history:{model} (lib/history.lua, history_add)
-- KEYS[15] P:body:{id}  KEYS[16] W:stored (lib/ledger.lua, release_stored)
-- KEYS[17] W:batch:{batch_id}, its line's batch (W:batch:- for no batch: not read)
-- KEYS[18..] the caller's rate-window counters, with a (limit, window
--          seconds) pair each in ARGV from ARG_REST, after the named ones
--          (ratelimit.py): counted first
-- ARGV by name (ARGV[ARG_ID] and so on; admission.py, ADMIT_ARGS, whose order
-- the generated ARG_* constants give):
--   first, the fields admission carries from the submission into the record
--   (requests/record.py declares them: id, workspace, model, provider, the caller's
--   deadlines, retry_of, ...), each written when not "" (lib/admission.lua,
--   place_admission, over the generated ADMITTED_FIELDS); then
--   body                 JSON text; "" for a retry, whose body is the original's
--   now                  unix seconds
--   fingerprint          of (model, canonical body); "" when no Idempotency-Key
--   idem_ttl             the idempotency reservation's TTL (s)
--   require_enabled      "1" when the workspace must have queued delivery on
--   grant_until          until when a grant waits for its worker before the
--                        reaper publishes it again (unix seconds)
--   price                credits held until the request is charged or released
--   max_queued           most requests the workspace may have waiting, unless
--                        it sets its own max_queued
--   template             the provider's Celery message template (lib/schedule.lua,
--                        grant), or "" when the front door publishes grants
--   low_headroom_pct     the cap's share kept from low priority (lib/schedule.lua,
--                        low_reserve_of)
--   cap                  the provider's cap on requests in flight
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
--   webhook_events       X-Comfy-Webhook-Events, checked and canonical
--                        ("started,progress,completed" or a subset), or ""
--                        for the workspace's default, else "completed"
--   retention            seconds the history lists a request after its
--                        admission: older entries are trimmed here
--   max_stored_bytes     most bytes of kept bodies and unexpired results the
--                        workspace may have, unless it sets its own
--   retry_max            most retries a request's chain may have all told
--   ledger_keep          seconds the ledger keeps an entry
--                        (LEDGER_RETENTION_SECONDS): older ones are trimmed
--                        as the hold's entry is added (lib/ledger.lua, ledger_add)
--   body_bytes, reserved, admitting: the split steps' (admit_ws.lua,
--                        admit_place.lua); "" here
-- returns {"ADMITTED", id, position, granted ids to publish...} | {"REPLAY", id}
--       | {"IDEM_CONFLICT"} | {"NOT_ENABLED"} | {"BACKLOG_FULL"}
--       | {"NO_WEBHOOK_SECRET", "header" | "default"} | {"NO_WEBHOOK"}
--       | {"QUEUED_BYTES_FULL"} | {"STORED_BYTES_FULL", seconds until room}
--       | {"PENDING_WEBHOOKS_FULL"}
--       | {"INSUFFICIENT_CREDITS", available} | {"DRAINING"}
--       | {"BATCH_CANCELLED"} (a batch line whose batch was cancelled)
--       | {"RATE_LIMITED", window index, ms left} | {"EXPIRED"}
--       | {"RETRY_MISSING"} (no such request of this caller and model)
--       | {"NOT_RETRYABLE", its status} (not COMPLETED with an error_type)
--       | {"RETRY_BODY_GONE"} (its body is no longer kept)
--       | {"RETRY_LIMIT"} (its chain has had retry_max retries)
-- Every reply but "RATE_LIMITED" and "EXPIRED" ends with one more element:
-- {{count, ms left} per rate-window counter}, where the caller's windows stand
-- once counted (the RateLimit header field: ratelimit.py; requests_front.py takes it off).
-- Admissions and refusals are counted by the front door (web/admission.py),
-- in its own process, from what this returns.

if past_deadline(ARGV[ARG_WRITE_DEADLINE]) then
  return {"EXPIRED"}
end
local W = {rate = 18, batch = KEYS[17], stored = KEYS[16], ws = KEYS[5], idem = KEYS[6], ledger = KEYS[7], history = KEYS[13], model_history = KEYS[14]}
local P = {req = KEYS[1], queue = KEYS[2], seq = KEYS[3], sched = KEYS[4], running = KEYS[8], list = KEYS[9],
  original = KEYS[10], original_body = KEYS[11], deadlines = KEYS[12], body = KEYS[15]}
-- What follows the count: the admission, or the refusal that ends it.
local function admit_counted()
  local src, refused = admission_source(P)
  if not src then
    return refused
  end
  local ws
  ws, refused = admission_checks(W, src.bytes)
  if not ws then
    return refused
  end
  return place_admission(P, src, reserve_admission(W, ws, src.bytes))
end

local reply = admission_opening(W) or admit_counted()
if reply[1] ~= "RATE_LIMITED" then
  reply[#reply + 1] = rate_windows(W.rate)
end
return reply
