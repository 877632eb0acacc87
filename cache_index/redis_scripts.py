"""The Lua scripts behind ``RedisIndex``: every read-check-write on one worker runs as one script.

Each per-worker script names only that worker's keys, which share the hash tag ``{<worker tag>}``
(see docs/INDEX.md), so it is atomic on a single Redis and on a Redis Cluster alike. The worker's
keys, in the order every per-worker script takes them::

    KEYS[1] - meta:   HASH address, namespace, block_size, role, num_blocks, last_seq, trusted,
                      epoch
    KEYS[2] - alive:  STRING "1" with a PEXPIRE; its absence means the registration lapsed
    KEYS[3] - blocks: SET of 16-byte block hashes

Apply statuses come back as the string values of ``ApplyStatus``.
"""

from __future__ import annotations

# NOTE: Lua's unpack() fails past a few thousand values, so long argument runs go to Redis in
# slices of this many.
_UNPACK_SLICE = 1000

# Shared by both match scripts: how many leading chain hashes, ARGV[first..], a worker holds, or
# -1 where the worker is lapsed, untrusted or of another namespace.
_LEADING_BLOCKS_FN = """
-- The chain arrives as one argument, its 16-byte hashes back to back: one bulk string is far
-- cheaper to send and to hand to Lua than hundreds of small ones.
local function split_chain(packed)
    local chain = {}
    for i = 1, #packed, 16 do
        chain[#chain + 1] = string.sub(packed, i, i + 15)
    end
    return chain
end

local function leading_blocks(meta, alive, blocks, namespace, chain)
    if redis.call('EXISTS', alive) == 0 then return -1 end
    local state = redis.call('HMGET', meta, 'namespace', 'trusted')
    if state[1] ~= namespace or state[2] ~= '1' then return -1 end
    -- SMISMEMBER over growing slices of the chain: one call answers many hashes, and a short
    -- match stops after a small first slice.
    local num_matched = 0
    local i, size = 1, 32
    while i <= #chain do
        local last = math.min(i + size - 1, #chain)
        local found = redis.call('SMISMEMBER', blocks, unpack(chain, i, last))
        for j = 1, #found do
            if found[j] == 0 then return num_matched end
            num_matched = num_matched + 1
        end
        i, size = last + 1, math.min(size * 2, 1024)
    end
    return num_matched
end
"""

REGISTER = """
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- ARGV[1] - time to live in milliseconds
-- ARGV[2..] - the WorkerInfo fields, as field, value pairs for meta
-- returns the namespace of the incarnation it replaced, or nil
-- Starts a new incarnation: the old one's blocks and sequence state are gone, last_seq = 0,
-- trusted, epoch one more than before.
local old = redis.call('HMGET', KEYS[1], 'namespace', 'epoch')
redis.call('DEL', KEYS[1], KEYS[3])
local epoch = (tonumber(old[2]) or 0) + 1
redis.call('HSET', KEYS[1], 'last_seq', '0', 'trusted', '1', 'epoch', epoch, unpack(ARGV, 2))
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
return old[1]
"""

APPLY = f"""
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- ARGV[1] - the batch's sequence number
-- ARGV[2..] - its events, in order: 'stored' n h1..hn | 'removed' n h1..hn | 'cleared'
-- returns 'applied', 'duplicate', 'needs_resync' or 'unknown_worker'
-- The seq check, the set changes and the last_seq bump happen together or not at all.
if redis.call('EXISTS', KEYS[2]) == 0 then return 'unknown_worker' end
local state = redis.call('HMGET', KEYS[1], 'last_seq', 'trusted')
local last_seq = tonumber(state[1])
local seq = tonumber(ARGV[1])
if seq <= last_seq then return 'duplicate' end
if seq > last_seq + 1 or state[2] ~= '1' then
    redis.call('HSET', KEYS[1], 'trusted', '0')
    return 'needs_resync'
end
local i = 2
while i <= #ARGV do
    if ARGV[i] == 'cleared' then
        redis.call('DEL', KEYS[3])
        i = i + 1
    else
        local command = ARGV[i] == 'stored' and 'SADD' or 'SREM'
        local last = i + 1 + tonumber(ARGV[i + 1])
        for first = i + 2, last, {_UNPACK_SLICE} do
            local slice_last = math.min(first + {_UNPACK_SLICE - 1}, last)
            redis.call(command, KEYS[3], unpack(ARGV, first, slice_last))
        end
        i = last + 1
    end
end
redis.call('HSET', KEYS[1], 'last_seq', ARGV[1])
return 'applied'
"""

RESYNC = """
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- KEYS[4] - the snapshot, written by the caller just before (a temporary SET in the same slot,
--           absent for an empty snapshot)
-- ARGV[1] - the snapshot's sequence number
-- returns 1, or 0 if the worker is not live (the snapshot is dropped)
-- The snapshot replaces blocks in one step: match never sees a half-written set.
if redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('DEL', KEYS[4])
    return 0
end
if redis.call('EXISTS', KEYS[4]) == 1 then
    redis.call('RENAME', KEYS[4], KEYS[3])
    redis.call('PERSIST', KEYS[3])  -- RENAME carries over the snapshot's safety TTL
else
    redis.call('DEL', KEYS[3])
end
redis.call('HSET', KEYS[1], 'last_seq', ARGV[1], 'trusted', '1')
return 1
"""

DROP = """
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- ARGV[1] - '1': only if the registration lapsed; '0': in any case
-- returns the namespace of the dropped worker, or nil if nothing was dropped
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[2]) == 1 then return nil end
local namespace = redis.call('HGET', KEYS[1], 'namespace')
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return namespace
"""

MATCH_WORKER = f"""
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- ARGV[1] - the namespace
-- ARGV[2] - the chain of block hashes, concatenated (16 bytes each)
-- returns how many leading chain blocks the worker holds, or -1 if it is lapsed, untrusted or
--         of another namespace
{_LEADING_BLOCKS_FN}
return leading_blocks(KEYS[1], KEYS[2], KEYS[3], ARGV[1], split_chain(ARGV[2]))
"""

MATCH_NAMESPACE = f"""
-- KEYS[1] - the namespace's registry (a SET of worker ids)
-- ARGV[1] - the worker key prefix, '<prefix>:w:{{'
-- ARGV[2] - the namespace
-- ARGV[3] - the chain of block hashes, concatenated (16 bytes each)
-- returns worker id, count, worker id, count, ... for every live, trusted worker of it
-- Single Redis only: it reads worker keys it derives from the registry, which a cluster forbids.
{_LEADING_BLOCKS_FN}
local escapes = {{['%'] = '%25', ['{{'] = '%7B', ['}}'] = '%7D'}}
local result = {{}}
local chain = split_chain(ARGV[3])
for _, worker_id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    local base = ARGV[1] .. (string.gsub(worker_id, '[%%{{}}]', escapes)) .. '}}:'
    local n = leading_blocks(base .. 'meta', base .. 'alive', base .. 'blocks', ARGV[2], chain)
    if n >= 0 then
        result[#result + 1] = worker_id
        result[#result + 1] = n
    end
end
return result
"""

WORKER_STATS = """
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- returns {0, 0, 0} if the worker is not live, else {1, its number of blocks, the bytes its
--         three keys take (MEMORY USAGE)}
if redis.call('EXISTS', KEYS[2]) == 0 then return {0, 0, 0} end
local memory_bytes = 0
for _, key in ipairs(KEYS) do
    memory_bytes = memory_bytes + (redis.call('MEMORY', 'USAGE', key) or 0)
end
return {1, redis.call('SCARD', KEYS[3]), memory_bytes}
"""

ALL_SCRIPTS = (REGISTER, APPLY, RESYNC, DROP, MATCH_WORKER, MATCH_NAMESPACE, WORKER_STATS)
