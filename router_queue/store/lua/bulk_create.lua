-- bulk_create.lua: write a new bulk action's progress hash, or answer the one
-- its Idempotency-Key already names (store/bulk.py, BulkActions.create).
-- KEYS[1] W:bulk-idem:{key hash}, or KEYS[2] again when the call sent no key
-- KEYS[2] W:bulk:{bulk id}
-- ARGV[1] the bulk id   ARGV[2] what the key is bound to (the body's fingerprint)
-- ARGV[3] seconds the bulk action (and its key) is kept
-- ARGV[4..] field, value pairs of the new hash
-- returns {"CREATED", bulk id} | {"REPLAY", the key's bulk id} | {"CONFLICT"}
if KEYS[1] ~= KEYS[2] then
  local held = redis.call("GET", KEYS[1])
  if held then
    local sep = string.find(held, "|", 1, true)
    if string.sub(held, sep + 1) == ARGV[2] then
      return {"REPLAY", string.sub(held, 1, sep - 1)}
    end
    return {"CONFLICT"}
  end
  redis.call("SET", KEYS[1], ARGV[1] .. "|" .. ARGV[2], "EX", ARGV[3])
end
local fields = {}
for i = 4, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call("HSET", KEYS[2], unpack(fields))
redis.call("EXPIRE", KEYS[2], ARGV[3])
return {"CREATED", ARGV[1]}
