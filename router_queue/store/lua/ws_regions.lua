-- ws_regions.lua: pin a workspace's requests to the regions named (a comma-
-- separated list), or, with "", unpin it (store/regions.py). A pinned
-- workspace's generations go only to members of those regions, or to members
-- the catalog marks any_region (docs/POOLS.md, "Region pins").
-- KEYS: W:ws   ARGV: named (below)
-- returns 1, or 0 when there is no such workspace
local ws = KEYS[1]
if redis.call("HEXISTS", ws, "name") == 0 then
  return 0
end
if ARGV[ARG_REGIONS] == "" then
  redis.call("HDEL", ws, "regions")
else
  redis.call("HSET", ws, "regions", ARGV[ARG_REGIONS])
end
return 1
