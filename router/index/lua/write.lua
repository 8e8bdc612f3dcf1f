-- Apply one batch of index writes for one engine, optionally fenced by a lease.
-- KEYS: 1 blocks (the bucketed table's meta hash), 2 expiring adds by deadline,
--       3 engines, 4 free ids, 5 next id, 6 gc queue, 7 engine epoch, 8 expiring
--       records, 9 shared blocks, then the engine's own: 10 expiring buckets,
--       11 expiring counts, 12 stream position, 13 lease (its holdings tables are
--       named by its engine id: held_meta)
-- ARGV: 1 now, 2 key prefix, 3 engine label, 4 lease token ('' = unfenced),
--       5 stream seq ('' = none: with a token, forget the stream position),
--       6 batch timestamp, then 5 per op: kind, tier, ttl, packed keys, packed hashes
--   kinds: A firm add (tier 0 GPU, 1 CPU, 2 disk; hashes optional), E expiring add
--          (ttl seconds), R remove (tier 0, 1, 2, or * for all), C clear
-- Returns 1 applied, -1 stale lease token, -2 sequence already applied.
local now, prefix, label = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local token, seq = ARGV[4], ARGV[5]

if token ~= '' then
  if redis.call('GET', KEYS[13]) ~= token then
    return -1
  end
  if seq ~= '' then
    local last = redis.call('HGET', KEYS[12], 'seq')
    if last and tonumber(seq) <= tonumber(last) then
      return -2
    end
  end
end

-- Any change of the label -> id map gets a new epoch, so lookups can trust ids that
-- callers cached under the current one. Server time plus a counter: unique even if the
-- data (and the counter with it) is lost and the map is rebuilt.
local function new_epoch()
  local old = redis.call('GET', KEYS[7])
  local count = old and tonumber(string.match(old, ':(%d+)$')) or 0
  local t = redis.call('TIME')
  redis.call('SET', KEYS[7], t[1] .. '.' .. t[2] .. ':' .. (count + 1))
end

local id = nil
local function engine_id(create)
  if id then
    return id
  end
  local known = redis.call('HGET', KEYS[3], label)
  if known then
    id = tonumber(known)
  elseif create then
    local free = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[1], 'LIMIT', 0, 1)
    if free[1] then
      redis.call('ZREM', KEYS[4], free[1])
      id = tonumber(free[1])
    else
      id = redis.call('INCR', KEYS[5]) - 1
      if id > MAX_ID then
        redis.call('DECR', KEYS[5])
        error('more than ' .. (MAX_ID + 1) .. ' engines in one namespace')
      end
    end
    redis.call('HSET', KEYS[3], label, id)
    new_epoch()
  end
  return id
end

local function chunks(keys, fn)
  local n = #keys / 8
  for start = 1, n, CHUNK do
    local stop = math.min(n, start + CHUNK - 1)
    local fields = {}
    for i = start, stop do
      fields[i - start + 1] = key_at(keys, i)
    end
    fn(fields, start)
  end
end

local function count_records(changes)
  for b, n in pairs(changes) do
    if n ~= 0 then
      redis.call('HINCRBY', KEYS[11], b, n)
    end
  end
end

local BLOCKS = tb_open(KEYS[1])
local held = {} -- the engine's holdings tables by tier, opened on first use

local function held_table(tier)
  local t = held[tier]
  if not t then
    t = tb_open(held_meta(prefix, engine_id(false), tier))
    held[tier] = t
  end
  return t
end

local function firm_add(tier, keys, hashes)
  local me = engine_id(true)
  local mask = TIER_MASK[tier]
  chunks(keys, function(fields, first)
    update_blocks(BLOCKS, fields, function(firm)
      return (firm_update(firm, me, mask, 0))
    end, true)
    local owned = {}
    for j = 1, #fields do
      owned[fields[j]] = hashes ~= '' and key_at(hashes, first + j - 1) or ''
    end
    tb_set(held_table(tier), fields, owned)
  end)
end

-- Blocks the engine holds firmly on GPU get no record, as in the memory index, where
-- the shared hash says so: for blocks several engines hold, and blocks an earlier
-- record promoted. A block in its bucket is recorded anyway (reading the bucket would
-- cost a call per block on every routing decision) and promoted, so the next record
-- skips it; lookups count a firm GPU holder the same either way, and removing the
-- block from the engine's GPU tier drops the record with it.
local function expiring_add(ttl, keys)
  local me = engine_id(true)
  local deadline = now + ttl
  local b = bucket(deadline)
  local changes = { [b] = 0 }
  local recorded = {}
  local on_gpu = {} -- shared value -> whether it has me on GPU
  chunks(keys, function(all)
    local shared = redis.call('HMGET', KEYS[9], unpack(all))
    local fields, in_shared = {}, {}
    for j = 1, #all do
      local v = shared[j]
      local held = false
      if v then
        in_shared[all[j]] = true
        held = on_gpu[v]
        if held == nil then
          held = firm_bits(v, me) % 2 == 1
          on_gpu[v] = held
        end
      end
      if not held then
        fields[#fields + 1] = all[j]
      end
    end
    if #fields == 0 then
      return
    end
    local created = update_records(fields, function(recs)
      return rewrite_records(recs, now, me, me, deadline)
    end, function(k, replaced)
      changes[b] = changes[b] + 1
      if replaced then
        local old = bucket(replaced)
        changes[old] = (changes[old] or 0) - 1
      end
      recorded[#recorded + 1] = k
    end)
    local lone = {}
    for _, k in ipairs(created) do
      if not in_shared[k] then
        lone[#lone + 1] = k
      end
    end
    promote(BLOCKS, lone)
  end)
  if #recorded == 0 then
    return
  end
  count_records(changes)
  -- GT: the same keys recorded again keep the later deadline, which covers both.
  redis.call('ZADD', KEYS[2], 'GT', deadline, table.concat(recorded))
  redis.call('ZADD', KEYS[10], deadline, b)
  -- Forget buckets that have expired.
  local expired = redis.call('ZRANGEBYSCORE', KEYS[10], '-inf', ARGV[1])
  if #expired > 0 then
    bulk('HDEL', KEYS[11], expired)
    redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', ARGV[1])
  end
end

local function remove(tier, keys)
  local me = engine_id(false)
  if not me then
    return
  end
  local mask = (tier == '0' and 1) or (tier == '1' and 2) or (tier == '2' and 4) or 7
  local gone = mask % 2 == 1 and {} or nil -- expiring records are GPU-tier predictions
  chunks(keys, function(fields)
    drop_holder(BLOCKS, now, me, mask, fields, gone)
    for t = 0, 2 do
      if bit.band(mask, TIER_MASK[t]) ~= 0 then
        tb_del(held_table(t), fields)
      end
    end
  end)
  if gone then
    count_records(gone)
  end
end

-- O(1): the engine's id is retired (no label maps to it, so lookups ignore its
-- entries), its holdings tables are queued for collection, later in bounded steps by
-- every write, and its expiring records are left to expire.
local function clear()
  local me = engine_id(false)
  if not me then
    return
  end
  redis.call('HDEL', KEYS[3], label)
  new_epoch()
  local last = redis.call('ZRANGE', KEYS[10], -1, -1, 'WITHSCORES')
  redis.call('DEL', KEYS[10], KEYS[11])
  redis.call('RPUSH', KEYS[6], me .. ':' .. (last[2] or '0'))
  id = nil
  held = {}
end

for i = 7, #ARGV, 5 do
  local kind = ARGV[i]
  if kind == 'A' then
    firm_add(tonumber(ARGV[i + 1]), ARGV[i + 3], ARGV[i + 4])
  elseif kind == 'E' then
    expiring_add(tonumber(ARGV[i + 2]), ARGV[i + 3])
  elseif kind == 'R' then
    remove(ARGV[i + 1], ARGV[i + 3])
  elseif kind == 'C' then
    clear()
  else
    return redis.error_reply('unknown op ' .. tostring(kind))
  end
end

if token ~= '' then
  if seq ~= '' then
    redis.call('HSET', KEYS[12], 'seq', seq, 'ts', ARGV[6])
  else
    redis.call('DEL', KEYS[12])
  end
end
sweep_expired(BLOCKS, now, ARGV[1], 1024)
gc_step(BLOCKS, now, prefix, 256)
return 1
