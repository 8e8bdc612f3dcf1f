-- Index sizes. KEYS 1..9 as in write.lua; ARGV: 1 now, 2 key prefix, 3 work budget.
-- First collects garbage of cleared engines and blocks whose records all expired, in
-- bounded steps: returns {1} while some is left (call again), else
-- {0, blocks, entries, engines}.
local now, prefix, budget = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local BLOCKS = tb_open(KEYS[1])
if sweep_expired(BLOCKS, now, ARGV[1], budget) == 1 or gc_step(BLOCKS, now, prefix, budget) == 1 then
  return { 1 }
end
local after = '(' .. ARGV[1]
-- Every block left has a firm holder or a live record (of an engine cleared since, too).
-- Tables count their own fields (lib.lua), so nothing here scans them; a block with
-- both firm holders and live records is in both tables, and counted twice.
local blocks = BLOCKS.n
for _, key in ipairs({ KEYS[8], KEYS[9] }) do
  blocks = blocks + redis.call('HLEN', key) - redis.call('HEXISTS', key, '')
end
local entries, engines = 0, 0
local all = redis.call('HGETALL', KEYS[3])
for i = 1, #all, 2 do
  local label, id = all[i], all[i + 1]
  local firm = 0
  for tier = 0, 2 do
    firm = firm + (tonumber(redis.call('HGET', held_meta(prefix, id, tier), 'n')) or 0)
  end
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
