-- Shared load: each router replica's in-flight work per engine, one field per replica.
-- KEYS: 1 the load hash. ARGV: 1 replica id, 2 payload ('' = leave: drop the field),
-- 3 ttl ms.
-- A field holds '<deadline ms>|<payload>', the deadline on Redis's clock (TIME), so
-- replicas need no common clock for it. Fields past their deadline are deleted here.
-- Returns the other live replicas' fields as a flat list: id, payload, id, payload, ...
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return {}
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now + ttl) .. '|' .. ARGV[2])
-- If every replica stops, the hash goes too (never shortened by a replica with a
-- shorter ttl than another's).
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local field, value = all[i], all[i + 1]
  local bar = string.find(value, '|', 1, true)
  local deadline = bar and tonumber(string.sub(value, 1, bar - 1))
  if not deadline or deadline <= now then
    redis.call('HDEL', KEYS[1], field)
  elseif field ~= ARGV[1] then
    out[#out + 1] = field
    out[#out + 1] = string.sub(value, bar + 1)
  end
end
return out
