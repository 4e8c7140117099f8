-- webhook_secret.lua: a workspace's webhook signing secret, created once or
-- rotated, in one step (two operators at once never lose a secret).
--
--   "create": set it unless the workspace has one ("EXISTS": never shown again)
--   "rotate": the new one signs from now; the current one becomes the previous
--             and keeps signing beside it until previous_until
--
-- KEYS[1] W:ws
-- ARGV by name (accounts.py, SECRET_ARGS): how ("create" | "rotate")
--   secret (the new one)  previous_until (s)
-- returns {"CREATED"} | {"EXISTS"} | {"ROTATED"} | {"MISSING"}

if redis.call("EXISTS", KEYS[1]) == 0 then
  return {"MISSING"}
end
if ARGV[ARG_HOW] == "create" then
  if redis.call("HSETNX", KEYS[1], "webhook_secret", ARGV[ARG_SECRET]) == 1 then
    return {"CREATED"}
  end
  return {"EXISTS"}
end
local current = redis.call("HGET", KEYS[1], "webhook_secret")
if current then
  redis.call("HSET", KEYS[1], "webhook_secret_previous", current, "webhook_previous_until", ARGV[ARG_PREVIOUS_UNTIL])
end
redis.call("HSET", KEYS[1], "webhook_secret", ARGV[ARG_SECRET])
return {current and "ROTATED" or "CREATED"}
