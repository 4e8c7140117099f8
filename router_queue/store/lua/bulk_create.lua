-- bulk_create.lua: write a new bulk action's progress hash, or answer the one
-- its Idempotency-Key already names (store/bulk.py, BulkActions.create).
-- KEYS[1] W:bulk-idem:{key hash}, or KEYS[2] again when the call sent no key
-- KEYS[2] W:bulk:{bulk id}
-- KEYS[3] W:bulks (the workspace's unfinished actions, by when each began)
-- ARGV[1] the bulk id   ARGV[2] what the key is bound to (the body's fingerprint)
-- ARGV[3] seconds the bulk action (and its key) is kept
-- ARGV[4] most unfinished actions the workspace may have   ARGV[5] now (Unix s)
-- ARGV[6..] field, value pairs of the new hash
-- returns {"CREATED", bulk id} | {"REPLAY", the key's bulk id} | {"CONFLICT"}
--       | {"FULL"} (as many unfinished actions as it may: nothing written)
if KEYS[1] ~= KEYS[2] then
  local held = redis.call("GET", KEYS[1])
  if held then
    local sep = string.find(held, "|", 1, true)
    if string.sub(held, sep + 1) == ARGV[2] then
      return {"REPLAY", string.sub(held, 1, sep - 1)}
    end
    return {"CONFLICT"}
  end
end
-- an action expired unfinished (its progress gone) no longer counts
redis.call("ZREMRANGEBYSCORE", KEYS[3], "-inf", tonumber(ARGV[5]) - tonumber(ARGV[3]))
if redis.call("ZCARD", KEYS[3]) >= tonumber(ARGV[4]) then
  return {"FULL"}
end
redis.call("ZADD", KEYS[3], ARGV[5], ARGV[1])
if KEYS[1] ~= KEYS[2] then
  redis.call("SET", KEYS[1], ARGV[1] .. "|" .. ARGV[2], "EX", ARGV[3])
end
local fields = {}
for i = 6, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call("HSET", KEYS[2], unpack(fields))
redis.call("EXPIRE", KEYS[2], ARGV[3])
return {"CREATED", ARGV[1]}
