"""The prefix directory's Redis Lua scripts (`directory.PrefixDirectory` registers them).

Each write is one script so that a batch is applied atomically, in order and at most once; a lookup
round is one script so that it reads blocks in order and stops at the first miss server-side.
The scripts address per-block keys they build themselves: fine on a single Redis (or a replicated
primary), not on Redis Cluster.
"""

# Apply one event batch of a replica atomically, at most once (its seq must exceed the last).
# KEYS: the replica's liveness hash and its block set; ARGV: block key prefix, replica id, seq,
# block TTL ms, replica TTL ms, then ops: 'c' (cleared) or 's' / 'r' (stored / removed), tier,
# count, hashes. Returns {applied 0/1, previous seq or -1}.
APPLY_LUA = """
local prev = redis.call('HGET', KEYS[1], 'seq')
if prev and tonumber(prev) >= tonumber(ARGV[3]) then
  return {0, tonumber(prev)}
end
local bpre, rid = ARGV[1], ARGV[2]
local bttl, rttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local i, n = 6, #ARGV
while i <= n do
  local op = ARGV[i]
  if op == 'c' then
    for _, m in ipairs(redis.call('SMEMBERS', KEYS[2])) do
      local sep = string.find(m, '|', 1, true)
      redis.call('SREM', bpre .. string.sub(m, 1, sep - 1), rid .. '|' .. string.sub(m, sep + 1))
    end
    redis.call('DEL', KEYS[2])
    i = i + 1
  else
    local tier, cnt = ARGV[i + 1], tonumber(ARGV[i + 2])
    local member = rid .. '|' .. tier
    for j = i + 3, i + 2 + cnt do
      local k = bpre .. ARGV[j]
      if op == 's' then
        redis.call('SADD', k, member)
        redis.call('PEXPIRE', k, bttl)
        redis.call('SADD', KEYS[2], ARGV[j] .. '|' .. tier)
      else
        redis.call('SREM', k, member)
        redis.call('SREM', KEYS[2], ARGV[j] .. '|' .. tier)
      end
    end
    i = i + 3 + cnt
  end
end
redis.call('HSET', KEYS[1], 'seq', ARGV[3])
redis.call('PEXPIRE', KEYS[1], rttl)
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PEXPIRE', KEYS[2], bttl)
end
if prev then
  return {1, tonumber(prev)}
end
return {1, -1}
"""

# One lookup round: walk the chunk's block keys in order for the candidate replicas.
# ARGV: block key prefix, candidate count c, report-dead flag, c candidate ids, block hashes.
# With c = 0 the candidates are the holders of the chunk's first block (a walk's first round:
# its cost follows the replicas holding the prefix, not the replicas there are).
# Returns {per-candidate leading blocks in this chunk (aligned with the candidates),
# replica ids seen in the chunk that are not candidates (only when the flag is '1'),
# the candidates}.
WALK_LUA = """
local pre, c, report_dead = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local ids, index, count, alive = {}, {}, {}, {}
for i = 1, c do
  ids[i] = ARGV[3 + i]
  index[ids[i]] = i
  count[i] = 0
  alive[i] = true
end
local start = 4 + c
if c == 0 and start <= #ARGV then
  for _, m in ipairs(redis.call('SMEMBERS', pre .. ARGV[start])) do
    local rid = string.match(m, '^(.*)|')
    if rid and not index[rid] then
      c = c + 1
      ids[c] = rid
      index[rid] = c
      count[c] = 1
      alive[c] = true
    end
  end
  start = start + 1
end
local active, dead, seen = c, {}, {}
if active == 0 then
  return {count, dead, ids}
end
for j = start, #ARGV do
  local here = {}
  for _, m in ipairs(redis.call('SMEMBERS', pre .. ARGV[j])) do
    local rid = string.match(m, '^(.*)|')
    local i = index[rid]
    if i then
      here[i] = true
    elseif report_dead and rid and not seen[rid] then
      seen[rid] = true
      dead[#dead + 1] = rid
    end
  end
  for i = 1, c do
    if alive[i] then
      if here[i] then
        count[i] = count[i] + 1
      else
        alive[i] = false
        active = active - 1
      end
    end
  end
  if active == 0 then
    break
  end
end
return {count, dead, ids}
"""

# Remove every entry of one replica (its own set says which) and its liveness key.
# KEYS: the replica's liveness hash and its block set; ARGV: block key prefix, replica id.
FORGET_LUA = """
local bpre, rid = ARGV[1], ARGV[2]
local members = redis.call('SMEMBERS', KEYS[2])
for _, m in ipairs(members) do
  local sep = string.find(m, '|', 1, true)
  redis.call('SREM', bpre .. string.sub(m, 1, sep - 1), rid .. '|' .. string.sub(m, sep + 1))
end
redis.call('DEL', KEYS[1], KEYS[2])
return #members
"""
