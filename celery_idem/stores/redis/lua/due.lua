-- due: read the index entries the reconciler picked from one shard; drop the stale ones.
-- KEYS[1] lease index of the shard   KEYS[2..n] record keys taken from that index (the shard's hash
-- tag, so one slot: RedisStore reads the entries' ids first, ZRANGEBYSCORE with a LIMIT, merges
-- the shards by lease, and sends here only the few records the run can use, in bounded batches)
-- ARGV[1] now ('' = server clock)
-- Returns one answer per record key, in order: the flat record when it is unsettled and its lease
-- has expired; 'live' when its lease was renewed since the ids were read (the entry stays); 'gone'
-- when its record is absent, settled or past its expiry: that entry is dropped in this same atomic
-- step, so a claim cannot land between the read that judged the entry stale and its removal.
local now = now_of(ARGV[1])
local answers = {}
for i = 2, #KEYS do
  local rec, flat = load(KEYS[i], now)
  if rec and not settled(rec) then
    if tonumber(rec.lease) <= now then
      answers[#answers + 1] = flat
    else
      answers[#answers + 1] = 'live'
    end
  else
    redis.call('ZREM', KEYS[1], KEYS[i])  -- a leftover: its record expired, settled or went
    answers[#answers + 1] = 'gone'
  end
end
return answers
