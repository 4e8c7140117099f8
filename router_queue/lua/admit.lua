-- admit.lua: write a new request, its place in its provider's queue and its
-- idempotency reservation in one atomic step.
--
-- KEYS[1] rq:req:{id}            KEYS[2] rq:queue:{provider}
-- KEYS[3] rq:seq:{provider}      KEYS[4] rq:due
-- KEYS[5] rq:ws:{workspace}      KEYS[6] rq:idem:{workspace}:{keyhash}
-- ARGV[1] id  ARGV[2] workspace  ARGV[3] model  ARGV[4] provider
-- ARGV[5] body (JSON text)       ARGV[6] now (unix seconds)
-- ARGV[7] fingerprint of (model, canonical body); "" when no Idempotency-Key
-- ARGV[8] idempotency TTL (s)    ARGV[9] "1" when the workspace must have
--                                        queued delivery switched on
-- ARGV[10] time (s) by which the request must have been published, after
--          which the sweeper publishes it (a crash between admit and publish)
-- returns {"ADMITTED", id, position} | {"REPLAY", id} | {"IDEM_CONFLICT"}
--       | {"NOT_ENABLED"}

if ARGV[9] == "1" and redis.call("HGET", KEYS[5], "queue_enabled") ~= "1" then
  return {"NOT_ENABLED"}
end

if ARGV[7] ~= "" then
  local held = redis.call("GET", KEYS[6])
  if held then
    local sep = string.find(held, "|", 1, true)
    local fingerprint = string.sub(held, 1, sep - 1)
    if fingerprint ~= ARGV[7] then
      return {"IDEM_CONFLICT"}
    end
    return {"REPLAY", string.sub(held, sep + 1)}
  end
end

local seq = redis.call("INCR", KEYS[3])
redis.call("HSET", KEYS[1],
  "id", ARGV[1], "workspace", ARGV[2], "model", ARGV[3], "provider", ARGV[4],
  "status", "IN_QUEUE", "body", ARGV[5], "seq", seq, "created_at", ARGV[6])
redis.call("ZADD", KEYS[2], seq, ARGV[1])
redis.call("ZADD", KEYS[4], ARGV[10], ARGV[1])
if ARGV[7] ~= "" then
  redis.call("HSET", KEYS[1], "idem", KEYS[6])
  redis.call("SET", KEYS[6], ARGV[7] .. "|" .. ARGV[1], "EX", ARGV[8])
end
return {"ADMITTED", ARGV[1], redis.call("ZRANK", KEYS[2], ARGV[1])}
