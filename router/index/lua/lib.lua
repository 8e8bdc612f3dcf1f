-- Helpers shared by kvroute's index scripts (prepended to each script when loaded).
--
-- Block keys travel as 8-byte little-endian strings packed back to back in one
-- argument. A block's value in the blocks hash is
--   uint16 n | n firm entries | expiring records
-- firm entry: uint16 (engine id * 8 + tier bits: 1 GPU, 2 CPU, 4 disk), sorted by id, so
-- equal holder sets are equal strings; expiring record: uint16 engine id, float64
-- deadline (seconds on the caller's clock). All integers little-endian.

local CHUNK = 1000 -- keys per bulk command (Lua's unpack limit is ~8000 values)
local REC = 10
local MAX_ID = 8191 -- engine ids share a uint16 with 3 tier bits
local TIER_BITS = 8
local TIER_MASK = { [0] = 1, [1] = 2, [2] = 4 } -- tier number -> its bit

local function key_at(blob, i)
  return string.sub(blob, i * 8 - 7, i * 8)
end

-- A block value's firm entries and expiring records (both '' when absent).
local function split(v)
  if not v then
    return '', ''
  end
  local n = string.byte(v, 1) + 256 * string.byte(v, 2)
  return string.sub(v, 3, 2 + 2 * n), string.sub(v, 3 + 2 * n)
end

local function join(firm, recs)
  if firm == '' and recs == '' then
    return ''
  end
  local n = #firm / 2
  return string.char(n % 256, math.floor(n / 256)) .. firm .. recs
end

-- Tier bits engine `id` holds firmly.
local function firm_bits(firm, id)
  for o = 1, #firm, 2 do
    local e = string.byte(firm, o) + 256 * string.byte(firm, o + 1)
    local eid = math.floor(e / TIER_BITS)
    if eid == id then
      return e % TIER_BITS
    elseif eid > id then
      return 0
    end
  end
  return 0
end

local function entry(id, bits)
  local e = id * TIER_BITS + bits
  return string.char(e % 256, math.floor(e / 256))
end

-- Set then clear tier bits of engine `id`; returns the new entries and whether they changed.
local function firm_update(firm, id, set, clear)
  local o = 1
  while o <= #firm do
    local e = string.byte(firm, o) + 256 * string.byte(firm, o + 1)
    local eid = math.floor(e / TIER_BITS)
    if eid >= id then
      local old = eid == id and e % TIER_BITS or 0
      local new = bit.band(bit.bor(old, set), bit.bnot(clear))
      if new == old then
        return firm, false
      end
      local rest = string.sub(firm, eid == id and o + 2 or o)
      local mid = new ~= 0 and entry(id, new) or ''
      return string.sub(firm, 1, o - 1) .. mid .. rest, true
    end
    o = o + 2
  end
  local new = bit.band(set, bit.bnot(clear))
  if new == 0 then
    return firm, false
  end
  return firm .. entry(id, new), true
end

-- Records without expired ones and without engine `drop` (may be nil), plus (`add`,
-- `deadline`) when given. Returns the new records and the deadline of the live record
-- of `drop` that went (nil if none).
local function rewrite_records(recs, now, drop, add, deadline)
  local parts, dropped = {}, nil
  for o = 1, #recs, REC do
    local id, d = struct.unpack('<I2d', recs, o)
    if d > now then
      if id == drop then
        dropped = d
      else
        parts[#parts + 1] = string.sub(recs, o, o + REC - 1)
      end
    end
  end
  if add then
    parts[#parts + 1] = struct.pack('<I2d', add, deadline)
  end
  return table.concat(parts), dropped
end

-- An engine's live expiring records are counted per deadline ("bucket"): a hash of
-- bucket -> count beside a sorted set of bucket -> deadline. One bucket per expiring
-- add keeps the count exact at a cost independent of the number of keys.
local function bucket(deadline)
  return string.format('%.17g', deadline)
end

-- Bulk helpers: one command per CHUNK values instead of one per key.
local function bulk(cmd, key, values)
  for start = 1, #values, CHUNK do
    redis.call(cmd, key, unpack(values, start, math.min(#values, start + CHUNK - 1)))
  end
end

local function bulk_pairs(cmd, key, values)
  for start = 1, #values, 2 * CHUNK do
    redis.call(cmd, key, unpack(values, start, math.min(#values, start + 2 * CHUNK - 1)))
  end
end

local function push(t, a, b)
  t[#t + 1] = a
  if b ~= nil then
    t[#t + 1] = b
  end
end

-- Apply `change(firm, recs) -> firm, recs, extra` to block keys `fields` (at most
-- CHUNK); change returns nil to leave a block untouched and must depend on its
-- arguments alone: blocks with equal values (common along a shared prefix) are computed
-- once. `seen(key, extra)`, if given, is called for every block change did not skip. A
-- block with no firm entry and no record is deleted.
local function update_blocks(fields, change, seen)
  local olds = redis.call('HMGET', KEYS[1], unpack(fields))
  local sets, dels, memo = {}, {}, {}
  for j = 1, #fields do
    local k, old = fields[j], olds[j]
    local m = memo[old or '']
    if not m then
      local firm0, recs0 = split(old)
      local firm, recs, extra = change(firm0, recs0)
      m = { firm = firm, extra = extra, value = firm and join(firm, recs) }
      memo[old or ''] = m
    end
    if m.firm then
      if seen then
        seen(k, m.extra)
      end
      if m.value ~= (old or '') then
        if m.value == '' then
          push(dels, k)
        else
          push(sets, k, m.value)
        end
      end
    end
  end
  bulk_pairs('HSET', KEYS[1], sets)
  bulk('HDEL', KEYS[1], dels)
end

-- Drop tier bits `mask` of engine `id` from `fields`; with `gone` (a table), its
-- expiring records too, counting their buckets in `gone`. Expired records of touched
-- blocks go as well.
local function drop_holder(now, id, mask, fields, gone)
  update_blocks(fields, function(firm, recs)
    local r, dropped = rewrite_records(recs, now, gone and id or nil)
    return (firm_update(firm, id, 0, mask)), r, dropped
  end, gone and function(_, dropped)
    if dropped then
      local b = bucket(dropped)
      gone[b] = (gone[b] or 0) - 1
    end
  end)
end

-- Rewrite the blocks of expiring adds whose deadline has passed (KEYS[2] scores each
-- add's packed keys by its deadline), about `budget` keys per call: expired records go
-- and blocks left with nothing are deleted. Lookups ignore expired records already;
-- this reclaims their memory. Returns 1 while expired adds remain.
local function sweep_expired(now, now_arg, budget)
  while budget > 0 do
    local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_arg, 'LIMIT', 0, 1)
    if not due[1] then
      return 0
    end
    local blob = due[1]
    local n = #blob / 8
    for start = 1, n, CHUNK do
      local fields = {}
      for i = start, math.min(n, start + CHUNK - 1) do
        fields[#fields + 1] = key_at(blob, i)
      end
      update_blocks(fields, function(firm, recs)
        return firm, (rewrite_records(recs, now))
      end)
    end
    redis.call('ZREM', KEYS[2], blob)
    budget = budget - n
  end
  return 1
end

-- Collect up to `budget` firm entries of retired engine ids (queued by clears as
-- "id:not-before"). A collected id goes to the free ids scored by the latest deadline
-- of its expiring records: it is reused only once those have expired, since lookups
-- would otherwise credit them to the id's next engine. KEYS: 4 free ids, 6 gc queue.
-- Returns 1 while work remains.
local function gc_step(now, prefix, budget)
  while budget > 0 do
    local item = redis.call('LINDEX', KEYS[6], 0)
    if not item then
      return 0
    end
    local id, after = string.match(item, '^(%d+):(.+)$')
    local left = 0
    for tier = 0, 2 do
      local hk = prefix .. 'gc:' .. id .. ':' .. tier
      if budget > 0 then
        local fields = redis.call('HRANDFIELD', hk, math.min(budget, CHUNK))
        if #fields > 0 then
          drop_holder(now, tonumber(id), TIER_MASK[tier], fields, nil)
          redis.call('HDEL', hk, unpack(fields))
          budget = budget - #fields
        end
      end
      left = left + redis.call('EXISTS', hk)
    end
    if left > 0 then
      return 1
    end
    redis.call('LPOP', KEYS[6])
    redis.call('ZADD', KEYS[4], after, id)
  end
  return redis.call('LLEN', KEYS[6]) > 0 and 1 or 0
end
