-- lib/reserve.lua: the provider's last slots kept from `low` work, and the
-- waiting workspaces that may take them ({base}:uheads: reserve_pick, and
-- what keeps it: urgent_head, urgent_queued, urgent_granted, urgent_left;
-- urgent_rebuilt, ops migrate-keys' rebuild).
-- requires: model_room

-- ---------------------------------------------------------------------------
-- LOW_PRIORITY_HEADROOM_PERCENT keeps a provider's last slots from `low` work
-- (a batch), so a normal or high request finds one free at once. Once only
-- those are free, grant() (lib/schedule.lua) gives a slot to the first head in
-- tag order whose workspace's first waiting request is not low. Those heads
-- are kept in a sorted set of their own, {base}:uheads: the members and tags
-- of {base}:heads whose workspace's first request (its :ws: queue's lowest
-- score) is not in the low band. So that pick is one ZRANGE, O(log n), however
-- many low-only workspaces wait ahead of it; whoever changes a workspace's
-- head or its first request keeps :uheads with it (enqueue, grant, park,
-- unpark, dequeue_waiting: the only writers of :heads), in a read or two;
-- queueing, granting or dropping a low request, nothing (granting: unless a
-- model is paused). A workspace waiting from before :uheads was kept joins it
-- at its next change (until then it takes no reserved slot), or when
-- `router-queue ops migrate-keys` rebuilds :uheads from :heads (urgent_rebuilt).
-- ---------------------------------------------------------------------------

--: Priority bands within a workspace, scored band * BAND_SPAN + admission seq.
local BANDS = {high = 0, normal = 1, low = 2}
local BAND_SPAN = 35184372088832  -- 2^45
--: The lowest score a `low` request has in its workspace's queue.
local LOW_SCORE = BANDS.low * BAND_SPAN
--: How many stale entries one pick drops at most (a step of a version that kept no :uheads).
local STALE_DROPS = 32

-- The provider's last slots kept from `low` work: headroom_pct % of the cap rounded up, never
-- all (cap 1: none).
local function low_reserve_of(cap, headroom_pct)
  return math.max(0, math.min(cap - 1, math.ceil(cap * (tonumber(headroom_pct) or 0) / 100)))
end

local function is_low(score)
  return tonumber(score) >= LOW_SCORE
end

local function low_first(S, ws)
  local first = redis.call("ZRANGE", S.base .. ":ws:" .. ws, 0, 0, "WITHSCORES")
  return first[2] ~= nil and is_low(first[2])
end

-- `head` ({member, tag}) is workspace ws's in :heads now: in :uheads too unless its first request is low.
local function urgent_head(S, ws, head)
  if low_first(S, ws) then
    redis.call("ZREM", S.base .. ":uheads", head[1])
  else
    redis.call("ZADD", S.base .. ":uheads", head[2], head[1])
  end
end

-- enqueue's part, before the request (scored `score`) joins ws's queue: `head`, the slot it
-- just made the workspace's head in :heads, or nil (it had slots, or is parked). A low request
-- changes nothing here; another makes a head kept only for low ones a candidate.
local function urgent_queued(S, ws, score, head)
  if is_low(score) then
    return
  end
  if head then
    redis.call("ZADD", S.base .. ":uheads", head[2], head[1])
  elseif low_first(S, ws) and redis.call("HEXISTS", S.base, "parked|" .. ws) == 0 then
    local first = redis.call("ZRANGE", S.base .. ":wslots:" .. ws, 0, 0, "WITHSCORES")
    if first[1] then
      redis.call("ZADD", S.base .. ":uheads", first[2], first[1])
    end
  end
end

-- grant()'s part: ws's head `member` was granted, its request scored `score` taken (false if
-- none); `next_head` is the workspace's head now, or nil. Without a paused model the request
-- taken was the first, so a low one leaves only low ones: nothing to read.
local function urgent_granted(S, ws, member, score, next_head)
  local low_taken = score and is_low(score) and not S.model_caps
  if not low_taken then
    redis.call("ZREM", S.base .. ":uheads", member)
    if next_head then
      urgent_head(S, ws, next_head)
    end
  end
end

-- dequeue_waiting's part: a request scored `score` left ws's queue unrun, and its last slot,
-- `gone`, with it; `emptied`: that was its only slot (so its head). A low one changes nothing.
local function urgent_left(S, ws, score, gone, emptied)
  if is_low(score) then
    return
  end
  if emptied then
    redis.call("ZREM", S.base .. ":uheads", gone)
  elseif low_first(S, ws) then  -- its last request that was not low
    local first = redis.call("ZRANGE", S.base .. ":wslots:" .. ws, 0, 0)
    redis.call("ZREM", S.base .. ":uheads", first[1])
  end
end

-- grant()'s pick once only the reserve is free: `head` unless its workspace's first request
-- is low, else the first of :uheads (passing over the workspaces left for this step, as
-- first_head does), or nil. A low head passed over keeps its tag, so comes first again. An
-- entry no longer a head, or whose first request is low now, is dropped and the next asked:
-- a step of an earlier version, which kept no :uheads, may have left it.
local function reserve_pick(S, head)
  if not low_first(S, string.sub(head[1], 17)) then
    return head
  end
  local uheads = S.base .. ":uheads"
  for _ = 1, STALE_DROPS do
    local pick = first_head(S, uheads)
    if #pick == 0 then
      return nil
    end
    local ws = string.sub(pick[1], 17)
    -- still its workspace's head (its first slot, not parked), whichever heads set holds it
    local first = redis.call("ZRANGE", S.base .. ":wslots:" .. ws, 0, 0)
    if first[1] == pick[1] and redis.call("HEXISTS", S.base, "parked|" .. ws) == 0 and not low_first(S, ws) then
      return pick
    end
    redis.call("ZREM", uheads, pick[1])
  end
  return nil
end

-- ops migrate-keys' part (uheads_rebuild.lua): :uheads made anew from :heads, each head whose
-- workspace's first request is not low, with its tag; one step, so safe while grants run, its
-- cost one read per waiting workspace (about 6 us each: 10,000 hold Redis 60 ms, measured).
-- Returns how many heads it holds.
local function urgent_rebuilt(S)
  local uheads = S.base .. ":uheads"
  redis.call("DEL", uheads)
  local sets = {S.base .. ":heads"}
  for _, group in ipairs(redis.call("SMEMBERS", S.base .. ":pins")) do
    sets[#sets + 1] = S.base .. ":gheads:" .. group  -- (lib/pins.lua)
  end
  for _, set in ipairs(sets) do
    local heads = redis.call("ZRANGE", set, 0, -1, "WITHSCORES")
    for i = 1, #heads, 2 do
      if not low_first(S, string.sub(heads[i], 17)) then
        redis.call("ZADD", uheads, heads[i + 1], heads[i])
      end
    end
  end
  return redis.call("ZCARD", uheads)
end
