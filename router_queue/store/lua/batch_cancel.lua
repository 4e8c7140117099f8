-- batch_cancel.lua: stop admitting a batch's lines (store/batches.py,
-- BatchStore.cancel). Its lines not yet admitted end cancelled (a read shows
-- each line past the cursor so); a drain whose step lands after this cancels
-- the requests that step admitted (batches/drain.py).
--
-- KEYS[1] W:batch:{id}
-- returns {"CANCELLED", cursor} | {"COMPLETED"} | {"MISSING"}

local state = redis.call("HMGET", KEYS[1], "status", "cursor")
if not state[1] then
  return {"MISSING"}
end
if state[1] == "COMPLETED" then
  return {"COMPLETED"}
end
redis.call("HSET", KEYS[1], "cancelled", "1")
return {"CANCELLED", tonumber(state[2])}
