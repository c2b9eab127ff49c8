-- alive: which worker processes have a live liveness record (one round trip for a reconcile run).
-- KEYS[1..n] liveness hashes {<prefix>:live}:<process id> (one hash tag: one cluster slot)
-- ARGV[1] now ('' = server clock)
-- Returns a list of n integers: 1 where the record is live, 0 where it is absent or expired.
local now = now_of(ARGV[1])
local answer = {}
for i = 1, #KEYS do
  local expires = redis.call('HGET', KEYS[i], 'expires')
  answer[i] = (expires and tonumber(expires) > now) and 1 or 0
end
return answer
