-- grant.lua: give a provider's free slots to the requests its schedule names
-- next (lib/schedule.lua, grant). Every script that frees a slot does this itself; the
-- sweeper runs it too, so a raised cap or a lost step heals within a sweep.
--
-- KEYS[1] P:sched:{provider}  KEYS[2] P:running:{provider}
-- KEYS[3] the broker's list for the provider
-- ARGV by name (requests_maintenance.py, GRANT_ARGS): cap (the provider's)  now (s)
--   grant_until (a grant's lease end, s)  template (the message template, or "")
--   low_headroom_pct (the cap's share kept from low priority: schedule.lua, low_reserve_of)
-- returns the granted ids the caller publishes (none when the template pushed them)

return grant(sched_ctx(KEYS[1], KEYS[2], KEYS[3], ARGV[ARG_CAP], ARGV[ARG_NOW], ARGV[ARG_GRANT_UNTIL], ARGV[ARG_TEMPLATE],
  ARGV[ARG_LOW_HEADROOM_PCT]))
