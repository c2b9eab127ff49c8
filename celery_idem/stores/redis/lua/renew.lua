-- renew: the heartbeat of a running attempt extends its lease (never shortens it: a late beat must
-- not undo a longer lease the attempt set meanwhile, as replace() does).
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)  ARGV[2] owner token  ARGV[3] lease seconds
-- Returns 'OK', or 'LOST' (not IN_PROGRESS under this token).
local now = now_of(ARGV[1])
local rec = load(KEYS[1], now)
if not rec or rec.state ~= 'IN_PROGRESS' or rec.owner ~= ARGV[2] then return 'LOST' end
local lease = math.max(tonumber(rec.lease), now + tonumber(ARGV[3]))
local expires = lease + tonumber(rec.ttl)
redis.call('HSET', KEYS[1], 'lease', fmt(lease), 'updated', fmt(now), 'expires', fmt(expires))
expire_at(KEYS[1], expires, now)
redis.call('ZADD', KEYS[2], lease, KEYS[1])
return 'OK'
