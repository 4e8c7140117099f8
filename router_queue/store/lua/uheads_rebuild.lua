-- uheads_rebuild.lua: `router-queue ops migrate-keys` rebuilds a provider's
-- {base}:uheads from {base}:heads (lib/reserve.lua, urgent_rebuilt), so a
-- workspace whose request that is not low waited from before :uheads was kept
-- may take the reserve at once, not only after its next change
-- (store/migrate_data.py, urgent_heads).
-- KEYS[1] P:sched:{provider}
-- returns how many heads :uheads holds now
return urgent_rebuilt({base = KEYS[1]})
