-- Match depth of each candidate engine for a prompt's chained block keys.
-- KEYS: 1 blocks (the bucketed table's meta hash), 2 engines, 3 engine-epoch,
--       4 expiring records, 5 shared blocks
-- ARGV: 1 now, 2 packed block keys, 3 the engine epoch the caller's ids are from,
--       4 the caller's candidate ids (uint16 LE each, 65535: none), 5 candidate
--       labels joined by "\n"
-- Returns {0, results...} when the caller's ids are current, else
-- {1, epoch, packed ids, results...}; results are (candidate position, depth,
-- blocks held on no GPU tier, blocks of those held on the disk tier only) for each
-- depth > 0. A block counts at its best tier: GPU, then CPU, then disk.
--
-- Blocks are read in chunks (8, 16, ... 128 keys: most walks end early): one HMGET
-- of the shared blocks and one of the expiring records per chunk; a block the shared
-- hash lacks is read from its bucket when the walk reaches it. The walk stops at the
-- first block no remaining candidate holds. Consecutive blocks usually have the same
-- holders, and Lua interns strings, so a block whose values equal the previous
-- block's costs two comparisons; holders are decoded only where they change.
local sub, unpack_rec, call = string.sub, struct.unpack, redis.call
local now = tonumber(ARGV[1])
local blob = ARGV[2]
local n = #blob / 8
local NONE = 65535

local result = { 0 }
local ids = ARGV[4]
local epoch = redis.call('GET', KEYS[3])
if not epoch or epoch ~= ARGV[3] then
  -- The caller's ids are stale (or it has none): resolve labels and send ids back.
  local labels = {}
  for label in string.gmatch(ARGV[5], '[^\n]+') do
    labels[#labels + 1] = label
  end
  local parts = {}
  for start = 1, #labels, CHUNK do
    local found = redis.call('HMGET', KEYS[2], unpack(labels, start, math.min(#labels, start + CHUNK - 1)))
    for i = 1, #found do
      parts[#parts + 1] = struct.pack('<I2', found[i] and tonumber(found[i]) or NONE)
    end
  end
  ids = table.concat(parts)
  result = { 1, epoch or '', ids }
end

local alive_pos, alive_id, na = {}, {}, 0
for i = 1, #ids / 2 do
  local id = byte(ids, 2 * i - 1) + 256 * byte(ids, 2 * i)
  if id ~= NONE then
    na = na + 1
    alive_pos[na] = i
    alive_id[na] = id
  end
end
if na == 0 or n == 0 then
  return result
end

-- Per candidate position: status (1 GPU, 2 CPU at best, 3 disk only), the block where
-- that status began, blocks counted so far held on no GPU tier and on disk only.
local status, since, off, dsk = {}, {}, {}, {}
for j = 1, na do
  local c = alive_pos[j]
  status[c], since[c], off[c], dsk[c] = 1, 0, 0, 0
end

-- Credit the run of blocks [since, pos) to candidate c's counts by its status.
local function credit(c, pos)
  local s = status[c]
  if s >= 2 then
    off[c] = off[c] + pos - since[c]
    if s == 3 then
      dsk[c] = dsk[c] + pos - since[c]
    end
  end
end

-- The blocks table's geometry (lib.lua): each key's bucket, computed inline.
local geo = call('HMGET', KEYS[1], 'L', 's')
local size = 2 ^ (tonumber(geo[1]) or 0)
local size2, split, bucketed = 2 * size, tonumber(geo[2]) or 0, KEYS[1] .. ':'

local SKIPPED = {} -- a block's firm holders left unread: they could change nothing
local prev, prev_recs = 0, 0 -- numbers never equal a reply, so block 0 is decoded
local recorded = {} -- engine id -> true: a live record on the current block
local recs_of, shared_of, recs_from, recs_size, recs_base = {}, {}, 1, 8, 0
for i = 1, n do
  if i >= recs_from then -- the next chunk
    local stop = math.min(n, i + recs_size - 1)
    recs_size = math.min(recs_size * 2, 128)
    local fields = {}
    for k = i, stop do
      fields[k - i + 1] = sub(blob, k * 8 - 7, k * 8)
    end
    recs_of = call('HMGET', KEYS[4], unpack(fields))
    shared_of = call('HMGET', KEYS[5], unpack(fields))
    recs_from, recs_base = stop + 1, i - 1
  end
  local r = recs_of[i - recs_base]
  if r ~= prev_recs then
    recorded = {}
    if r then
      for o2 = 1, #r, REC do
        local id, d = unpack_rec('<I2d', r, o2)
        if d > now then
          recorded[id] = true
        end
      end
    end
  end
  local v = shared_of[i - recs_base]
  if not v then
    -- One engine at most holds the block firmly, in its bucket. A live record already
    -- counts a candidate at the best tier, so the bucket is read only for a candidate
    -- without one (a conversation's own engine, recorded by its last turn, skips it).
    v = SKIPPED
    for j = 1, na do
      if not recorded[alive_id[j]] then
        local o = i * 8
        local x, y, z = byte(blob, o - 2, o)
        local h = x + 256 * y + 65536 * z
        local b = h % size
        if b < split then
          b = h % size2
        end
        v = call('HGET', bucketed .. char(b % 256, floor(b / 256) % 256, floor(b / 65536)), sub(blob, o - 7, o))
        break
      end
    end
  end
  if v ~= prev or r ~= prev_recs then
    local pos = i - 1 -- blocks before this one
    local tiers = {}
    if v and v ~= SKIPPED then
      for o2 = 1, #v, 2 do
        local e = byte(v, o2) + 256 * byte(v, o2 + 1)
        tiers[floor(e / TIER_BITS)] = e % TIER_BITS
      end
    end
    for id in pairs(recorded) do
      tiers[id] = 1 -- an expiring record predicts a GPU hit
    end
    local j = 1
    while j <= na do
      local c = alive_pos[j]
      local bits = tiers[alive_id[j]]
      local s = 0
      if bits and bits ~= 0 then
        s = (bits % 2 == 1 and 1) or (bits % 4 >= 2 and 2) or 3
      end
      if s ~= status[c] then
        credit(c, pos)
        status[c], since[c] = s, pos
      end
      if s == 0 then
        if pos > 0 then
          result[#result + 1] = c
          result[#result + 1] = pos
          result[#result + 1] = off[c]
          result[#result + 1] = dsk[c]
        end
        alive_pos[j], alive_id[j] = alive_pos[na], alive_id[na]
        na = na - 1
      else
        j = j + 1
      end
    end
    if na == 0 then
      return result
    end
    prev, prev_recs = v, r
  end
end
for j = 1, na do
  local c = alive_pos[j]
  credit(c, n)
  result[#result + 1] = c
  result[#result + 1] = n
  result[#result + 1] = off[c]
  result[#result + 1] = dsk[c]
end
return result
