-- settle: complete or fail, fenced by the owner token.
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)  ARGV[2] owner token  ARGV[3] new state ('COMPLETED' or 'FAILED')
-- ARGV[4] result  ARGV[5] content type  ARGV[6] content encoding  ARGV[7] error JSON
-- Returns 'OK', or 'LOST' (not PENDING/IN_PROGRESS, or another owner holds it).
-- The outcome lives `ttl` seconds, and at least until a BUSY waiter's next look (`linger`). The
-- record is written packed (_prelude.lua): only what a settled record is read for.
local now = now_of(ARGV[1])
local rec = load(KEYS[1], now)
if not rec or settled(rec) or rec.owner ~= ARGV[2] then return 'LOST' end
local expires = math.max(now + tonumber(rec.ttl), tonumber(rec.linger or '0'))
local record
if ARGV[3] == 'COMPLETED' then
  record = pack_settled(rec, 'C', expires, now, ARGV[4], ARGV[5], ARGV[6])
else
  record = pack_settled(rec, 'F', expires, now, ARGV[7], '', '')
end
-- The hash becomes the packed string, its expiry with it, in one command.
redis.call('SET', KEYS[1], record, 'PX', math.max(1, math.ceil((expires - now) * 1000)))
redis.call('ZREM', KEYS[2], KEYS[1])
notify(KEYS[1])
return 'OK'
