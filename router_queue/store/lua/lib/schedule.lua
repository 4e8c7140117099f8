-- lib/schedule.lua: the fair schedule behind each provider's cap (enqueue, grant,
-- grant_directly, release_slot, position).
-- requires: util, model_room, reserve, pins

-- ---------------------------------------------------------------------------
-- The schedule behind a provider's cap (keys.py, "P:sched:{provider}").
--
-- Waiting costs nothing: a request that cannot start has no Celery message.
-- When a slot is free, grant() moves the request the schedule names next into
-- P:running:{provider} (the slot is its from then on) and pushes one Celery
-- message for it; a worker's claim starts it. Every script that frees a slot
-- or adds a waiting request ends with grant().
--
-- The order is start-time fair queuing over workspaces. Each waiting request
-- holds a slot in the provider's order, a member of {base}:slots scored by a
-- virtual-time tag: a workspace of weight w that queues a request gets the tag
-- max(vtime, its last tag) + QUANTUM / w, where vtime is the tag of the slot
-- granted last. Slots are granted lowest tag first (ties: the older slot).
-- So workspaces take turns in proportion to their weights, a workspace alone
-- gets every slot, and a workspace that was idle starts at the current round
-- with no credit saved up. A workspace's slots go to its own requests in
-- priority order, FIFO within a priority ({base}:ws:{ws}).
--
-- grant() picks from {base}:heads, each workspace's first slot (its lowest
-- tag), so the next slot is one ZRANGE whatever the depth. A workspace at its
-- own max_in_flight is parked: its head leaves {base}:heads until one of its
-- requests ends, when it comes back with its old tag, so it takes its next
-- slot at once (max-min fair: it only ever had less than its share). Parking
-- and unparking are O(log n): the slots themselves stay where they are.
-- Once only the slots kept from `low` work are free, the pick is the first of
-- {base}:uheads, the heads whose workspace's first request is not low
-- (lib/reserve.lua): one ZRANGE too. So every step here is O(log n) a slot.
--
-- S, the scheduler's context: base ("P:sched:{provider}"), running
-- (P:running:{provider}), cap (model_caps: lib/model_room.lua; region_caps:
-- lib/pins.lua), now, grant_until (lease of a grant not yet
-- claimed: the reaper publishes it again after that), list (the broker's
-- list for the provider) and template (its Celery message with RQTPLREQ,
-- RQTPLTASK and RQTPLTAG standing for the request id, task id and delivery
-- tag), or template "" when the caller publishes the granted ids itself.
-- ---------------------------------------------------------------------------

--: Virtual time one request of a weight-1 workspace takes; divisible by 1..16.
local QUANTUM = 720720
local function num(x)
  return string.format("%.17g", x)
end

local function workspace_of_slot(member)
  return string.sub(member, 17)  -- "%015d|{ws}"
end

local function sched_ctx(base, running, list, cap_arg, now, grant_until, template, headroom_pct)
  local cap, model_caps, region_caps = cap_of(cap_arg)
  return {base = base, running = running, list = list, cap = cap, now = now, grant_until = grant_until,
          template = template, limits = {}, low_reserve = low_reserve_of(cap, headroom_pct), model_caps = model_caps,
          region_caps = region_caps}
end

-- A workspace's weight (>= 1), its own cap on requests in flight per
-- provider (0: none) and its pin's group (lib/pins.lua; "" for none), from
-- its hash's "weight" and "max_in_flight" (v1, v2: strings, or false when
-- absent) and the group.
local function limits_of(v1, v2, group)
  return {math.max(tonumber(v1 or "1") or 1, 1), tonumber(v2 or "0") or 0, group or ""}
end

-- The workspace's weight, its own cap and its group (limits_of), read once per script.
-- A caller that read them from the workspace's hash puts them in S.limits
-- first (admit.lua); any other step reads the copy the schedule keeps while
-- the workspace has requests waiting ("lim|ws", written by enqueue from
-- admission's reading and by accounts.py when an operator changes them), so
-- granting reads nothing outside the provider's own keys. A workspace found
-- waiting with no copy queued before the schedule kept one: its own hash.
local function ws_limits(S, ws)
  local known = S.limits[ws]
  if not known then
    local copy = redis.call("HGET", S.base, "lim|" .. ws)
    if copy then
      local weight, cap = string.match(copy, "^([^:]*):([^:]*)")
      known = limits_of(weight, cap, copy_group(copy))
    else
      local v = redis.call("HMGET", key_workspace(ws), "weight", "max_in_flight", "regions")
      known = limits_of(v[1], v[2], pin_group(S, v[3]))
    end
    S.limits[ws] = known
  end
  return known[1], known[2], known[3]
end

-- The workspace's first slot, as a {member, tag} pair, or nil when it has none.
local function first_slot(S, ws)
  local head = redis.call("ZRANGE", S.base .. ":wslots:" .. ws, 0, 0, "WITHSCORES")
  if #head == 0 then
    return nil
  end
  return head
end

local function park(S, ws)
  local head = first_slot(S, ws)
  if head then
    redis.call("ZREM", heads_of(S, select(3, ws_limits(S, ws))), head[1])
    redis.call("ZREM", S.base .. ":uheads", head[1])
  end
  redis.call("HSET", S.base, "parked|" .. ws, "1")
end

local function unpark(S, ws)
  redis.call("HDEL", S.base, "parked|" .. ws)
  local head = first_slot(S, ws)
  if head then
    redis.call("ZADD", heads_of(S, select(3, ws_limits(S, ws))), head[2], head[1])
    urgent_head(S, ws, head)
  end
end

-- A new waiting request takes the next slot of its workspace (a workspace
-- already waiting keeps the group it waits in: lib/pins.lua).
local function enqueue(S, ws, request_id, seq, priority)
  local base = S.base
  local weight, cap, group = ws_limits(S, ws)
  local v = redis.call("HMGET", base, "vtime", "f|" .. ws, "lim|" .. ws)
  if v[3] then
    group = pin_waiting_group(S, request_id, v[3], group)
    S.limits[ws] = {weight, cap, group}
  end
  local tag = math.max(tonumber(v[1] or "0"), tonumber(v[2] or "0")) + math.floor(QUANTUM / weight)
  local member = string.format("%015d|", redis.call("HINCRBY", base, "slotseq", 1)) .. ws
  redis.call("HSET", base, "f|" .. ws, num(tag), "lim|" .. ws, group_copy(weight .. ":" .. cap, group))
  pin_slot_added(base, group, num(tag), member)
  redis.call("ZADD", base .. ":slots", num(tag), member)
  redis.call("ZADD", base .. ":wslots:" .. ws, num(tag), member)
  local head = nil
  if redis.call("ZCARD", base .. ":wslots:" .. ws) == 1 and redis.call("HEXISTS", base, "parked|" .. ws) == 0 then
    redis.call("ZADD", heads_of(S, group), num(tag), member)
    head = {member, num(tag)}
  end
  local score = (BANDS[priority] or 1) * BAND_SPAN + seq
  urgent_queued(S, ws, score, head)
  redis.call("ZADD", base .. ":ws:" .. ws, num(score), request_id)
  redis.call("ZINCRBY", base .. ":depths", 1, ws)
end

-- A workspace with nothing left waiting keeps no tag; once no workspace
-- waits, no tag exists and virtual time starts again from 0 (tags are exact
-- integers in a double: this keeps them far from 2^53).
local function forget_workspace_if_idle(S, ws)
  if tonumber(redis.call("ZINCRBY", S.base .. ":depths", -1, ws)) <= 0 then
    redis.call("ZREM", S.base .. ":depths", ws)
    redis.call("HDEL", S.base, "f|" .. ws, "parked|" .. ws, "lim|" .. ws)
    if redis.call("ZCARD", S.base .. ":depths") == 0 then
      redis.call("HDEL", S.base, "vtime", "urgent")  -- (urgent: a count kept before :uheads)
    end
  end
end

-- A waiting (not granted) request leaves the schedule: cancelled or timed out.
-- Its workspace gives back its last slot, so the requests behind it move up.
local function dequeue_waiting(S, ws, request_id)
  local score = redis.call("ZSCORE", S.base .. ":ws:" .. ws, request_id)
  if not score then
    return false
  end
  redis.call("ZREM", S.base .. ":ws:" .. ws, request_id)
  local wslots = S.base .. ":wslots:" .. ws
  local last = redis.call("ZPOPMAX", wslots)
  if #last > 0 then
    local group = select(3, ws_limits(S, ws))
    redis.call("ZREM", S.base .. ":slots", last[1])
    pin_slot_removed(S.base, group, last[1])
    redis.call("ZREM", heads_of(S, group), last[1])  -- it was the head only when it was the only slot
    local now_last = redis.call("ZRANGE", wslots, -1, -1, "WITHSCORES")
    if #now_last > 0 then
      redis.call("HSET", S.base, "f|" .. ws, now_last[2])
    end
    urgent_left(S, ws, score, last[1], #now_last == 0)
  end
  forget_workspace_if_idle(S, ws)
  return true
end

-- A request leaves P:running (it ended, or a grant ended unclaimed): its
-- workspace has one fewer in flight and may be unparked. True when it held a
-- slot. `started`: it is IN_PROGRESS, so claim.lua already took it out of
-- :granted, in the step that started it (nothing grants a started request).
local function release_slot(S, ws, request_id, started)
  if redis.call("ZREM", S.running, request_id) == 0 then
    return false
  end
  if not started then
    redis.call("ZREM", S.base .. ":granted", request_id)
  end
  local counts = redis.call("HMGET", S.base, "run|" .. ws, "parked|" .. ws, "pinof|" .. request_id)
  if counts[3] then
    pin_released(S, counts[3], request_id)
  end
  local left = tonumber(counts[1] or "0") - 1
  if left <= 0 then
    redis.call("HDEL", S.base, "run|" .. ws)
  else
    redis.call("HINCRBY", S.base, "run|" .. ws, -1)
  end
  if counts[2] then
    local _, limit = ws_limits(S, ws)
    if limit <= 0 or left < limit then
      unpark(S, ws)
    end
  end
  return true
end

-- A request ends while IN_QUEUE: out of the schedule, or out of its granted slot.
local function leave_schedule(S, ws, request_id)
  if not release_slot(S, ws, request_id) then
    dequeue_waiting(S, ws, request_id)
  end
end

-- The request (IN_QUEUE, out of the schedule's waiting structures) takes a
-- slot in P:running: it is granted, in grant order, counted in its
-- workspace's run|ws, and its Celery message pushed (S.template), else its
-- id added to `granted` for the caller to publish. `record`, when given, is
-- the request's fields its caller is about to write (admit.lua, one HSET):
-- granted_at goes with them instead of in a write of its own. Returns how
-- many requests it added to P:running (1; 0 if it somehow held a slot).
local function give_slot(S, ws, request_id, granted, record)
  local base = S.base
  local n = redis.call("HINCRBY", base, "grantseq", 1)
  if record then
    append(record, "granted_at", S.now)
  else
    redis.call("HSET", key_request(request_id), "granted_at", S.now)
  end
  local added = redis.call("ZADD", S.running, S.grant_until, request_id)
  redis.call("ZADD", base .. ":granted", n, request_id)
  redis.call("HINCRBY", base, "run|" .. ws, 1)
  pin_granted(S, select(3, ws_limits(S, ws)), request_id)
  if S.template ~= "" then
    local task = request_id .. "." .. n
    local message = string.gsub(string.gsub(string.gsub(S.template, "RQTPLREQ", request_id),
      "RQTPLTASK", task), "RQTPLTAG", task)
    redis.call("LPUSH", S.list, message)
  else
    granted[#granted + 1] = request_id
  end
  return added
end

-- Give every free slot to the request the schedule names next; returns the
-- ids granted that the caller must publish (none when S.template pushed them).
-- The provider's count in flight (ZCARD P:running) is read once: given by
-- the caller, who read it in this step with nothing changing it since
-- (S.in_flight: grant_directly's, for admit.lua's slow path), else read once
-- the schedule names a head, so that nothing waiting costs one read; then
-- counted here as give_slot adds to it (no other write in this step changes
-- it). The loop is the same: grant while a slot is free and a head exists.
local function grant(S)
  local base = S.base
  local granted = {}
  local in_flight = S.in_flight
  S.in_flight = nil
  while in_flight == nil or in_flight < S.cap do
    local head = pick_head(S)
    if #head == 0 then
      break
    end
    if in_flight == nil then
      in_flight = redis.call("ZCARD", S.running)
      if in_flight >= S.cap then
        break
      end
    end
    if in_flight >= S.cap - S.low_reserve then
      head = reserve_pick(S, head)
      if not head then
        break
      end
    end
    local member, tag = head[1], tonumber(head[2])
    local ws = workspace_of_slot(member)
    local _, limit, group = ws_limits(S, ws)
    if limit > 0 and tonumber(redis.call("HGET", base, "run|" .. ws) or "0") >= limit then
      park(S, ws)
    elseif pin_full(S, group) then
      pass_over(S, ws)  -- its members are full: it waits, holding no slot (lib/pins.lua)
    elseif room_in(S, ws, in_flight, in_flight >= S.cap - S.low_reserve) then  -- else left for this step
      local heads = heads_of(S, group)
      redis.call("ZREM", heads, member)
      redis.call("ZREM", base .. ":slots", member)
      redis.call("ZREM", base .. ":wslots:" .. ws, member)
      pin_slot_removed(base, group, member)
      local next_head = first_slot(S, ws)
      if next_head then
        redis.call("ZADD", heads, next_head[2], next_head[1])
      end
      if tag > tonumber(redis.call("HGET", base, "vtime") or "0") then
        redis.call("HSET", base, "vtime", num(tag))
      end
      local popped = take_picked(S, ws)
      urgent_granted(S, ws, member, popped[2] or false, next_head)
      forget_workspace_if_idle(S, ws)
      local request_id = popped[1]
      if request_id and redis.call("HGET", key_request(request_id), "status") == "IN_QUEUE" then
        in_flight = in_flight + give_slot(S, ws, request_id, granted)
        S.moved = true
      end
    end
  end
  if S.moved then
    announce_moved(base)
  end
  return granted
end

-- admit.lua's fast path: a new request (its record just written IN_QUEUE)
-- that nobody waits ahead of takes a free slot at once. Returns the ids to
-- publish, as grant() does, or nil when the request must take the slow path
-- (enqueue, then grant). It applies when no workspace has a request waiting
-- ({base}:depths is empty: a parked workspace's waiting requests are counted
-- there too), the provider has a free slot, its models have room (model_room) and
-- the workspace is under its own max_in_flight. There, enqueue() then grant() would give the request a
-- slot tagged max(vtime, f|ws) + QUANTUM / weight and take it straight back:
-- the request is the only head, so it is granted, and its workspace, now
-- idle, drops its f|ws and, no one waiting, vtime (both absent before: no
-- one waited). So this leaves what they leave (the same give_slot) without
-- writing and deleting the slot; only the slotseq counter, which only names
-- slots in creation order, is not advanced. `record`: as give_slot's.
-- Also returns the request's position (position(): its rank in :granted).
--
-- The announcement (announce_moved) is made only when someone else is
-- granted and not started (that rank > 0). Otherwise no follower can see a
-- change: nobody waits ({base}:depths is empty) and nobody else is granted,
-- so no other IN_QUEUE request of this provider has a position (position()
-- is false for it) and a running one has none; the new request is appended
-- at the end of :granted (the highest grantseq), and the request itself has
-- no follower yet (its id is answered by this admission). When others are
-- granted, their positions do not change either (they are ahead of it), but
-- a stream of one may still show a position from before a request ahead of
-- it ended unstarted without a grant (release_slot announces nothing then),
-- which this announcement has always woken it to read again: kept, so no
-- stream shows anything later than it did.
-- When it does not apply, S.in_flight keeps the count in flight it read (if
-- it did), for the grant() that follows in the same step.
local function grant_directly(S, ws, request_id, record, priority)
  local in_flight = redis.call("ZCARD", S.running)
  local _, limit, group = ws_limits(S, ws)
  local free = S.cap - (priority == "low" and S.low_reserve or 0)
  if in_flight >= free or in_flight >= room_for(S, record) or redis.call("ZCARD", S.base .. ":depths") > 0
      or pin_full(S, group) or (limit > 0 and tonumber(redis.call("HGET", S.base, "run|" .. ws) or "0") >= limit) then
    S.in_flight = in_flight
    return nil
  end
  local granted = {}
  give_slot(S, ws, request_id, granted, record)
  local rank = redis.call("ZRANK", S.base .. ":granted", request_id)
  if rank > 0 then
    announce_moved(S.base)
  end
  return granted, rank
end

-- queue_position: how many requests start before this one if nothing else
-- arrives. Granted requests start in grant order (their messages are FIFO on
-- the broker), every waiting one after all of them, in slot order:
--   granted, not started:  its rank among the granted
--   waiting:               granted + the slots ahead of the one its rank in
--                          its workspace gives it (rank i takes the i-th slot)
-- Exact while no workspace is held at its own max_in_flight. When one is, its
-- slots still count in tag order, as if its running request ended now: its
-- own positions are a lower bound, and those behind its slots an upper one
-- (as are positions when low work is passed over for the reserve: reserve_pick).
-- Each step is a ZRANK, ZRANGE by index or ZCARD: O(log n) at any depth.
-- A pinned workspace's waiting request leaves out the slots ahead of it of
-- groups sharing none of its members (lib/pins.lua, pin_apart): they wait for
-- other members, so they do not start before it. Granted requests count
-- whatever their group: fewer than the pool's cap, each about to start.
-- `group`: the record's pin_group (false: none), when the caller read it
-- (status.lua); nil: read from the workspace's copy ("lim|ws").
local function position(base, ws, request_id, group)
  local granted_rank = redis.call("ZRANK", base .. ":granted", request_id)
  if granted_rank then
    return granted_rank
  end
  local i = redis.call("ZRANK", base .. ":ws:" .. ws, request_id)
  if not i then
    return false
  end
  local granted = redis.call("ZCARD", base .. ":granted")
  local slot = redis.call("ZRANGE", base .. ":wslots:" .. ws, i, i, "WITHSCORES")
  if not slot[1] then
    return granted + i
  end
  return granted + redis.call("ZRANK", base .. ":slots", slot[1]) - pin_apart(base, ws, group, slot[2], slot[1])
end
