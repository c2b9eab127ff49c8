-- Shared prelude: RedisStore prepends this to every script (Redis scripts cannot include files).
--
-- Key layout (every key of one identity shares a hash tag, so a script touches one cluster slot):
--   {<prefix>:<shard>}:r:<len(scope)>:<scope>:<len(task)>:<task>:<key>   record hash
--   {<prefix>:<shard>}:lease                                            lease index, zset
-- shard = crc32(scope NUL task NUL key) mod 16. The 16 is FIXED (redis/base.py INDEX_SHARDS): it is part
-- of every record's key, so it is never a setting. The index holds the record keys of its shard that
-- are PENDING or IN_PROGRESS, scored by lease expiry (POSIX seconds). A script that touches a record
-- gets KEYS[1] = the record hash and KEYS[2] = its shard's lease index (one slot: the same tag);
-- any other per-identity key a script needs must carry the same {<prefix>:<shard>} tag.
--
-- A record is a hash while PENDING or IN_PROGRESS, and a packed string once settled (below).
-- Record hash fields: scope task key fp state task_id owner attempt lease created updated
-- expires ttl [call] [linger] [prev]. Times are POSIX seconds with 6 decimals. (A settled record
-- written before the packed format is a hash too, with [result ctype cenc | error]: still read.)
-- `call` (the serialized arguments) is kept only for tasks whose stale action is "requeue".
-- `linger` (hidden: never read back into a record) is the time a BUSY waiter will have looked
-- again by (acquire.lua); settle.lua keeps the outcome at least until then.
-- A record whose `expires` has passed is absent, even while Redis still holds the key.
--
-- Notices: a script that settles, frees or removes a record PUBLISHes an empty message on the
-- channel named by the record key (RedisStore.watch subscribes there). A notice is only a hint to
-- read the record again; with no subscriber a PUBLISH costs the server a dictionary lookup.

local function now_of(arg)
  -- ARGV "now": a number from an injected clock, '' for the server's clock, or '+<seconds>' for the
  -- server's clock shifted forward (tests only: Store.advance_clock_for_tests).
  local shift = 0
  if arg ~= '' then
    if string.sub(arg, 1, 1) ~= '+' then return tonumber(arg) end
    shift = tonumber(string.sub(arg, 2))
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000 + shift
end

local function fmt(x)
  return string.format('%.6f', x)
end

-- The packed settled record (format 1; scripts.py reads it back, settle.lua writes it): a string
--   '>BBBddddI4': format (1), state ('C' COMPLETED or 'F' FAILED), flags, expires, created,
--   updated, ttl, attempt; then length-prefixed strings (a length under 255 in one byte, else 255
--   and the length in four): fingerprint, task id, previous task id, owner
--   digest (the first 8 bytes of SHA-1 of the owner token), content type, content encoding (both
--   '' for application/json, utf-8); then the payload to the end (the result, or the error JSON).
-- flags: 1 = the fingerprint is 64 lowercase hex stored as its 32 bytes; 2 = the task id, 4 = the
-- previous task id, is a lowercase canonical UUID stored as its 16 bytes; 8 = an empty content
-- type and encoding are the caller's own (without it, two empty ones stand for the default). Scope, task and key are
-- in the record's key only; what a settled record no longer needs (lease, call, linger) is gone.
local PACKED, UUID = 1, '^' .. string.rep('%x', 8) .. ('%-' .. string.rep('%x', 4)):rep(3) .. '%-' .. string.rep('%x', 12) .. '$'

local function to_bytes(hex)
  -- Eight digits at a time (a fingerprint's 64 take 8 steps; a digit pair at a time took twice the
  -- server time of the whole conversion). Callers give a multiple of 8 hex digits.
  local parts = {}
  for i = 1, #hex, 8 do parts[#parts + 1] = struct.pack('>I4', tonumber(string.sub(hex, i, i + 7), 16)) end
  return table.concat(parts)
end

local function to_hex(bytes)
  return (bytes:gsub('.', function(c) return string.format('%02x', string.byte(c)) end))
end

local function lower_hex(text, pattern)
  return string.match(text, pattern) ~= nil and not string.find(text, '[A-F]')
end

local function packed(s)
  if #s < 255 then return struct.pack('>B', #s) .. s end
  return struct.pack('>BI4', 255, #s) .. s
end

local function pack_settled(rec, state, expires, now, payload, ctype, cenc)
  local flags, fp, task_id, prev = 0, rec.fp, rec.task_id, rec.prev or ''
  if #fp == 64 and lower_hex(fp, '^%x+$') then flags, fp = flags + 1, to_bytes(fp) end
  if lower_hex(task_id, UUID) then flags, task_id = flags + 2, to_bytes((task_id:gsub('%-', ''))) end
  if lower_hex(prev, UUID) then flags, prev = flags + 4, to_bytes((prev:gsub('%-', ''))) end
  if ctype == 'application/json' and cenc == 'utf-8' then ctype, cenc = '', ''
  elseif ctype == '' and cenc == '' then flags = flags + 8 end  -- a caller's own empty pair, not the default
  return struct.pack('>BBBddddI4', PACKED, string.byte(state), flags, expires, tonumber(rec.created), now,
      tonumber(rec.ttl), tonumber(rec.attempt))
    .. packed(fp) .. packed(task_id) .. packed(prev) .. packed(to_bytes(string.sub(redis.sha1hex(rec.owner), 1, 16)))
    .. packed(ctype) .. packed(cenc) .. payload
end

local function unpack_settled(blob)
  -- What the scripts read of a settled record: state, fingerprint and task id (as they were
  -- given), attempt, expiry.
  local format, state, flags, expires, _, _, _, attempt, at = struct.unpack('>BBBddddI4', blob)
  if format ~= PACKED then error('celery-idem: a record in an unknown format (' .. format .. '): written by a newer version?') end
  local strings = {}
  for i = 1, 2 do
    local size
    size, at = struct.unpack('>B', blob, at)
    if size == 255 then size, at = struct.unpack('>I4', blob, at) end
    strings[i] = string.sub(blob, at, at + size - 1)
    at = at + size
  end
  local fp, task_id = strings[1], strings[2]
  if flags % 2 == 1 then fp = to_hex(fp) end
  if math.floor(flags / 2) % 2 == 1 then
    local hex = to_hex(task_id)
    task_id = hex:sub(1, 8) .. '-' .. hex:sub(9, 12) .. '-' .. hex:sub(13, 16) .. '-' .. hex:sub(17, 20) .. '-' .. hex:sub(21)
  end
  return {state = (state == 67 and 'COMPLETED') or 'FAILED', fp = fp, task_id = task_id, attempt = attempt, expires = expires}
end

local function load(key, now)
  -- Returns the live record as a table plus what a script hands back of it (the flat HGETALL form,
  -- or the packed string), or nil; and whether the key exists at all (a record past its expiry may
  -- still be stored under an injected clock).
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then return nil, {}, false end
  local rec, raw
  if kind == 'string' then
    raw = redis.call('GET', key)
    rec = unpack_settled(raw)
  else
    raw = redis.call('HGETALL', key)
    rec = {}
    for i = 1, #raw, 2 do rec[raw[i]] = raw[i + 1] end
  end
  if tonumber(rec.expires) <= now then return nil, {}, true end
  return rec, raw, true
end

local function settled(rec)
  return rec.state == 'COMPLETED' or rec.state == 'FAILED'
end

local function notify(key)
  redis.call('PUBLISH', key, '')
end

local function expire_at(key, expires, now)
  redis.call('PEXPIRE', key, math.max(1, math.ceil((expires - now) * 1000)))
end

local function write_fresh(key, index, fields, lease, expires, now, existed)
  -- Replace the record whole (no field of an older record survives) and index its lease.
  if existed then redis.call('DEL', key) end
  redis.call('HSET', key, unpack(fields))
  expire_at(key, expires, now)
  redis.call('ZADD', index, lease, key)
end
