-- lib/model_room.lua: the schedule's room per model (cap_of, first_head,
-- room_in, take_picked): a 429 pauses one model on its member, so a pool paused
-- by one model's 429s still grants the others, and a request that named a
-- fallback whose members are free.
-- requires:

-- ---------------------------------------------------------------------------
-- The caller passes the pool's capacity as "cap" or, while some model has
-- less room than the pool (its 429s paused it on some members: PoolCapacity),
-- "cap;model=cap,...". A request's room is the most any model it may run on
-- has (the path's and those it named in X-Comfy-Fallback-Models; a model not
-- listed has the pool's): it is granted while fewer than that are in flight.
-- Without such a list (the common case) nothing here reads anything, and the
-- schedule grants as it always did. With one, grant() takes, of the head
-- workspace's first MODEL_LOOKAHEAD requests, the first that has room (a
-- workspace's own order, passed over for one that can run); a workspace none
-- of whose has room is left for this step (S.blocked) with its tag, so it
-- comes first again once its model has room, and the next head is asked.
-- ---------------------------------------------------------------------------

--: How many of a workspace's first requests a grant asks about while a model is paused.
local MODEL_LOOKAHEAD = 8

-- The pool's cap, the models below it ({model = cap}, or nil when none is),
-- and each region's room ({region = cap}, "@region=cap" entries: lib/pins.lua;
-- nil when the pool names no regions).
local function cap_of(arg)
  local total, below = string.match(tostring(arg), "^([^;]*);(.*)$")
  if not total then
    return tonumber(arg), nil, nil
  end
  local caps, regions = {}, {}
  for name, cap in string.gmatch(below, "([^,=]+)=(%-?%d+)") do
    if string.sub(name, 1, 1) == "@" then
      regions[string.sub(name, 2)] = tonumber(cap)
    else
      caps[name] = tonumber(cap)
    end
  end
  return tonumber(total), next(caps) and caps or nil, next(regions) and regions or nil
end

-- Leave workspace `ws` for this grant: it keeps its tag, and first_head passes it over.
local function pass_over(S, ws)
  S.blocked = S.blocked or {}
  S.blocked[ws] = true
end

-- The heads in tag order, passing over the workspaces left for this step:
-- ZRANGE's one first head when none is (its reply, {} for none).
local function first_head(S, heads)
  if not S.blocked then
    return redis.call("ZRANGE", heads, 0, 0, "WITHSCORES")
  end
  local some = redis.call("ZRANGE", heads, 0, MODEL_LOOKAHEAD * 4 - 1, "WITHSCORES")
  for i = 1, #some, 2 do
    if not S.blocked[string.sub(some[i], 17)] then
      return {some[i], some[i + 1]}
    end
  end
  return {}
end

-- The most room any model a request may run on has: `model`, or one of `fallbacks` ("a,b").
local function room_of_models(S, model, fallbacks)
  local room = S.model_caps[model or ""] or S.cap
  for named in string.gmatch(fallbacks or "", "[^,]+") do
    room = math.max(room, S.model_caps[named] or S.cap)
  end
  return room
end

local function room_of(S, request_id)
  local f = redis.call("HMGET", key_request(request_id), "model", "fallback_models")
  return room_of_models(S, f[1], f[2])
end

-- grant_directly's: the room of the request whose fields `record` is about to write
-- (a flat list, as append builds it), read from them; the pool's cap without model caps.
local function room_for(S, record)
  if not S.model_caps or not record then
    return S.cap
  end
  local f = {}
  for i = 1, #record - 1, 2 do
    f[record[i]] = record[i + 1]
  end
  return room_of_models(S, f.model, f.fallback_models)
end

-- Whether workspace `ws` has a request that may be granted now, with
-- `in_flight` taken (`urgent_only`: the reserve is all that is free, so not a
-- low one). True at once without model caps (grant() then pops its first);
-- else the one found waits in S.picked, or the workspace is left for this step.
local function room_in(S, ws, in_flight, urgent_only)
  if not S.model_caps then
    return true
  end
  local first = redis.call("ZRANGE", S.base .. ":ws:" .. ws, 0, MODEL_LOOKAHEAD - 1, "WITHSCORES")
  for i = 1, #first, 2 do
    if urgent_only and tonumber(first[i + 1]) >= 2 * 35184372088832 then
      break  -- a low band's: every one after it is low too (reserve.lua's LOW_SCORE)
    end
    if in_flight < room_of(S, first[i]) then
      S.picked = {first[i], first[i + 1]}
      return true
    end
  end
  pass_over(S, ws)
  return false
end

-- The request room_in found (out of its workspace's queue), else the workspace's first: {id, score}.
local function take_picked(S, ws)
  local picked = S.picked
  if not picked then
    return redis.call("ZPOPMIN", S.base .. ":ws:" .. ws)
  end
  S.picked = nil
  redis.call("ZREM", S.base .. ":ws:" .. ws, picked[1])
  return picked
end
