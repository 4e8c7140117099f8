-- grant.lua: give a provider's free slots to the requests its schedule names
-- next (lib/schedule.lua, grant). Every script that frees a slot does this itself; the
-- sweeper runs it too, so a raised cap or a lost step heals within a sweep.
--
-- KEYS[1] P:sched:{provider}  KEYS[2] P:running:{provider}
-- KEYS[3] the broker's list for the provider
-- ARGV[1] the provider's cap  ARGV[2] now (s)  ARGV[3] grant lease end (s)
-- ARGV[4] message template or ""
-- returns the granted ids the caller publishes (none when the template pushed them)

return grant(sched_ctx(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4]))
