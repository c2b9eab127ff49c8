-- acquire: worker side, before the body runs.
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)  ARGV[2] fingerprint  ARGV[3] task id  ARGV[4] owner token
-- ARGV[5] lease seconds            ARGV[6] ttl seconds   ARGV[7] scope  ARGV[8] task name  ARGV[9] key
-- ARGV[10] the serialized call ('' = keep the claim's, if any)
-- ARGV[11] next look seconds: on BUSY, how long the waiter may take to look again
-- ARGV[12] '1' when the message is a Celery retry of ARGV[3] (the same attempt chain), else ''
-- Returns {decision, flat record} for REPLAY or MISMATCH (untouched), for BUSY (whose record now
-- holds `linger`: it lives, once settled, until the waiter's next look; see settle.lua), and
-- {'RUN', now, fingerprint, attempt, created, call, prev} when the IN_PROGRESS record was written;
-- prev: the task id of the attempt it took over past its lease (or the prev its claim kept), '' if none.
-- A Celery retry under the record's task id is the same attempt chain: it runs even with other
-- arguments, and the record keeps the fingerprint of the caller's call. Nothing else may, and no
-- retry can exist before an attempt ran (attempt > 0): a claim alone is never a chain.
local now = now_of(ARGV[1])
local rec, flat, existed = load(KEYS[1], now)
local fp, attempt, created, call, prev = ARGV[2], 1, now, ARGV[10], ''
if rec then
  prev = (rec.state == 'IN_PROGRESS' and rec.task_id) or rec.prev or ''
  local chain = ARGV[12] == '1' and rec.task_id == ARGV[3] and tonumber(rec.attempt) > 0
  if rec.fp ~= ARGV[2] and not chain then return {'MISMATCH', flat} end
  if settled(rec) then return {'REPLAY', flat} end
  if rec.state == 'IN_PROGRESS' and tonumber(rec.lease) > now then
    local linger = math.max(tonumber(rec.linger or '0'), now + tonumber(ARGV[11]))
    redis.call('HSET', KEYS[1], 'linger', fmt(linger))
    return {'BUSY', flat}
  end
  fp, attempt, created = rec.fp, tonumber(rec.attempt) + 1, tonumber(rec.created)
  if call == '' and rec.call then call = rec.call end
end
local lease = now + tonumber(ARGV[5])
local expires = lease + tonumber(ARGV[6])
if rec then
  -- Taken from a claim (or a lapsed attempt): only what changes is written. Scope, task, key,
  -- fingerprint and created stay; so do `call` (unless this call brings one) and a waiter's `linger`.
  local fields = {
    'state', 'IN_PROGRESS', 'task_id', ARGV[3], 'owner', ARGV[4], 'attempt', tostring(attempt),
    'lease', fmt(lease), 'updated', fmt(now), 'expires', fmt(expires), 'ttl', ARGV[6],
  }
  if ARGV[10] ~= '' then
    table.insert(fields, 'call')
    table.insert(fields, ARGV[10])
  end
  if prev ~= '' then
    table.insert(fields, 'prev')
    table.insert(fields, prev)
  end
  redis.call('HSET', KEYS[1], unpack(fields))
  expire_at(KEYS[1], expires, now)
  redis.call('ZADD', KEYS[2], lease, KEYS[1])
  return {'RUN', fmt(now), fp, tostring(attempt), fmt(created), call, prev}
end
local fields = {
  'scope', ARGV[7], 'task', ARGV[8], 'key', ARGV[9], 'fp', fp, 'state', 'IN_PROGRESS',
  'task_id', ARGV[3], 'owner', ARGV[4], 'attempt', tostring(attempt), 'lease', fmt(lease),
  'created', fmt(created), 'updated', fmt(now), 'expires', fmt(expires), 'ttl', ARGV[6],
}
if call ~= '' then
  table.insert(fields, 'call')
  table.insert(fields, call)
end
write_fresh(KEYS[1], KEYS[2], fields, lease, expires, now, existed)
return {'RUN', fmt(now), fp, tostring(attempt), fmt(created), call, prev}
