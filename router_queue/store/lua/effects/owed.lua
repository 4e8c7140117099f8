-- effects/owed.lua: where a step's workspace effects go on a store split
-- into per-slot steps (a Redis Cluster: store/owed.py, OwedEffects, links it
-- into the scripts that owe them): a provider's step cannot touch its
-- workspace's keys, so it owes them.

-- Set in `k`, the step's keys, where owe_ws (lib/ledger.lua) puts its
-- workspace's effects: the provider's owed set (k.owed: keys.py,
-- P:owed:{provider}, given in both places the workspace's hash and ledger
-- take on one Redis), applied by the workspace's own step (ws_settle.lua)
-- once the caller has the reply, or by the sweeper for a caller that died first.
local function ws_target(k, owed_key, _)
  k.owed = owed_key
  return k
end
