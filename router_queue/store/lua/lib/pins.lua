-- lib/pins.lua: region pins in the schedule (pin_group, copy_group, group_copy, pin_full, pin_granted,
-- pin_released, pin_waiting_group, pin_slot_added, pin_slot_removed, pin_apart): a pinned
-- workspace's requests are granted against its members' room, not the
-- pool's, and their queue positions count only the requests competing for
-- those members.
-- requires: model_room

-- ---------------------------------------------------------------------------
-- A workspace pinned to regions (store/regions.py) may run only on the members
-- of those regions and on those the catalog marks any_region. PoolCapacity
-- hands the schedule each region's room with the cap ("@region=n", "@*=n" for
-- the any_region members; lib/model_room.lua's cap_of keeps them in
-- S.region_caps): the learned caps of its members that serve now, 0 while all
-- are paused or out, absent when no member is there.
--
-- A pinned workspace waits in a group: the regions of its pin that have
-- members, sorted, and "*" when any_region members exist ("europe-west4,*").
-- Its group is fixed when it starts waiting (kept with its limits, "lim|ws"),
-- so a set-regions reaches the schedule once its waiting requests are granted
-- or gone (the worker applies it at once). A pin no member serves has no
-- group: the request is granted as any other and the worker ends it
-- provider_error without sending it (docs/POOLS.md).
--
-- Granting: a group's requests in flight are counted ("pinrun|{group}", each
-- request's group kept while it holds its slot, "pinof|{id}"). Each group is a
-- queue of its own: its workspaces' heads are in {base}:gheads:{group}, not in
-- {base}:heads (the unpinned workspaces'), and a grant takes the first head in
-- tag order of :heads and of each group whose requests in flight leave its
-- room (pick_head: one ZRANGE a group). So a full group is passed over whole,
-- however many of its workspaces wait, its workspaces keep their tags, and the
-- first is granted once its members have room: a pinned request waits
-- IN_QUEUE holding no provider slot, and the unpinned are granted meanwhile.
--
-- Positions: the group's waiting slots are mirrored in {base}:pslots:{group}
-- (the same members and tags), the groups waiting listed in {base}:pins. A
-- pinned request's position leaves out the slots ahead of its own that belong
-- to groups sharing none of its members; an unpinned request competes with
-- every one, so its position is as before and reads nothing more.
-- ---------------------------------------------------------------------------

--: How many equal-tag slots of another group a position reads to order them exactly.
local PIN_TIES = 64

-- The group of a workspace pinned to `regions` ("a,b", its hash's field), or
-- "" when it is not pinned or no member of the pool serves its pin.
local function pin_group(S, regions)
  if not regions or regions == "" or not S.region_caps then
    return ""
  end
  local named = {}
  for region in string.gmatch(regions, "[^,]+") do
    if S.region_caps[region] and not named[region] then
      named[region] = true
      named[#named + 1] = region
    end
  end
  table.sort(named)
  if S.region_caps["*"] then
    named[#named + 1] = "*"
  end
  return table.concat(named, ",")
end

-- The group a workspace's limits copy ("lim|ws": "{weight}:{max_in_flight}[:{group}]",
-- lib/schedule.lua) names, "" for none (or no copy).
local function copy_group(copy)
  return string.match(copy or "", "^[^:]*:[^:]*:(.+)$") or ""
end

-- That copy written: `limits` ("{weight}:{max_in_flight}") with `group`, if any.
local function group_copy(limits, group)
  return group ~= "" and limits .. ":" .. group or limits
end

-- The room of `group` now: its regions' rooms summed.
local function pin_room(S, group)
  local room = 0
  for region in string.gmatch(group, "[^,]+") do
    room = room + (S.region_caps and S.region_caps[region] or 0)
  end
  return room
end

-- How many of `group`'s requests hold a slot, read once per step and counted on
-- by pin_granted (S.pinrun).
local function pin_running(S, group)
  S.pinrun = S.pinrun or {}
  local n = S.pinrun[group]
  if not n then
    n = tonumber(redis.call("HGET", S.base, "pinrun|" .. group) or "0")
    S.pinrun[group] = n
  end
  return n
end

-- Where the heads of the workspaces waiting in `group` are ("": the unpinned', {base}:heads).
local function heads_of(S, group)
  return group == "" and S.base .. ":heads" or S.base .. ":gheads:" .. group
end

-- Whether `group`'s members are full: its requests in flight fill its room.
-- Without region caps (before the pool is first read) nothing is full.
local function pin_full(S, group)
  if group == "" or not S.region_caps then
    return false
  end
  return pin_running(S, group) >= pin_room(S, group)
end

-- grant()'s pick: the first head in tag order of :heads and of each group not
-- full ({member, tag}, {} for none). The groups are read once a step, and only
-- for a pool that names regions (no group waits in any other).
local function pick_head(S)
  local best = first_head(S, S.base .. ":heads")
  if not S.region_caps then
    return best
  end
  S.groups = S.groups or redis.call("SMEMBERS", S.base .. ":pins")
  for _, group in ipairs(S.groups) do
    if not pin_full(S, group) then
      local head = first_head(S, heads_of(S, group))
      if head[1] and (not best[1] or tonumber(head[2]) < tonumber(best[2])
          or (tonumber(head[2]) == tonumber(best[2]) and head[1] < best[1])) then
        best = head
      end
    end
  end
  return best
end

-- give_slot's part: request_id of `group` takes a slot.
local function pin_granted(S, group, request_id)
  if group == "" then
    return
  end
  redis.call("HSET", S.base, "pinof|" .. request_id, group)
  redis.call("HINCRBY", S.base, "pinrun|" .. group, 1)
  if S.pinrun and S.pinrun[group] then
    S.pinrun[group] = S.pinrun[group] + 1
  end
end

-- release_slot's part: request_id, of `group` (its "pinof|" field, read with the
-- workspace's counts), gives its slot back.
local function pin_released(S, group, request_id)
  redis.call("HDEL", S.base, "pinof|" .. request_id)
  local left = tonumber(redis.call("HINCRBY", S.base, "pinrun|" .. group, -1))
  if left <= 0 then
    redis.call("HDEL", S.base, "pinrun|" .. group)
  end
  if S.pinrun and S.pinrun[group] then
    S.pinrun[group] = math.max(left, 0)  -- (a step that granted before this release)
  end
end

-- enqueue's part: the group a workspace already waiting waits in (from its
-- copy "lim|ws", `copy`), kept whatever its pin's `group` is now; the record an
-- admission wrote with its own pin's group (S.admitting) is set right when
-- they differ, so its status reads the group it waits in.
local function pin_waiting_group(S, request_id, copy, group)
  local waiting_in = copy_group(copy)
  if waiting_in ~= group and S.admitting == request_id then
    if waiting_in == "" then
      redis.call("HDEL", key_request(request_id), "pin_group")
    else
      redis.call("HSET", key_request(request_id), "pin_group", waiting_in)
    end
  end
  return waiting_in
end

-- enqueue's part: a slot `member` tagged `tag` of a workspace waiting in `group`.
local function pin_slot_added(base, group, tag, member)
  if group == "" then
    return
  end
  redis.call("ZADD", base .. ":pslots:" .. group, tag, member)
  redis.call("SADD", base .. ":pins", group)
end

-- grant's and dequeue_waiting's part: slot `member` of `group` is gone.
local function pin_slot_removed(base, group, member)
  if group == "" then
    return
  end
  local slots = base .. ":pslots:" .. group
  redis.call("ZREM", slots, member)
  if redis.call("ZCARD", slots) == 0 then
    redis.call("SREM", base .. ":pins", group)
  end
end

-- Whether two groups share no member: no region, and not both "*".
local function apart(a, b)
  local mine = {}
  for region in string.gmatch(a, "[^,]+") do
    mine[region] = true
  end
  for region in string.gmatch(b, "[^,]+") do
    if mine[region] then
      return false
    end
  end
  return true
end

-- position()'s part: of the waiting slots ahead of ws's slot `member` (tagged
-- `tag`) in the provider's order, how many belong to groups sharing no member
-- with `group` (false: none, nothing read; nil: ws's, read from its copy).
-- One SMEMBERS and, per such group, a ZCOUNT (and a ZRANGE of its slots of
-- the same tag, at most PIN_TIES, ordered as :slots orders them).
local function pin_apart(base, ws, group, tag, member)
  if group == nil then
    group = copy_group(redis.call("HGET", base, "lim|" .. ws))
  end
  if not group or group == "" then
    return 0
  end
  local ahead = 0
  for _, other in ipairs(redis.call("SMEMBERS", base .. ":pins")) do
    if apart(group, other) then
      local slots = base .. ":pslots:" .. other
      ahead = ahead + redis.call("ZCOUNT", slots, "-inf", "(" .. tag)
      for _, tied in ipairs(redis.call("ZRANGEBYSCORE", slots, tag, tag, "LIMIT", 0, PIN_TIES)) do
        if tied < member then
          ahead = ahead + 1
        end
      end
    end
  end
  return ahead
end
