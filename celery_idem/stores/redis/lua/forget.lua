-- forget: remove the record in any state (a running attempt is then fenced out: its token is gone).
-- KEYS[1] record hash   KEYS[2] lease index of its shard
-- ARGV[1] now ('' = server clock)
-- Returns 1 if a live record was removed, else 0.
local now = now_of(ARGV[1])
local rec = load(KEYS[1], now)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
notify(KEYS[1])
if rec then return 1 end
return 0
