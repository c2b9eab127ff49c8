-- due: the record keys of one index shard whose lease has expired, oldest first.
-- KEYS[1] lease index of the shard
-- ARGV[1] now ('' = server clock)  ARGV[2] limit
-- Returns {key, score, key, score, ...}. Keys whose record expired are still listed: the caller
-- reads each record and removes such leftovers.
local now = now_of(ARGV[1])
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
