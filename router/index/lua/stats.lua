-- Index sizes. KEYS 1..7 as in write.lua; ARGV: 1 now, 2 key prefix, 3 work budget.
-- First collects garbage of cleared engines and blocks whose records all expired, in
-- bounded steps: returns {1} while some is left (call again), else
-- {0, blocks, entries, engines}.
local now, prefix, budget = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
if sweep_expired(now, ARGV[1], budget) == 1 or gc_step(now, prefix, budget) == 1 then
  return { 1 }
end
local after = '(' .. ARGV[1]
-- Every block left has a firm holder or a live record (of an engine cleared since, too).
local blocks = redis.call('HLEN', KEYS[1])
local entries, engines = 0, 0
for _, label in ipairs(redis.call('HKEYS', KEYS[3])) do
  local firm = redis.call('HLEN', prefix .. 'held:' .. label .. ':0')
    + redis.call('HLEN', prefix .. 'held:' .. label .. ':1')
    + redis.call('HLEN', prefix .. 'held:' .. label .. ':2')
  entries = entries + firm
  local live = redis.call('ZRANGEBYSCORE', prefix .. 'expiring:' .. label, after, '+inf')
  for start = 1, #live, CHUNK do
    local counts = redis.call(
      'HMGET',
      prefix .. 'expiring-n:' .. label,
      unpack(live, start, math.min(#live, start + CHUNK - 1))
    )
    for _, c in ipairs(counts) do
      entries = entries + (tonumber(c) or 0)
    end
  end
  if firm > 0 then
    engines = engines + 1
  end
end
return { 0, blocks, entries, engines }
