-- One writer per engine stream. KEYS: 1 lease. ARGV: 1 token, 2 ttl ms, 3 mode.
-- acquire: SET NX PX, or extend when `token` already holds it; renew: extend only if
-- held; release: delete only if held. Returns 1 when the caller holds (or released) it.
local current = redis.call('GET', KEYS[1])
local mode = ARGV[3]
if mode == 'release' then
  if current == ARGV[1] then
    redis.call('DEL', KEYS[1])
    return 1
  end
  return 0
end
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if current or mode ~= 'acquire' then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
return 1
