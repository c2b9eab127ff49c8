-- claim: producer side, before publishing.
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)  ARGV[2] fingerprint  ARGV[3] task id  ARGV[4] owner token
-- ARGV[5] pending lease seconds    ARGV[6] ttl seconds   ARGV[7] scope  ARGV[8] task name  ARGV[9] key
-- ARGV[10] the serialized call ('' = not kept)   ARGV[11] '1': a settled record is free (taken as absent)
-- Returns {decision, flat record} for DUPLICATE, REPLAY or MISMATCH (untouched), and
-- {'NEW', now, prev} when the PENDING record was written (the caller knows every other field of it).
-- A claim that takes over an attempt past its lease keeps that attempt's task id as `prev` (or the
-- `prev` of a claim it takes over): its body may have run, and the worker reads its evidence first.
local now = now_of(ARGV[1])
local rec, flat, existed = load(KEYS[1], now)
-- A free claim (ARGV[11]): the ended run's record, kept for its own messages, is taken afresh by a
-- new call (nothing of it survives: no earlier attempt, no waiter's mark); under its own task id it
-- is that call again, answered as usual.
if rec and settled(rec) and ARGV[11] == '1' and rec.task_id ~= ARGV[3] then rec = nil end
if rec then
  if rec.fp ~= ARGV[2] then return {'MISMATCH', flat} end
  if settled(rec) then return {'REPLAY', flat} end
  if tonumber(rec.lease) > now then return {'DUPLICATE', flat} end
end
local prev = ''
if rec then prev = (rec.state == 'IN_PROGRESS' and rec.task_id) or rec.prev or '' end
local lease = now + tonumber(ARGV[5])
local expires = lease + tonumber(ARGV[6])
local fields = {
  'scope', ARGV[7], 'task', ARGV[8], 'key', ARGV[9], 'fp', ARGV[2], 'state', 'PENDING',
  'task_id', ARGV[3], 'owner', ARGV[4], 'attempt', '0', 'lease', fmt(lease),
  'created', fmt(now), 'updated', fmt(now), 'expires', fmt(expires), 'ttl', ARGV[6],
}
if ARGV[10] ~= '' then
  table.insert(fields, 'call')
  table.insert(fields, ARGV[10])
end
if rec and rec.linger then  -- a BUSY waiter's mark (acquire.lua) stays with the record it was given on
  table.insert(fields, 'linger')
  table.insert(fields, rec.linger)
end
if prev ~= '' then
  table.insert(fields, 'prev')
  table.insert(fields, prev)
end
write_fresh(KEYS[1], KEYS[2], fields, lease, expires, now, existed)
return {'NEW', fmt(now), prev}
