-- Match depth of each candidate engine for a prompt's chained block keys.
-- KEYS: 1 blocks, 2 engines, 3 engine-epoch
-- ARGV: 1 now, 2 packed block keys, 3 the engine epoch the caller's ids are from,
--       4 the caller's candidate ids (uint16 LE each, 65535: none), 5 candidate
--       labels joined by "\n"
-- Returns {0, results...} when the caller's ids are current, else
-- {1, epoch, packed ids, results...}; results are (candidate position, depth,
-- blocks held on no GPU tier, blocks of those held on the disk tier only) for each
-- depth > 0. A block counts at its best tier: GPU, then CPU, then disk.
--
-- Keys are fetched in chunks (small first: most walks end early) and the walk stops at
-- the first block no remaining candidate holds. Consecutive blocks usually have the
-- same holders, and Lua interns strings, so a block whose value equals the previous
-- block's costs one comparison; holders are decoded only where the value changes.
local byte, sub, floor, unpack_rec = string.byte, string.sub, math.floor, struct.unpack
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

local prev = 0 -- a number never equals a reply, so block 0 is decoded
local start, size = 1, 8
while start <= n do
  local stop = math.min(n, start + size - 1)
  size = math.min(size * 2, 128)
  local fields = {}
  for i = start, stop do
    fields[i - start + 1] = sub(blob, i * 8 - 7, i * 8)
  end
  local values = redis.call('HMGET', KEYS[1], unpack(fields))
  for k = 1, stop - start + 1 do
    local v = values[k]
    if v ~= prev then
      local pos = start + k - 2 -- blocks before this one
      local tiers = {}
      if v then
        local firm, recs = split(v)
        for o = 1, #firm, 2 do
          local e = byte(firm, o) + 256 * byte(firm, o + 1)
          tiers[floor(e / TIER_BITS)] = e % TIER_BITS
        end
        for o = 1, #recs, REC do
          local id, d = unpack_rec('<I2d', recs, o)
          if d > now then
            tiers[id] = 1 -- an expiring record predicts a GPU hit
          end
        end
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
      prev = v
    end
  end
  start = stop + 1
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
