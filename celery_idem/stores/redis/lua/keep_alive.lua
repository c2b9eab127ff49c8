-- keep_alive: a worker process's liveness record (DESIGN "Death is a fact, not a silence").
-- KEYS[1] liveness hash {<prefix>:live}:<process id> (every liveness key shares the hash tag
--         {<prefix>:live}, so alive.lua reads many in one slot on Redis Cluster)
-- ARGV[1] now ('' = server clock)  ARGV[2] the process's token  ARGV[3] lifetime seconds
-- ARGV[4] '1' for the first beat (create), '0' for a renewal
-- Hash fields: token, expires (POSIX seconds). The key expires with the record.
-- Returns 'OK' (created or renewed), or 'LOST': a live record under another token, or a renewal of
-- a record that is absent or expired (the process was taken for dead and stays so under this id).
local now = now_of(ARGV[1])
local token, expires = unpack(redis.call('HMGET', KEYS[1], 'token', 'expires'))
local live = token and tonumber(expires) > now
if live and token ~= ARGV[2] then return 'LOST' end
if not live and ARGV[4] ~= '1' then return 'LOST' end
local until_ = now + tonumber(ARGV[3])
if live then until_ = math.max(until_, tonumber(expires)) end  -- never shortened
redis.call('HSET', KEYS[1], 'token', ARGV[2], 'expires', fmt(until_))
expire_at(KEYS[1], until_, now)
return 'OK'
