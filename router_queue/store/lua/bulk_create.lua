-- bulk_create.lua: write a new bulk action's progress hash, or answer the one
-- its Idempotency-Key already names (store/bulk.py, BulkActions.create).
-- KEYS[1] W:bulk-idem:{key hash}, or KEYS[2] again when the call sent no key
-- KEYS[2] W:bulk:{bulk id}
-- KEYS[3] W:bulks (the workspace's unfinished actions, by when each began)
-- ARGV (named, store/bulk.py CREATE_ARGS): bulk_id; bound_to (what the key is bound to: the body's
-- fingerprint); keep (seconds the action and its key are kept); max_running (most unfinished actions
-- the workspace may have); now (Unix s); then (ARG_REST..) field, value pairs of the new hash
-- returns {"CREATED", bulk id} | {"REPLAY", the key's bulk id} | {"CONFLICT"}
--       | {"FULL"} (as many unfinished actions as it may: nothing written)
if KEYS[1] ~= KEYS[2] then
  local held = redis.call("GET", KEYS[1])
  if held then
    local sep = string.find(held, "|", 1, true)
    if string.sub(held, sep + 1) == ARGV[ARG_BOUND_TO] then
      return {"REPLAY", string.sub(held, 1, sep - 1)}
    end
    return {"CONFLICT"}
  end
end
-- an action expired unfinished (its progress gone) no longer counts
redis.call("ZREMRANGEBYSCORE", KEYS[3], "-inf", tonumber(ARGV[ARG_NOW]) - tonumber(ARGV[ARG_KEEP]))
if redis.call("ZCARD", KEYS[3]) >= tonumber(ARGV[ARG_MAX_RUNNING]) then
  return {"FULL"}
end
redis.call("ZADD", KEYS[3], ARGV[ARG_NOW], ARGV[ARG_BULK_ID])
if KEYS[1] ~= KEYS[2] then
  redis.call("SET", KEYS[1], ARGV[ARG_BULK_ID] .. "|" .. ARGV[ARG_BOUND_TO], "EX", ARGV[ARG_KEEP])
end
local fields = {}
for i = ARG_REST, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call("HSET", KEYS[2], unpack(fields))
redis.call("EXPIRE", KEYS[2], ARGV[ARG_KEEP])
return {"CREATED", ARGV[ARG_BULK_ID]}
