-- lib/history.lua: the history's streams (history_renewals, history_add).
-- requires: util

-- The history (GET /v2/requests; keys.py, "W:history").
--
-- Two streams per workspace, written by admit.lua with the record: its own,
-- whose entries hold each request's id (16 bytes, the UUID packed), and one
-- per model, whose entries are empty and share the workspace entry's stream
-- id (the model's list points into the workspace's). An entry's stream id is
-- its admission time in ms (never below the last one's: ids only grow) and a
-- sequence. Streams, not sorted sets: an entry costs Redis about 35 bytes and
-- a model's about 7, where a sorted set's costs 176 (bench/run, waiting_memory).
-- ---------------------------------------------------------------------------

-- "0c57a2b5-9a3d-9f1e-8b2a-012345678901" as its 16 bytes, and back.
local function pack_id(request_id)
  return (string.gsub(string.gsub(request_id, "-", ""), "%x%x", function(h)
    return string.char(tonumber(h, 16))
  end))
end

local function unpack_id(packed)
  return string.format("%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
    string.byte(packed, 1, 16))
end

-- The stream's last entry's ms, or 0.
local function last_ms(stream)
  local last = redis.call("XREVRANGE", stream, "+", "-", "COUNT", 1)[1]
  return last and tonumber(string.match(last[1], "^%d+")) or 0
end

-- XADD the entry under `id` and trim what is older than `oldest` (ms) in
-- the same command (exact MINID, as XTRIM would); nil, nothing changed, when
-- XADD refuses the id because the stream's last entry is not below it.
local function xadd_trimmed(stream, oldest, id, field, value)
  local added = redis.pcall("XADD", stream, "MINID", oldest, id, field, value)
  if type(added) == "table" and added.err then
    return nil
  end
  return added
end

--: Seconds between renewals of a history stream's expiry (history_add).
local HISTORY_RENEW_S = 60

-- Whether a history stream whose expiry was last renewed to last at least
-- until `until_` (Unix seconds, the workspace hash's field history_add
-- names; false: never renewed) still lasts `keep` seconds past `now`. It
-- must not last more than one renewal longer (a shorter retention, or a
-- renewal stamped by a clock ahead of this one): renewed then too.
local function history_lasts(until_, now, keep)
  local u = tonumber(until_)
  return u ~= nil and now + keep <= u and u <= now + keep + HISTORY_RENEW_S
end

-- The history's expiry, renewed at most once a minute per stream: the
-- workspace hash's fields a renewal writes (admit.lua writes them with its
-- counts), appended to `fields`, and whether each stream is due. A stream is
-- renewed to keep + HISTORY_RENEW_S seconds, and its field says until when
-- (at most that), so that until the next renewal, at most a minute later,
-- every admission's entry is kept at least `keep` seconds, as when each
-- admission renewed it to `keep`. ws_until, model_until: the fields' values.
local function history_renewals(model, now, keep, ws_until, model_until, fields)
  now, keep = tonumber(now), tonumber(keep)
  local until_ = math.floor(now) + keep + HISTORY_RENEW_S
  local renew = {ws = not history_lasts(ws_until, now, keep), model = not history_lasts(model_until, now, keep)}
  if renew.ws then
    append(fields, "history_until", until_)
  end
  if renew.model then
    append(fields, "history_until|" .. model, until_)
  end
  return renew
end

-- List a request just admitted (now: Unix seconds) in its workspace's and
-- its model's history; trim what is older than `keep` seconds, and let a
-- history nobody admits to any more expire after its newest entry (renew:
-- history_renewals, which streams' expiry to renew now). An entry's
-- ms is its admission's, or the stream's last one's when that is later (the
-- clock of another front door ahead of this one's): ids only grow. That is
-- rare, so it is read only when XADD refuses the admission's own ms. Never an
-- error (a script that failed here would leave the admission half done): a
-- model's stream that is somehow ahead of its workspace's (one was deleted
-- by hand) just misses the entry, and is trimmed all the same.
local function history_add(ws_stream, model_stream, request_id, now, keep, renew)
  local keep_ms = tonumber(keep) * 1000
  local function oldest(ms)  -- the trim's MINID for an entry at ms
    return string.format("%.0f", math.max(0, ms - keep_ms))
  end
  local ms = math.floor(tonumber(now) * 1000)
  local packed = pack_id(request_id)
  local id = xadd_trimmed(ws_stream, oldest(ms), string.format("%.0f-*", ms), "i", packed)
  if not id then
    ms = math.max(ms, last_ms(ws_stream))
    id = redis.call("XADD", ws_stream, "MINID", oldest(ms), string.format("%.0f-*", ms), "i", packed)
  end
  if not xadd_trimmed(model_stream, oldest(ms), id, "i", "") then
    redis.call("XTRIM", model_stream, "MINID", oldest(ms))
  end
  if renew.ws then
    redis.call("EXPIRE", ws_stream, tonumber(keep) + HISTORY_RENEW_S)
  end
  if renew.model then
    redis.call("EXPIRE", model_stream, tonumber(keep) + HISTORY_RENEW_S)
  end
end
