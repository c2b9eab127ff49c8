-- settle: complete or fail, fenced by the owner token.
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)  ARGV[2] owner token  ARGV[3] new state ('COMPLETED' or 'FAILED')
-- ARGV[4] result  ARGV[5] content type  ARGV[6] content encoding  ARGV[7] error JSON
-- Returns 'OK', or 'LOST' (not PENDING/IN_PROGRESS, or another owner holds it).
-- The outcome lives `ttl` seconds, and at least until a BUSY waiter's next look (`linger`).
local now = now_of(ARGV[1])
local rec = load(KEYS[1], now)
if not rec or settled(rec) or rec.owner ~= ARGV[2] then return 'LOST' end
local expires = math.max(now + tonumber(rec.ttl), tonumber(rec.linger or '0'))
redis.call('HDEL', KEYS[1], 'lease')
if ARGV[3] == 'COMPLETED' then
  redis.call('HSET', KEYS[1], 'state', 'COMPLETED', 'updated', fmt(now), 'expires', fmt(expires),
    'result', ARGV[4], 'ctype', ARGV[5], 'cenc', ARGV[6])
else
  redis.call('HSET', KEYS[1], 'state', 'FAILED', 'updated', fmt(now), 'expires', fmt(expires),
    'error', ARGV[7])
end
expire_at(KEYS[1], expires, now)
redis.call('ZREM', KEYS[2], KEYS[1])
notify(KEYS[1])
return 'OK'
