"""Cache events: how a worker tells the index which block hashes it holds.

A worker's block pool appends one event each time its *set of cached block hashes* changes, and
hands them on in order through ``take_events()``. Replaying a worker's events from an empty set
reproduces that set exactly: a hash that is already cached in another block produces no second
``BlockStored``, and ``BlockRemoved`` comes only when the last block holding a hash is evicted.

A worker with a host-memory tier (``--offload-gb``) says which tier each event is about
(``medium``: None for the device's cache, ``HOST`` for host memory). Its tiers hold a hash in one
at a time: a block offloaded is removed from the device and then stored in host memory, one
reloaded the other way round, so replaying the events without reading ``medium`` still gives
every hash the worker holds, in either tier.
"""

from __future__ import annotations

from dataclasses import dataclass

HOST = "host"  # the medium of a worker's host-memory tier (vLLM's "CPU")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """These hashes became cached: consecutive blocks of one chain, in chain order.

    The hashes are all an index reads. Each one already names its block's whole prefix, tokens,
    adapter and extra keys (docs/HASHING.md), so none of those travel to it. A worker that also
    publishes its events in vLLM's format (``--kv-events-config``) records what that format
    carries: the blocks' tokens, concatenated, the hash before the first (None at a chain's
    root), the LoRA adapter and the cache salt; empty otherwise, and for blocks pulled from a
    peer.
    """

    block_hashes: tuple[bytes, ...]
    token_ids: tuple[int, ...] = ()
    parent_block_hash: bytes | None = None
    lora: str | None = None
    cache_salt: str | None = None  # hashed into a chain's first block only
    medium: str | None = None  # None: the device's cache; HOST: host memory


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These hashes are no longer cached anywhere in the pool (in the tier ``medium`` names)."""

    block_hashes: tuple[bytes, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The pool dropped every cached block."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def replay(events: list[CacheEvent], cached: set[bytes] | None = None) -> set[bytes]:
    """Apply ``events`` in order to a set of cached hashes (a new one by default) and return it."""
    cached = set() if cached is None else cached
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()
    return cached
