-- purge.lua: drop the index entries whose request record has expired (an
-- operator's repair, `router-queue ops purge-expired`), checked and removed in
-- one step so a request admitted meanwhile is never dropped.
--
-- KEYS: the indexes (P:queue:{provider}, P:running:{provider}, ...)
-- returns how many entries were removed

local purged = 0
for _, index in ipairs(KEYS) do
  for _, id in ipairs(redis.call("ZRANGE", index, 0, -1)) do
    if redis.call("EXISTS", key_request(id)) == 0 then
      purged = purged + redis.call("ZREM", index, id)
    end
  end
end
return purged
