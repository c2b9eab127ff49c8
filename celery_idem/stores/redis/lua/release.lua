-- release: give the identity back, fenced: to PENDING (a retry is queued) or deleted.
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)  ARGV[2] fence field ('owner' or 'task_id')  ARGV[3] token
-- ARGV[4] pending lease seconds ('' = delete)  ARGV[5] new owner token  ARGV[6] '1' = only if the lease expired
-- Returns 'OK' or 'LOST'. Fenced by the task id (the parent-process hooks) it frees only a PENDING
-- record or an IN_PROGRESS one past its lease: a live attempt under that id runs elsewhere.
local now = now_of(ARGV[1])
local rec = load(KEYS[1], now)
if not rec or settled(rec) or rec[ARGV[2]] ~= ARGV[3] then return 'LOST' end
local live = tonumber(rec.lease) > now
if live and (ARGV[6] == '1' or (ARGV[2] == 'task_id' and rec.state == 'IN_PROGRESS')) then
  return 'LOST'
end
if ARGV[4] == '' then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], KEYS[1])
  notify(KEYS[1])
  return 'OK'
end
local lease = now + tonumber(ARGV[4])
local expires = lease + tonumber(rec.ttl)
redis.call('HSET', KEYS[1], 'state', 'PENDING', 'owner', ARGV[5], 'lease', fmt(lease),
  'updated', fmt(now), 'expires', fmt(expires))
expire_at(KEYS[1], expires, now)
redis.call('ZADD', KEYS[2], lease, KEYS[1])
notify(KEYS[1])
return 'OK'
