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
-- Record hash fields: scope task key fp state task_id owner attempt lease created updated
-- expires ttl [call] [linger] [result ctype cenc | error]. Times are POSIX seconds with 6 decimals.
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

local function load(key, now)
  -- Returns the live record as a table plus its flat HGETALL form (or nil), and whether the key
  -- exists at all (a record past its expiry may still be stored under an injected clock).
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil, flat, false end
  local rec = {}
  for i = 1, #flat, 2 do rec[flat[i]] = flat[i + 1] end
  if tonumber(rec.expires) <= now then return nil, {}, true end
  return rec, flat, true
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
