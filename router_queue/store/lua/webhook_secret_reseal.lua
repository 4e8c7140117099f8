-- webhook_secret_reseal.lua: store a workspace's webhook secret sealed anew
-- (``router-queue ops migrate-keys``, store/migrate.py) only if it is still the
-- value migration read: a secret created or rotated meanwhile is never lost.
--
-- KEYS[1] W:ws
-- ARGV by name (migrate.py, RESEAL_ARGS): field ("webhook_secret" |
--   "webhook_secret_previous")  read (its value as read)  sealed (the same
--   secret, sealed with the newest key)
-- returns 1 when stored, 0 when the field changed meanwhile

if redis.call("HGET", KEYS[1], ARGV[ARG_FIELD]) ~= ARGV[ARG_READ] then
  return 0
end
redis.call("HSET", KEYS[1], ARGV[ARG_FIELD], ARGV[ARG_SEALED])
return 1
