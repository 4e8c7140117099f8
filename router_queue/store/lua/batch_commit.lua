-- batch_commit.lua: make a staged batch durable and visible (store/batches.py,
-- BatchStore.commit), or answer the batch an Idempotency-Key already names.
-- Its lines and error results were staged under its id with a TTL; from here
-- they are kept (until the batch finishes: batch_finish.lua).
--
-- KEYS[1] W:batch:{id}  KEYS[2] W:batch:{id}:lines  KEYS[3] W:batch:{id}:results
-- KEYS[4] W:batches  KEYS[5] W:batches:open  KEYS[6] W:batchidem:{keyhash} (unread without a fingerprint)
-- ARGV by name (batches.py, COMMIT_ARGS):
--   id            the batch id
--   now           Unix seconds (its score in the indexes)
--   fingerprint   what the batch call's Idempotency-Key is bound to, or "" (no key)
--   idem_ttl      seconds the key is kept
--   max_open      batches the workspace may have open (not COMPLETED) at once
--   then field, value pairs of the batch's hash
-- returns {"CREATED"} | {"REPLAY", batch id} | {"CONFLICT"} | {"TOO_MANY", open batches}

local fingerprint = ARGV[ARG_FINGERPRINT]
if fingerprint ~= "" then
  local held = redis.call("GET", KEYS[6])
  if held then
    local bar = string.find(held, "|", 1, true)
    if string.sub(held, 1, bar - 1) == fingerprint then
      return {"REPLAY", string.sub(held, bar + 1)}
    end
    return {"CONFLICT"}
  end
end
local open = redis.call("ZCARD", KEYS[5])
if open >= tonumber(ARGV[ARG_MAX_OPEN]) then
  return {"TOO_MANY", open}
end
local fields = {}
for i = ARG_REST, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call("HSET", KEYS[1], unpack(fields))
redis.call("PERSIST", KEYS[2])
redis.call("PERSIST", KEYS[3])
redis.call("ZADD", KEYS[4], ARGV[ARG_NOW], ARGV[ARG_ID])
redis.call("ZADD", KEYS[5], ARGV[ARG_NOW], ARGV[ARG_ID])
if fingerprint ~= "" then
  redis.call("SET", KEYS[6], fingerprint .. "|" .. ARGV[ARG_ID], "EX", ARGV[ARG_IDEM_TTL])
end
return {"CREATED"}
