-- bulk_note.lua: count one matched request's outcome in its bulk action's
-- progress, once: the action walks the history newest first, so an entry at
-- or above the cursor was noted before (a step run again after its worker
-- died). Also moves the cursor past unmatched entries, and ends the action.
-- KEYS[1] W:bulk:{bulk id}
-- ARGV (named, store/bulk.py NOTE_ARGS): act: "note" | "pass" (move the cursor only) | "end";
-- entry: the history entry's stream id ("{ms}-{seq}"; "end": ""); kind: the outcome's kind, "done" |
-- "skipped" | "failed" ("end": "limited" or ""); outcome ("cancelled", "retried", "already_completed",
-- a refusal's reason ...); now (Unix s)
-- returns 1 when counted (or moved, or ended), 0 when noted before, -1 when the action is gone
if redis.call("EXISTS", KEYS[1]) == 0 then
  return -1
end
if ARGV[ARG_ACT] == "end" then
  if redis.call("HGET", KEYS[1], "status") == "COMPLETED" then
    return 0
  end
  redis.call("HSET", KEYS[1], "status", "COMPLETED", "completed_at", ARGV[ARG_NOW], "waiting", "")
  if ARGV[ARG_KIND] == "limited" then
    redis.call("HSET", KEYS[1], "limited", "1")
  end
  return 1
end
local function below(a, b)  -- stream id a is older than b
  local ams, aseq = string.match(a, "^(%d+)-(%d+)$")
  local bms, bseq = string.match(b, "^(%d+)-(%d+)$")
  ams, bms = tonumber(ams), tonumber(bms)
  return ams < bms or (ams == bms and tonumber(aseq) < tonumber(bseq))
end
local cursor = redis.call("HGET", KEYS[1], "cursor")
if cursor and cursor ~= "" and not below(ARGV[ARG_ENTRY], cursor) then
  return 0
end
redis.call("HSET", KEYS[1], "cursor", ARGV[ARG_ENTRY], "updated_at", ARGV[ARG_NOW], "waiting", "")
if ARGV[ARG_ACT] == "note" then
  redis.call("HINCRBY", KEYS[1], "matched", 1)
  redis.call("HINCRBY", KEYS[1], ARGV[ARG_KIND], 1)
  redis.call("HINCRBY", KEYS[1], ARGV[ARG_KIND] .. ":" .. ARGV[ARG_OUTCOME], 1)
end
return 1
