"""The Lua scripts behind ``RedisIndex``: every read-check-write on one worker runs as one script.

Each per-worker script names only that worker's keys, which share the hash tag ``{<worker tag>}``
(see docs/INDEX.md), so it is atomic on a single Redis and on a Redis Cluster alike. The worker's
keys, in the order every per-worker script takes them::

    KEYS[1] - meta:   HASH address, namespace, block_size, role, num_blocks, max_model_len,
                      last_seq, trusted, epoch, and on a single Redis slot (its bit in the
                      namespace's map)
    KEYS[2] - alive:  STRING "1" with a PEXPIRE; its absence means the registration lapsed
    KEYS[3] - blocks: SET of 16-byte block hashes

On a single Redis (not on a cluster) the scripts that change a worker's blocks also keep its
namespace's inverted map (``<prefix>:ns:<namespace>:map``, block hash -> bitmap of slots) and
slot table (``<prefix>:ns:<namespace>:slots``, worker id -> slot) in step, in the same script;
they derive those keys from the map prefix in ARGV and the namespace in meta, which only a
single Redis allows. MATCH_NAMESPACE answers from the map. On a cluster the map prefix is '':
no map, and match runs MATCH_NODE once per node over the per-worker sets.

No script's work grows with a worker's whole set (a million blocks took seconds, and Redis
serves nobody while a script runs). A set is never cleared in place: a script renames it aside
(``retire``) and hands its slot to the namespace's retired table; CLEAR_RETIRED then clears its
bits a slice at a time. A snapshot is written a slice at a time too (RESYNC_BEGIN,
RESYNC_FILL..., RESYNC_COMMIT) under a slot of its own that no lookup reads, and the commit
swaps it in by renaming keys.

Apply statuses come back as the string values of ``ApplyStatus``.
"""

from __future__ import annotations

# NOTE: Lua's unpack() fails past a few thousand values, so long argument runs go to Redis in
# slices of this many.
_UNPACK_SLICE = 1000

# Hashes per HMGET in MATCH_NAMESPACE: a short match stops after one slice, and struct.unpack
# returns this many values and one more at once, well under Lua's limit.
_MATCH_SLICE = 128

# MATCH_NODE's: the packed chain split into its hashes, and how many leading chain hashes a worker
# holds, or -1 where the worker is lapsed, untrusted or of another namespace.
_SPLIT_CHAIN_FN = """
-- The chain arrives as one argument, its 16-byte hashes back to back: one bulk string is far
-- cheaper to send and to hand to Lua than hundreds of small ones.
local function split_chain(packed)
    local chain, n = {}, #packed / 16
    -- NOTE: struct.unpack cuts 128 hashes per call: one C call where string.sub made 128, and
    -- well under Lua's limit on the values a call may return.
    local pos, fmt = 1, string.rep('c16', 128)
    while #chain + 128 <= n do
        local parts = {struct.unpack(fmt, packed, pos)}
        pos = parts[129]
        for j = 1, 128 do chain[#chain + 1] = parts[j] end
    end
    for i = pos, #packed, 16 do chain[#chain + 1] = string.sub(packed, i, i + 15) end
    return chain
end
"""

_LEADING_BLOCKS_FN = (
    _SPLIT_CHAIN_FN
    + """
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
)

# Shared by the per-worker scripts that change a worker's blocks: the single-Redis inverted map
# of its namespace. ARGV carries the map prefix, '<prefix>:ns:', or '' (a cluster: no map).
_MAP_FN = f"""
-- A namespace's map: HASH block hash -> bitmap string, bit k (byte k // 8 + 1, value
-- 2 ^ (k % 8)) set while the worker holding slot k of the namespace holds the block.
local function map_key(map_prefix, namespace)
    return map_prefix .. namespace .. ':map'
end

local function slots_key(map_prefix, namespace)
    return map_prefix .. namespace .. ':slots'
end

-- SET of the ids of the namespace's workers that wait for a resync (meta's trusted is 0), so
-- that MATCH_NAMESPACE need not read every worker's meta.
local function untrusted_key(map_prefix, namespace)
    return map_prefix .. namespace .. ':untrusted'
end

-- Sets (on) or clears (not on) the bit of slot in the map entries of hashes[first..last].
local function update_bits(map, slot, on, hashes, first, last)
    local b = math.floor(slot / 8) + 1
    local mask = 2 ^ (slot % 8)
    for s = first, last, {_UNPACK_SLICE} do
        local e = math.min(s + {_UNPACK_SLICE - 1}, last)
        local values = redis.call('HMGET', map, unpack(hashes, s, e))
        local writes, deletes = {{}}, {{}}
        for j = 1, #values do
            local value = values[j] or ''
            local old = string.byte(value, b) or 0
            local new
            if on then new = bit.bor(old, mask) else new = bit.band(old, 255 - mask) end
            if new ~= old then
                if #value < b then value = value .. string.rep('\\0', b - #value) end
                value = string.sub(value, 1, b - 1) .. string.char(new) .. string.sub(value, b + 1)
                if on or string.find(value, '[^%z]') then  -- a bit just set is not 0
                    writes[#writes + 1] = hashes[s + j - 1]
                    writes[#writes + 1] = value
                else
                    deletes[#deletes + 1] = hashes[s + j - 1]
                end
            end
        end
        if #writes > 0 then redis.call('HSET', map, unpack(writes)) end
        if #deletes > 0 then redis.call('HDEL', map, unpack(deletes)) end
    end
end

-- HASH slot -> '<cursor>:<key>': a set renamed aside, whose blocks may still have that slot's bit
-- set, and how far CLEAR_RETIRED's SSCAN of it has got. The slot is reserved until the scan is
-- through.
local function retired_key(map_prefix, namespace)
    return map_prefix .. namespace .. ':retired'
end

-- HASH slot -> worker id, for the slot a resync in progress fills (meta's pending_slot).
local function pending_key(map_prefix, namespace)
    return map_prefix .. namespace .. ':pending'
end

-- The lowest slot of the namespace that no worker holds, no resync fills and no retired set
-- still marks.
local function take_free_slot(map_prefix, namespace)
    local used = {{}}
    for _, slot in ipairs(redis.call('HVALS', slots_key(map_prefix, namespace))) do
        used[tonumber(slot)] = true
    end
    for _, slot in ipairs(redis.call('HKEYS', retired_key(map_prefix, namespace))) do
        used[tonumber(slot)] = true
    end
    for _, slot in ipairs(redis.call('HKEYS', pending_key(map_prefix, namespace))) do
        used[tonumber(slot)] = true
    end
    local slot = 0
    while used[slot] do slot = slot + 1 end
    return slot
end

-- Takes the set out of the way in O(1): single Redis, renamed aside with its slot in the retired
-- table (a slot with an empty set is free at once); cluster (no map), unlinked (freed off
-- Redis' main thread).
local function retire(map_prefix, namespace, slot, set)
    if map_prefix == '' or not slot then
        redis.call('UNLINK', set)
        return
    end
    if redis.call('EXISTS', set) == 1 then
        local aside = set .. ':retired:' .. namespace .. ':' .. slot
        redis.call('RENAME', set, aside)
        redis.call('HSET', retired_key(map_prefix, namespace), slot, '0:' .. aside)
    end
end

-- The key of the set a resync of generation gen fills.
local function snapshot_set(blocks, gen)
    return blocks .. ':snapshot:' .. gen
end

-- Gives up the worker's resync in progress, if any (its set and slot retired).
local function abandon_resync(meta, blocks, map_prefix, namespace)
    local state = redis.call('HMGET', meta, 'resync_gen', 'pending_slot')
    if not state[1] then return end
    if map_prefix ~= '' and state[2] then
        redis.call('HDEL', pending_key(map_prefix, namespace), state[2])
    end
    retire(map_prefix, namespace, tonumber(state[2]), snapshot_set(blocks, state[1]))
    redis.call('HDEL', meta, 'resync_gen', 'pending_slot')
end

-- Retires the worker's set and its slot (and any resync in progress); it holds nothing after.
local function retire_worker(meta, blocks, map_prefix, worker_id, namespace, slot)
    abandon_resync(meta, blocks, map_prefix, namespace)
    retire(map_prefix, namespace, slot, blocks)
    if map_prefix ~= '' and slot then
        redis.call('HDEL', slots_key(map_prefix, namespace), worker_id)
        redis.call('SREM', untrusted_key(map_prefix, namespace), worker_id)
    end
end
"""

REGISTER = f"""
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- ARGV[1] - time to live in milliseconds
-- ARGV[2] - the map prefix, '<prefix>:ns:', or '' on a cluster (no map)
-- ARGV[3] - the worker id
-- ARGV[4..] - the WorkerInfo fields, as field, value pairs for meta
-- returns the namespace of the incarnation it replaced, or nil
-- Starts a new incarnation: the old one's blocks (and its slot, map bits and any resync in
-- progress) are retired, last_seq = 0, trusted, epoch one more than before, and (single Redis)
-- the lowest free slot of its namespace.
{_MAP_FN}
local old = redis.call('HMGET', KEYS[1], 'namespace', 'epoch', 'slot')
local map_prefix = ARGV[2]
if old[1] then
    retire_worker(KEYS[1], KEYS[3], map_prefix, ARGV[3], old[1], tonumber(old[3]))
end
redis.call('DEL', KEYS[1])
local epoch = (tonumber(old[2]) or 0) + 1
redis.call('HSET', KEYS[1], 'last_seq', '0', 'trusted', '1', 'epoch', epoch, unpack(ARGV, 4))
if map_prefix ~= '' then
    local namespace = redis.call('HGET', KEYS[1], 'namespace')
    local slot = take_free_slot(map_prefix, namespace)
    redis.call('HSET', slots_key(map_prefix, namespace), ARGV[3], slot)
    redis.call('SREM', untrusted_key(map_prefix, namespace), ARGV[3])
    redis.call('HSET', KEYS[1], 'slot', slot)
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
return old[1]
"""

APPLY = f"""
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- ARGV[1] - the batch's sequence number
-- ARGV[2] - the map prefix, '<prefix>:ns:', or '' on a cluster (no map)
-- ARGV[3] - the worker id
-- ARGV[4..] - its events, in order: 'stored' n h1..hn | 'removed' n h1..hn | 'cleared'
-- returns 'applied', 'duplicate', 'needs_resync' or 'unknown_worker'
-- The seq check, the set changes (and the map bits), and the last_seq bump happen together or
-- not at all. 'cleared' retires the set and (single Redis) moves the worker to a fresh slot.
{_MAP_FN}
if redis.call('EXISTS', KEYS[2]) == 0 then return 'unknown_worker' end
local state = redis.call('HMGET', KEYS[1], 'last_seq', 'trusted', 'namespace', 'slot')
local last_seq = tonumber(state[1])
local seq = tonumber(ARGV[1])
if seq <= last_seq then return 'duplicate' end
local slot = tonumber(state[4])
if seq > last_seq + 1 or state[2] ~= '1' then
    redis.call('HSET', KEYS[1], 'trusted', '0')
    if ARGV[2] ~= '' and slot then
        redis.call('SADD', untrusted_key(ARGV[2], state[3]), ARGV[3])
    end
    return 'needs_resync'
end
local map = nil
if ARGV[2] ~= '' and slot then map = map_key(ARGV[2], state[3]) end
local i = 4
while i <= #ARGV do
    if ARGV[i] == 'cleared' then
        retire(ARGV[2], state[3], slot, KEYS[3])
        if map then
            redis.call('HDEL', slots_key(ARGV[2], state[3]), ARGV[3])
            slot = take_free_slot(ARGV[2], state[3])
            redis.call('HSET', slots_key(ARGV[2], state[3]), ARGV[3], slot)
            redis.call('HSET', KEYS[1], 'slot', slot)
        end
        i = i + 1
    else
        local stored = ARGV[i] == 'stored'
        local command = stored and 'SADD' or 'SREM'
        local last = i + 1 + tonumber(ARGV[i + 1])
        for first = i + 2, last, {_UNPACK_SLICE} do
            local slice_last = math.min(first + {_UNPACK_SLICE - 1}, last)
            redis.call(command, KEYS[3], unpack(ARGV, first, slice_last))
        end
        if map then update_bits(map, slot, stored, ARGV, i + 2, last) end
        i = last + 1
    end
end
redis.call('HSET', KEYS[1], 'last_seq', ARGV[1])
return 'applied'
"""

RESYNC_BEGIN = f"""
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- ARGV[1] - the map prefix, '<prefix>:ns:', or '' on a cluster (no map)
-- ARGV[2] - the worker id
-- ARGV[3] - the resync's generation, a fresh token
-- returns the worker's namespace, or nil if it is not live
-- Starts a resync: the worker is untrusted (left out of match) until RESYNC_COMMIT, so that no
-- lookup meanwhile claims a block it may no longer hold; the snapshot is filled under a slot of
-- its own (single Redis), reserved in the namespace's pending table. A resync in progress of an
-- earlier generation is given up.
{_MAP_FN}
if redis.call('EXISTS', KEYS[2]) == 0 then return nil end
local namespace = redis.call('HGET', KEYS[1], 'namespace')
abandon_resync(KEYS[1], KEYS[3], ARGV[1], namespace)
redis.call('HSET', KEYS[1], 'trusted', '0', 'resync_gen', ARGV[3])
if ARGV[1] ~= '' then
    redis.call('SADD', untrusted_key(ARGV[1], namespace), ARGV[2])
    local slot = take_free_slot(ARGV[1], namespace)
    redis.call('HSET', pending_key(ARGV[1], namespace), slot, ARGV[2])
    redis.call('HSET', KEYS[1], 'pending_slot', slot)
end
return namespace
"""

RESYNC_FILL = f"""
-- KEYS[1] - meta, KEYS[2] - the snapshot set of this generation
-- ARGV[1] - the map prefix, '<prefix>:ns:', or '' on a cluster (no map)
-- ARGV[2] - the resync's generation
-- ARGV[3..] - one slice of the snapshot's block hashes
-- returns 1, or 0 if this generation is no longer the worker's resync (it registered again,
--         was dropped, or a newer resync began): nothing is written
{_MAP_FN}
local state = redis.call('HMGET', KEYS[1], 'resync_gen', 'pending_slot', 'namespace')
if state[1] ~= ARGV[2] then return 0 end
for first = 3, #ARGV, {_UNPACK_SLICE} do
    redis.call('SADD', KEYS[2], unpack(ARGV, first, math.min(first + {_UNPACK_SLICE - 1}, #ARGV)))
end
if ARGV[1] ~= '' and state[2] then
    update_bits(map_key(ARGV[1], state[3]), tonumber(state[2]), true, ARGV, 3, #ARGV)
end
return 1
"""

RESYNC_COMMIT = f"""
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks, KEYS[4] - the snapshot set of this
--           generation (absent for an empty snapshot)
-- ARGV[1] - the snapshot's sequence number
-- ARGV[2] - the map prefix, '<prefix>:ns:', or '' on a cluster (no map)
-- ARGV[3] - the worker id
-- ARGV[4] - the resync's generation
-- returns 1, or 0 if the worker is not live or this generation is no longer its resync
-- Swaps the filled snapshot in by renaming keys: match sees the old set or the new one, never a
-- mix, and the old set is retired, not cleared here.
{_MAP_FN}
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local state = redis.call('HMGET', KEYS[1], 'resync_gen', 'pending_slot', 'namespace', 'slot')
if state[1] ~= ARGV[4] then return 0 end
local map_prefix, namespace = ARGV[2], state[3]
retire(map_prefix, namespace, tonumber(state[4]), KEYS[3])
if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('RENAME', KEYS[4], KEYS[3]) end
if map_prefix ~= '' then
    redis.call('HDEL', pending_key(map_prefix, namespace), state[2])
    redis.call('HSET', slots_key(map_prefix, namespace), ARGV[3], state[2])
    redis.call('SREM', untrusted_key(map_prefix, namespace), ARGV[3])
    redis.call('HSET', KEYS[1], 'slot', state[2])
end
redis.call('HDEL', KEYS[1], 'resync_gen', 'pending_slot')
redis.call('HSET', KEYS[1], 'last_seq', ARGV[1], 'trusted', '1')
return 1
"""

DROP = f"""
-- KEYS[1] - meta, KEYS[2] - alive, KEYS[3] - blocks
-- ARGV[1] - '1': only if the registration lapsed; '0': in any case
-- ARGV[2] - the map prefix, '<prefix>:ns:', or '' on a cluster (no map)
-- ARGV[3] - the worker id
-- returns the namespace of the dropped worker, or nil if nothing was dropped
-- Its set (and any resync in progress) is retired; CLEAR_RETIRED clears the map bits after.
{_MAP_FN}
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[2]) == 1 then return nil end
local state = redis.call('HMGET', KEYS[1], 'namespace', 'slot')
if state[1] then
    retire_worker(KEYS[1], KEYS[3], ARGV[2], ARGV[3], state[1], tonumber(state[2]))
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('UNLINK', KEYS[3])
return state[1]
"""

CLEAR_RETIRED = f"""
-- No KEYS: single Redis only, it derives the namespace's keys from ARGV
-- ARGV[1] - the map prefix, '<prefix>:ns:'
-- ARGV[2] - the namespace
-- ARGV[3] - about this many blocks to clear in this call (SSCAN's COUNT)
-- returns how many retired slots the namespace still has (0: all of them cleared and free)
-- Scans the retired sets on from where the last call stopped, clearing their slot's bit in the
-- map; a set scanned through is unlinked and its slot is free again. Called until it answers 0.
-- NOTE: a scan, not SPOP: a retired set is never written again, and SPOP's random picks in a
-- large, emptying set took up to 20 ms.
{_MAP_FN}
local retired = retired_key(ARGV[1], ARGV[2])
local map = map_key(ARGV[1], ARGV[2])
local budget = tonumber(ARGV[3])
local entries = redis.call('HGETALL', retired)
local num_left = #entries / 2
for i = 1, #entries, 2 do
    if budget <= 0 then break end
    local slot = tonumber(entries[i])
    local cursor, set = string.match(entries[i + 1], '^(%d+):(.*)$')
    local reply = redis.call('SSCAN', set, cursor, 'COUNT', budget)
    update_bits(map, slot, false, reply[2], 1, #reply[2])
    budget = budget - math.max(#reply[2], 1)
    if reply[1] == '0' then
        redis.call('UNLINK', set)
        redis.call('HDEL', retired, entries[i])
        num_left = num_left - 1
    else
        redis.call('HSET', retired, entries[i], reply[1] .. ':' .. set)
    end
end
return num_left
"""

# NOTE: the shebang's flags let one call read the keys of every worker whose slots this node
# serves (Redis 7): a cluster lookup is one call per node, not one per worker. The keys come as
# ARGV, since a cluster refuses declared KEYS of several slots whatever the flags say.
MATCH_NODE = f"""#!lua flags=allow-cross-slot-keys,no-writes
-- No KEYS (see above)
-- ARGV[1] - the namespace
-- ARGV[2] - the chain of block hashes, concatenated (16 bytes each)
-- ARGV[3..] - meta, alive, blocks of each worker asked, three keys a worker; all on this node
-- returns, per worker in ARGV order, how many leading chain blocks it holds, or -1 if it is
--         lapsed, untrusted or of another namespace
{_LEADING_BLOCKS_FN}
local chain = split_chain(ARGV[2])
local counts = {{}}
for i = 3, #ARGV, 3 do
    counts[#counts + 1] = leading_blocks(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[1], chain)
end
return counts
"""

MATCH_NAMESPACE = f"""
-- KEYS[1] - the namespace's slot table (HASH worker id -> slot)
-- KEYS[2] - the namespace's map (HASH block hash -> bitmap of slots)
-- KEYS[3] - the namespace's untrusted workers (SET of worker ids)
-- ARGV[1] - the worker key prefix, '<prefix>:w:{{'
-- ARGV[2] - the namespace
-- ARGV[3] - the chain of block hashes, concatenated (16 bytes each)
-- returns worker id, count, worker id, count, ... for every live, trusted worker of it
-- Single Redis only: it reads worker keys it derives from the slot table, which a cluster
-- forbids, and the map exists only on a single Redis.
local band, bxor, lshift = bit.band, bit.bxor, bit.lshift
local escapes = {{['%'] = '%25', ['{{'] = '%7B', ['}}'] = '%7D'}}
local slots = redis.call('HGETALL', KEYS[1])
local alive_keys = {{}}
for i = 1, #slots, 2 do
    local worker_id = slots[i]
    if string.find(worker_id, '[%%{{}}]') then
        worker_id = string.gsub(worker_id, '[%%{{}}]', escapes)
    end
    alive_keys[#alive_keys + 1] = ARGV[1] .. worker_id .. '}}:alive'
end
local alive = #alive_keys > 0 and redis.call('MGET', unpack(alive_keys)) or {{}}
local untrusted = {{}}
for _, worker_id in ipairs(redis.call('SMEMBERS', KEYS[3])) do untrusted[worker_id] = true end
-- The candidates as 32-bit words of slot bits: active[w] has the bits of the candidates of word w
-- that hold every chain block so far; words lists the words that have any.
-- The slot table lists exactly the workers whose meta names this namespace and the slot (REGISTER
-- and DROP change both together), so liveness and trust are all there is left to check.
local candidates, slot_worker, active, words = {{}}, {{}}, {{}}, {{}}
for n = 1, #alive_keys do
    local worker_id, slot = slots[2 * n - 1], tonumber(slots[2 * n])
    if alive[n] and not untrusted[worker_id] then
        local w = math.floor(slot / 32) + 1
        if not active[w] then
            active[w] = 0
            words[#words + 1] = w
        end
        active[w] = bit.bor(active[w], lshift(1, slot % 32))
        slot_worker[slot] = worker_id
        candidates[#candidates + 1] = worker_id
    end
end
local bit_position = {{}}  -- a single bit -> its position in the word
for k = 0, 31 do bit_position[lshift(1, k)] = k end
-- Word w of a bitmap, as the bit operations' signed 32-bit number; a bitmap is as long as its
-- highest set bit needs.
local function word(value, w)
    local first = 4 * w - 3
    if #value < first + 3 then
        value = string.sub(value .. '\0\0\0\0', first, first + 3)
        first = 1
    end
    return (struct.unpack('<i4', value, first))
end
local num_blocks = #ARGV[3] / 16
local counts = {{}}
local num_active = #words
-- HMGET over slices of the chain (a short match stops after the first), until no candidate holds
-- every block so far. Every bitmap that was checked holds every candidate still active after
-- it, so a run of equal bitmaps (blocks held by the same workers) costs one string comparison a
-- block.
-- NOTE: HMGET takes the slice's hashes straight from struct.unpack, with no table between. The
-- value unpack returns after them, the position that follows, asks for one more field that no map
-- has (its fields are 16-byte hashes); its answer is past the slice and never read.
local done, pos, checked = 0, 1, nil
while num_active > 0 and done < num_blocks do
    local size = math.min({_MATCH_SLICE}, num_blocks - done)
    local fields = string.rep('c16', size)
    local values = redis.call('HMGET', KEYS[2], struct.unpack(fields, ARGV[3], pos))
    for j = 1, size do
        local value = values[j]  -- false where no worker holds the block
        if value ~= checked then
            for _, w in ipairs(words) do
                local was = active[w]
                local now = was ~= 0 and value and band(was, word(value, w)) or 0
                if now ~= was then
                    -- The candidates of the lost bits hold the blocks before this one.
                    local lost = bxor(was, now)
                    repeat
                        local low = band(lost, -lost)
                        counts[slot_worker[32 * (w - 1) + bit_position[low]]] = done + j - 1
                        lost = bxor(lost, low)
                    until lost == 0
                    active[w] = now
                    if now == 0 then num_active = num_active - 1 end
                end
            end
            if num_active == 0 then break end
            checked = value
        end
    end
    done, pos = done + size, pos + 16 * size
end
local result = {{}}
for _, worker_id in ipairs(candidates) do
    result[#result + 1] = worker_id
    result[#result + 1] = counts[worker_id] or num_blocks
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

ALL_SCRIPTS = (
    REGISTER,
    APPLY,
    RESYNC_BEGIN,
    RESYNC_FILL,
    RESYNC_COMMIT,
    DROP,
    CLEAR_RETIRED,
    MATCH_NODE,
    MATCH_NAMESPACE,
    WORKER_STATS,
)
