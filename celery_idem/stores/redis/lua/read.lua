-- read: one record as stored, for the plain reads (RedisStore.get): the packed string of a settled
-- record, the flat HGETALL form of a hash, or nil when there is none.
-- KEYS[1] record key
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'string' then return redis.call('GET', KEYS[1]) end
if kind == 'hash' then return redis.call('HGETALL', KEYS[1]) end
return false
