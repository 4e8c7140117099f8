-- bulk_note.lua: count one matched request's outcome in its bulk action's
-- progress, once: the action walks the history newest first, so an entry at
-- or above the cursor was noted before (a step run again after its worker
-- died). Also moves the cursor past unmatched entries, and ends the action.
-- KEYS[1] W:bulk:{bulk id}
-- ARGV[1] "note" | "pass" (move the cursor only) | "end"
-- ARGV[2] the history entry's stream id ("{ms}-{seq}"; "end": "")
-- ARGV[3] the outcome's kind: "done" | "skipped" | "failed" ("end": "limited" or "")
-- ARGV[4] the outcome ("cancelled", "retried", "already_completed", a refusal's reason ...)
-- ARGV[5] now (Unix s)
-- returns 1 when counted (or moved, or ended), 0 when noted before, -1 when the action is gone
if redis.call("EXISTS", KEYS[1]) == 0 then
  return -1
end
if ARGV[1] == "end" then
  if redis.call("HGET", KEYS[1], "status") == "COMPLETED" then
    return 0
  end
  redis.call("HSET", KEYS[1], "status", "COMPLETED", "completed_at", ARGV[5], "waiting", "")
  if ARGV[3] == "limited" then
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
if cursor and cursor ~= "" and not below(ARGV[2], cursor) then
  return 0
end
redis.call("HSET", KEYS[1], "cursor", ARGV[2], "updated_at", ARGV[5], "waiting", "")
if ARGV[1] == "note" then
  redis.call("HINCRBY", KEYS[1], "matched", 1)
  redis.call("HINCRBY", KEYS[1], ARGV[3], 1)
  redis.call("HINCRBY", KEYS[1], ARGV[3] .. ":" .. ARGV[4], 1)
end
return 1
