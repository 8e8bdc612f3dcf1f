-- Helpers shared by kvroute's index scripts (prepended to each script when loaded).
--
-- Block keys travel as 8-byte little-endian strings packed back to back in one
-- argument. A block's holders (docs/redis-schema.md):
--   firm entries, uint16 (engine id * 8 + tier bits: 1 GPU, 2 CPU, 4 disk) each,
--     sorted by id, so equal holder sets are equal strings: in the shared hash
--     (KEYS[9]) while the block has two firm holders or more, else in the bucketed
--     blocks table (KEYS[1]);
--   expiring records, uint16 engine id + float64 deadline (seconds on the caller's
--     clock) each: in the records hash (KEYS[8]).
-- All integers little-endian.
--
-- Tables of firm data keyed by block key (blocks, each engine's holdings per tier) are
-- bucketed (layout 3): a table is a meta hash (L, s: its geometry; n: its fields) and
-- hashes named <meta>:<3 bytes, the bucket number little-endian>, each small enough
-- to stay a listpack. A key's bucket is its top 24 bits h by linear hashing:
-- h mod 2^L, or h mod 2^(L+1) where that is below the split pointer s. A table grows
-- by one bucket (splitting bucket s) whenever it would average more than
-- BUCKET_FIELDS fields a bucket, so buckets stay small whatever the size of the data.
-- Blocks many engines hold, and expiring records, live in plain hashes instead: a
-- shared block's field is shared by all its holders, records come and go with
-- routing decisions, and both are read by lookups (a bucket costs a call per key, a
-- plain hash one call per chunk of keys).
local CHUNK = 1000 -- keys per bulk command (Lua's unpack limit is ~8000 values)
local REC = 10
local MAX_ID = 8191 -- engine ids share a uint16 with 3 tier bits
local TIER_BITS = 8
local TIER_MASK = { [0] = 1, [1] = 2, [2] = 4 } -- tier number -> its bit

local BUCKET_FIELDS = 48 -- average fields per bucket before one splits (listpacks end at 128)
local MAX_LEVEL = 24 -- bucket numbers are top 24 bits of a key
local byte, char, floor = string.byte, string.char, math.floor

local function key_at(blob, i)
  return string.sub(blob, i * 8 - 7, i * 8)
end

-- A block key's top 24 bits (its last three bytes, little-endian).
local function top24(k)
  local x, y, z = byte(k, 6, 8)
  return x + 256 * y + 65536 * z
end

local function bucket_name(meta, b)
  return meta .. ':' .. char(b % 256, floor(b / 256) % 256, floor(b / 65536))
end

-- A bucketed table by its meta key: geometry and field count as last saved.
local function tb_open(meta)
  local v = redis.call('HMGET', meta, 'L', 's', 'n')
  local level = tonumber(v[1]) or 0
  return { meta = meta, level = level, size = 2 ^ level, split = tonumber(v[2]) or 0, n = tonumber(v[3]) or 0 }
end

local function tb_bucket(t, k)
  local h = top24(k)
  local b = h % t.size
  if b < t.split then
    b = h % (2 * t.size)
  end
  return bucket_name(t.meta, b)
end

-- Each key's bucket name (key -> name).
local function tb_names(t, keys)
  local names = {}
  for _, k in ipairs(keys) do
    names[k] = tb_bucket(t, k)
  end
  return names
end

-- `keys` grouped by their bucket in `names`: the names in first-seen order, and per
-- name its keys.
local function by_bucket(names, keys)
  local order, groups = {}, {}
  for _, k in ipairs(keys) do
    local name = names[k]
    local g = groups[name]
    if not g then
      g = {}
      groups[name] = g
      order[#order + 1] = name
    end
    g[#g + 1] = k
  end
  return order, groups
end

-- Run `cmd` on each bucket with its keys of `keys`, each followed by its value from
-- `values` (key -> value) when given; returns the sum of the replies.
local function per_bucket(cmd, names, keys, values)
  local order, groups = by_bucket(names, keys)
  local total = 0
  for _, name in ipairs(order) do
    local args = groups[name]
    if values then
      local kv = {}
      for _, k in ipairs(args) do
        kv[#kv + 1] = k
        kv[#kv + 1] = values[k]
      end
      args = kv
    end
    total = total + redis.call(cmd, name, unpack(args))
  end
  return total
end

-- The values of `keys` in their buckets (`names`: key -> bucket name), one HMGET per
-- bucket: key -> value, absent keys left out.
local function tb_get(names, keys)
  local values = {}
  local order, groups = by_bucket(names, keys)
  for _, name in ipairs(order) do
    local fs = groups[name]
    local vals = redis.call('HMGET', name, unpack(fs))
    for i = 1, #fs do
      values[fs[i]] = vals[i] or nil
    end
  end
  return values
end

-- Split buckets until the table has room for `extra` more fields at BUCKET_FIELDS a
-- bucket on average. Writes reserve room before they insert (a bucket that once passes
-- 128 fields stays a hash table), and each split moves about half of one bucket.
local function tb_reserve(t, extra)
  while t.n + extra > BUCKET_FIELDS * (t.size + t.split) and t.level < MAX_LEVEL do
    local from = bucket_name(t.meta, t.split)
    local to = t.split + t.size
    local all = redis.call('HGETALL', from)
    local kept, moved = {}, {}
    for i = 1, #all, 2 do
      local side = top24(all[i]) % (2 * t.size) == to and moved or kept
      side[#side + 1] = all[i]
      side[#side + 1] = all[i + 1]
    end
    if #moved > 0 then -- both halves written afresh: cheaper than deleting field by field
      redis.call('DEL', from)
      if #kept > 0 then
        redis.call('HSET', from, unpack(kept))
      end
      redis.call('HSET', bucket_name(t.meta, to), unpack(moved))
    end
    t.split = t.split + 1
    if t.split == t.size then
      t.level, t.size, t.split = t.level + 1, t.size * 2, 0
    end
  end
end

local function tb_save(t)
  redis.call('HSET', t.meta, 'L', t.level, 's', t.split, 'n', t.n)
end

-- Set `fields` to their values in `values` (key -> value); new fields are counted.
local function tb_set(t, fields, values)
  tb_reserve(t, #fields)
  t.n = t.n + per_bucket('HSET', tb_names(t, fields), fields, values)
  tb_save(t)
end

local function tb_del(t, fields)
  local gone = per_bucket('HDEL', tb_names(t, fields), fields)
  if gone > 0 then
    t.n = t.n - gone
    redis.call('HSET', t.meta, 'n', t.n)
  end
end

-- An engine's holdings table of `tier` (0 GPU, 1 CPU, 2 disk): block key -> the
-- engine's own hash of the block (or empty). Named by engine id: a cleared engine's
-- id is retired until its tables are collected, so they never mix with a new life's.
local function held_meta(prefix, id, tier)
  return prefix .. 'held:' .. id .. ':' .. tier
end

-- Tier bits engine `id` holds firmly in firm entries `firm` (sorted by id).
local function firm_bits(firm, id)
  for o = 1, #firm, 2 do
    local e = byte(firm, o) + 256 * byte(firm, o + 1)
    local eid = floor(e / TIER_BITS)
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

-- The shared blocks and records hashes are kept hash tables whatever their size: a
-- field '' with a value longer than any listpack value converts a hash for good (Redis
-- never converts back, and keeps the hash while the field is there). A small hash would
-- otherwise be a listpack, where every field a lookup asks for is a linear scan.
local PLAIN_MARK = string.rep('-', 80)

local function keep_plain(key)
  redis.call('HSETNX', key, '', PLAIN_MARK)
end

local function push(t, a, b)
  t[#t + 1] = a
  if b ~= nil then
    t[#t + 1] = b
  end
end

-- Apply `change(firm) -> firm` to block keys `fields` (at most CHUNK); change must
-- depend on its argument alone: blocks with equal values (common along a shared
-- prefix) are computed once. A block's firm entries live in the shared hash (KEYS[9])
-- while it has two holders or more, else in bucketed table `t`; a change moves it
-- between them, and a block left with no firm entry is deleted. `adds` says the
-- change may create blocks: room is reserved in `t` for all of `fields`, and a block
-- found nowhere is created with one HSETNX in its bucket (most blocks an engine
-- stores are new), read and rewritten only if it turns out to be there.
local function update_blocks(t, fields, change, adds)
  if adds then
    tb_reserve(t, #fields)
  end
  local memo = {}
  local function changed(old)
    local new = memo[old]
    if not new then
      new = change(old)
      memo[old] = new
    end
    return new
  end
  local shared = redis.call('HMGET', KEYS[9], unpack(fields))
  local fresh = adds and changed('') or ''
  if #fresh > 2 then
    fresh = '' -- would be shared at once: the general path
  end
  local names, created, unread = {}, {}, {}
  for j = 1, #fields do
    if not shared[j] then
      local k = fields[j]
      local name = tb_bucket(t, k)
      names[k] = name
      if fresh ~= '' and redis.call('HSETNX', name, k, fresh) == 1 then
        created[k] = true
        t.n = t.n + 1
      else
        unread[#unread + 1] = k
      end
    end
  end
  local olds = tb_get(names, unread)
  local shared_sets, shared_dels, lone_sets, lone_dels, lone_values = {}, {}, {}, {}, {}
  for j = 1, #fields do
    local k = fields[j]
    if not created[k] then
      local was_shared = shared[j] and true or false
      local old = shared[j] or olds[k] or ''
      local new = changed(old)
      if new ~= old then
        local now_shared = #new > 2
        if was_shared and not now_shared then
          push(shared_dels, k)
        elseif not was_shared and old ~= '' and (now_shared or new == '') then
          lone_dels[#lone_dels + 1] = k
        end
        if now_shared then
          push(shared_sets, k, new)
        elseif new ~= '' then
          if not names[k] then
            names[k] = tb_bucket(t, k)
          end
          lone_sets[#lone_sets + 1] = k
          lone_values[k] = new
        end
      end
    end
  end
  if #shared_sets > 0 then
    keep_plain(KEYS[9])
    redis.call('HSET', KEYS[9], unpack(shared_sets))
  end
  if #shared_dels > 0 then
    redis.call('HDEL', KEYS[9], unpack(shared_dels))
  end
  if #lone_dels > 0 then
    t.n = t.n - per_bucket('HDEL', names, lone_dels)
  end
  if #lone_sets > 0 then
    t.n = t.n + per_bucket('HSET', names, lone_sets, lone_values)
  end
  tb_save(t)
end

-- Apply `change(recs) -> recs, extra` to the expiring records of block keys `fields`
-- (at most CHUNK); change returns nil to leave a block untouched and must depend on
-- its argument alone. `seen(key, extra)`, if given, is called for every block change
-- did not skip. A block left with no record is deleted. Returns the keys that had no
-- records before and the keys left with none.
local function update_records(fields, change, seen)
  local olds = redis.call('HMGET', KEYS[8], unpack(fields))
  local sets, dels, memo, created = {}, {}, {}, {}
  for j = 1, #fields do
    local k, old = fields[j], olds[j] or ''
    local m = memo[old]
    if not m then
      local recs, extra = change(old)
      m = { recs = recs, extra = extra }
      memo[old] = m
    end
    if m.recs then
      if seen then
        seen(k, m.extra)
      end
      if m.recs ~= old then
        if m.recs == '' then
          push(dels, k)
        else
          push(sets, k, m.recs)
          if old == '' then
            created[#created + 1] = k
          end
        end
      end
    end
  end
  if #sets > 0 then
    keep_plain(KEYS[8])
    redis.call('HSET', KEYS[8], unpack(sets))
  end
  if #dels > 0 then
    redis.call('HDEL', KEYS[8], unpack(dels))
  end
  return created, dels
end

-- While a block has expiring records it is likely to be looked up again soon (a
-- router just sent its prompt somewhere), so its firm holders move to the shared hash
-- even when there is one (a lookup reads that hash a chunk at a time instead of the
-- bucket block by block): `promote` does it for blocks that just got their first
-- record (`keys`: ones the shared hash lacks), `demote` puts the lone ones back in
-- their buckets once their records are gone. Either way a block's firm holders are in
-- exactly one place.
local function promote(t, keys)
  if #keys == 0 then
    return
  end
  local names = tb_names(t, keys)
  local found = tb_get(names, keys)
  local moved, gone = {}, {}
  for _, k in ipairs(keys) do
    if found[k] then
      push(moved, k, found[k])
      gone[#gone + 1] = k
    end
  end
  if #gone > 0 then
    keep_plain(KEYS[9])
    redis.call('HSET', KEYS[9], unpack(moved))
    t.n = t.n - per_bucket('HDEL', names, gone)
    tb_save(t)
  end
end

local function demote(t, keys)
  if #keys == 0 then
    return
  end
  local shared = redis.call('HMGET', KEYS[9], unpack(keys))
  local lone, values = {}, {}
  for j = 1, #keys do
    local v = shared[j]
    if v and #v == 2 then
      lone[#lone + 1] = keys[j]
      values[keys[j]] = v
    end
  end
  if #lone == 0 then
    return
  end
  tb_reserve(t, #lone)
  redis.call('HDEL', KEYS[9], unpack(lone))
  t.n = t.n + per_bucket('HSET', tb_names(t, lone), lone, values)
  tb_save(t)
end

-- Drop tier bits `mask` of engine `id` from `fields` of blocks table `t`; with `gone`
-- (a table), its expiring records too (expired ones of those blocks go as well),
-- counting their deadline buckets in `gone`.
local function drop_holder(t, now, id, mask, fields, gone)
  update_blocks(t, fields, function(firm)
    return (firm_update(firm, id, 0, mask))
  end)
  if gone then
    local _, emptied = update_records(fields, function(recs)
      return rewrite_records(recs, now, id)
    end, function(_, dropped)
      if dropped then
        local b = bucket(dropped)
        gone[b] = (gone[b] or 0) - 1
      end
    end)
    demote(t, emptied)
  end
end

-- Rewrite the records of expiring adds whose deadline has passed (KEYS[2] scores each
-- add's packed keys by its deadline), about `budget` keys per call: expired records go
-- and blocks left with none are deleted. Lookups ignore expired records already;
-- this reclaims their memory. Returns 1 while expired adds remain.
local function sweep_expired(t, now, now_arg, budget)
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
      local _, emptied = update_records(fields, function(recs)
        return (rewrite_records(recs, now))
      end)
      demote(t, emptied)
    end
    redis.call('ZREM', KEYS[2], blob)
    budget = budget - n
  end
  return 1
end

-- Collect about `budget` firm entries of retired engine ids (queued by clears as
-- "id:not-before"): bucket by bucket, each engine's holdings tables come off the
-- blocks (a cursor `c` in the table's meta hash says how far it got) and are deleted.
-- A collected id goes to the free ids scored by the latest deadline of its expiring
-- records: it is reused only once those have expired, since lookups would otherwise
-- credit them to the id's next engine. KEYS: 4 free ids, 6 gc queue. Returns 1 while
-- work remains.
local function gc_step(t, now, prefix, budget)
  while budget > 0 do
    local item = redis.call('LINDEX', KEYS[6], 0)
    if not item then
      return 0
    end
    local id, after = string.match(item, '^(%d+):(.+)$')
    for tier = 0, 2 do
      local meta = held_meta(prefix, id, tier)
      local v = redis.call('HMGET', meta, 'L', 's', 'c')
      if v[1] then
        local buckets = 2 ^ tonumber(v[1]) + tonumber(v[2])
        local c = tonumber(v[3]) or 0
        while c < buckets and budget > 0 do
          local name = bucket_name(meta, c)
          local fields = redis.call('HKEYS', name)
          if #fields > 0 then
            drop_holder(t, now, tonumber(id), TIER_MASK[tier], fields, nil)
            redis.call('DEL', name)
          end
          budget = budget - #fields - 1
          c = c + 1
        end
        if c < buckets then
          redis.call('HSET', meta, 'c', c)
          return 1
        end
        redis.call('DEL', meta)
      end
    end
    redis.call('LPOP', KEYS[6])
    redis.call('ZADD', KEYS[4], after, id)
  end
  return redis.call('LLEN', KEYS[6]) > 0 and 1 or 0
end
