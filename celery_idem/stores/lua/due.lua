-- due: the live records of one index shard whose lease has expired, oldest lease first.
-- KEYS[1] lease index of the shard
-- ARGV[1] now ('' = server clock)  ARGV[2] limit
-- Returns {flat record, flat record, ...}. Every record key of a shard shares the index's hash tag,
-- so this one script reads each due record and, in the same atomic step, drops the index entries
-- whose record is gone, settled or past its expiry: a claim cannot land between the read that
-- judged an entry stale and the removal of that entry.
local now = now_of(ARGV[1])
local limit = tonumber(ARGV[2])
local live = {}
local cursor = 0
while #live < limit do
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', cursor, limit - #live)
  if #due == 0 then break end
  for _, key in ipairs(due) do
    local rec, flat = load(key, now)
    if rec and not settled(rec) then
      table.insert(live, flat)
      cursor = cursor + 1
    else
      redis.call('ZREM', KEYS[1], key)  -- a leftover: its record expired, settled or went
    end
  end
end
return live
