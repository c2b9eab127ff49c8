-- hand_over: a running attempt passes its IN_PROGRESS record to another owner token, with a lease
-- of exactly this length from now (replace(): the replaced attempt to the token its replacement
-- carries, then the replacement to its own owner token). The old token can write nothing after.
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)  ARGV[2] owner token  ARGV[3] new owner token  ARGV[4] lease seconds
-- Returns 'OK', or 'LOST' (not IN_PROGRESS under this token).
local now = now_of(ARGV[1])
local rec = load(KEYS[1], now)
if not rec or rec.state ~= 'IN_PROGRESS' or rec.owner ~= ARGV[2] then return 'LOST' end
local lease = now + tonumber(ARGV[4])
local expires = lease + tonumber(rec.ttl)
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'lease', fmt(lease), 'updated', fmt(now), 'expires', fmt(expires))
expire_at(KEYS[1], expires, now)
redis.call('ZADD', KEYS[2], lease, KEYS[1])
return 'OK'
