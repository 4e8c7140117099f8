-- lib/body.lua: a request's body: its bytes given back when it leaves the queue
-- (give_back_body), its size (body_size, stored_body), and what happens to it
-- when the request ends (drop_body).
-- requires: util

-- The request's body is no longer queued (it completed, whatever ended it):
-- its bytes go back to the workspace (e.bytes), and the record's body_bytes
-- is zeroed in the same step (appended to `fields`, the caller's one HSET),
-- as settle() zeroes the hold, so no second ending gives them back twice; a
-- request admitted before bodies were counted has none. rec: the record's
-- ENDING_FIELDS. The caller then deletes the body (drop_body).
local function give_back_body(rec, fields, e)
  local bytes = tonumber(rec.body_bytes or "0")
  if bytes > 0 then
    append(fields, "body_bytes", 0)
    e.bytes = bytes
  end
end

--: What P:body:{id} begins with when the body is in the object store
--: (blobs/pointers.py, BodyPointer): "\0obj {size} {sha256} {object key}".
--: A JSON body never begins with a NUL.
local BODY_POINTER = "\0obj "

-- The bytes a body's text stands for: a pointer's size, else its length.
local function body_size(text)
  if string.sub(text, 1, #BODY_POINTER) == BODY_POINTER then
    return tonumber(string.match(text, "^(%d+) ", #BODY_POINTER + 1))
  end
  return #text
end

-- The bytes the body under `key` stands for (0: none), and its pointer
-- text when it is in the object store (else nil).
local function stored_body(key)
  if redis.call("GETRANGE", key, 0, #BODY_POINTER - 1) == BODY_POINTER then
    local pointer = redis.call("GET", key)
    return body_size(pointer), pointer
  end
  return redis.call("STRLEN", key), nil
end

-- A body's object (pointer: its P:body text) handed to the sweeper, to be
-- deleted once the pointer is gone (store/objects.py): at `at`, when the
-- pointer expires or (now) was deleted. `id`: the body's request.
local function forget_body_object(pointer, id, provider, at)
  local object = string.match(pointer, "^%d+ %x+ (.+)$", #BODY_POINTER + 1)
  redis.call("ZADD", key_objects(id, provider), at, id .. " " .. object)
end

-- The body of a request that ended (rec: its ENDING_FIELDS): deleted when it
-- succeeded (keep false) and shares no one's, else kept `retention` seconds,
-- no longer counted as queued but in its workspace's stored bytes (e.kept:
-- keep_stored, with ws_id). A retry shares the body of the first request
-- of its chain (its record's body_of; P:body:{that id}), which lives on
-- while any retry sharing it waits or runs (its refs' "live", PERSISTed by
-- place_admission), then the retention after the last of them ends, so it
-- outlives every record naming it. A body in the object store (a pointer)
-- counts its object's bytes, and its object goes to the sweeper, due when
-- the pointer goes (forget_body_object).
local function drop_body(body_key, retention, keep, rec, e, ws_id, now)
  local owner = rec.body_of
  if owner then
    body_key = key_body(owner)
    local refs = key_body_refs(owner)
    if redis.call("HINCRBY", refs, "live", -1) > 0 then
      return  -- another retry sharing it still waits or runs
    end
    redis.call("EXPIRE", refs, retention)
  end
  local bytes, pointer = stored_body(body_key)
  local id, untl = owner or e.request_id, tonumber(now) + tonumber(retention)
  if not owner and not keep then
    redis.call("DEL", body_key)
    untl = tonumber(now)
  elseif bytes > 0 then
    redis.call("EXPIRE", body_key, retention)
    e.kept = {ws = ws_id, id = id, bytes = bytes, untl = untl}
  end
  if pointer and rec.provider then
    forget_body_object(pointer, id, rec.provider, untl)
  end
end
