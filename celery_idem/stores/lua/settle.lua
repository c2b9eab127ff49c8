-- settle: complete or fail, fenced.
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)  ARGV[2] fence field ('owner' or 'task_id')  ARGV[3] token
-- ARGV[4] new state ('COMPLETED' or 'FAILED')  ARGV[5] result  ARGV[6] content type
-- ARGV[7] content encoding  ARGV[8] error JSON
-- Returns 'OK', or 'LOST' (not PENDING/IN_PROGRESS, or the fence field holds another value).
local now = now_of(ARGV[1])
local rec = load(KEYS[1], now)
if not rec or settled(rec) or rec[ARGV[2]] ~= ARGV[3] then return 'LOST' end
local expires = now + tonumber(rec.ttl)
redis.call('HDEL', KEYS[1], 'lease')
if ARGV[4] == 'COMPLETED' then
  redis.call('HSET', KEYS[1], 'state', 'COMPLETED', 'updated', fmt(now), 'expires', fmt(expires),
    'result', ARGV[5], 'ctype', ARGV[6], 'cenc', ARGV[7])
else
  redis.call('HSET', KEYS[1], 'state', 'FAILED', 'updated', fmt(now), 'expires', fmt(expires),
    'error', ARGV[8])
end
expire_at(KEYS[1], expires, now)
redis.call('ZREM', KEYS[2], KEYS[1])
return 'OK'
