"""The global block-hash index: which live worker holds which cached blocks.

Workers keep it true by registering, heartbeating and applying their cache events in order; the
router asks it, per prompt, how long a prefix of the prompt's block chain each worker holds.

Every backend (embedded, Redis, Redis Cluster) implements ``BlockIndex`` with the same
behaviour, pinned by one shared test suite. Per worker, the index keeps a set of block hashes
and the sequence number of the last event batch applied to it::

    register(info)            -> entries of an earlier incarnation cleared, last_seq = 0, trusted
    apply(id, seq, events)    seq == last_seq + 1: applied           -> APPLIED
                              seq <= last_seq:     already applied   -> DUPLICATE (no change)
                              seq >  last_seq + 1: a batch was lost  -> NEEDS_RESYNC; the worker
                                                   is untrusted (left out of match) until ...
    resync(id, seq, hashes)   ... its entries are replaced at once by a Snapshot taken at seq
"""

from __future__ import annotations

import asyncio
import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvswitch.cache_index.events import CacheEvent
from kvswitch.cache_index.hashing import HASH_MODES, XXH3, BlockNaming
from kvswitch.serving import end_if_cancelled

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
# Not a worker's: an engine's GPU-tier entry (cache_index/engine_feed.py), which holds the blocks
# its GPU holds beside the engine's own entry (any tier's); a router never routes to it.
TIER_ROLE = "tier"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker tells the index about itself when it registers."""

    worker_id: str
    address: str  # host:port of its Worker gRPC service
    namespace: str  # the model name: hashes of other namespaces never match
    block_size: int
    role: str = "both"
    num_blocks: int = 0  # KV cache capacity in blocks
    max_model_len: int = 0  # longest context (prompt plus output) in tokens; 0 = unknown
    # How it names blocks (cache_index/hashing.py BlockNaming): the mode and the key's public id
    # (empty for xxh3). A registration that says nothing (an older worker) means xxh3.
    block_hash: str = XXH3
    block_hash_key_id: str = ""
    # Why the index holds less of its cache than it has ("" = it holds it all): an engine whose
    # events were lost past replay (cache_index/engine_feed.py).
    degraded: str = ""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.block_hash not in HASH_MODES:
            raise ValueError(
                f"block_hash must be one of {', '.join(HASH_MODES)}, got {self.block_hash!r}"
            )
        if (self.block_hash == XXH3) != (not self.block_hash_key_id):
            raise ValueError(
                "block_hash_key_id names the key of a keyed block hash: set it with "
                f"blake2b-keyed, and only then (block_hash {self.block_hash!r})"
            )
        if self.role not in ROLES and self.role != TIER_ROLE:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")

    def describe_block_hash(self) -> str:
        """``xxh3`` or ``blake2b-keyed (key <key id>)``, as ``BlockNaming.describe`` says it."""
        if not self.block_hash_key_id:
            return self.block_hash
        return f"{self.block_hash} (key {self.block_hash_key_id})"

    def names_blocks_as(self, naming: BlockNaming) -> bool:
        """Whether this worker's block names are ``naming``'s: same mode, same key."""
        return (self.block_hash, self.block_hash_key_id) == (naming.mode, naming.key_id)


class ApplyStatus(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # this batch (or a later one) was applied before: nothing changed
    NEEDS_RESYNC = "needs_resync"  # a batch is missing: send a Snapshot through resync()
    UNKNOWN_WORKER = "unknown_worker"  # not registered, or its registration lapsed: register


@dataclass(frozen=True, slots=True)
class IndexStats:
    num_workers: int  # live workers
    num_entries: int  # (worker, block hash) pairs held, over live workers
    memory_bytes: int  # the backend's own estimate of what its entries take


class BlockIndex(ABC):
    """The interface every backend implements. All methods are coroutines.

    ``unavailable_errors`` are what a backend raises when it cannot be reached (refused, timed
    out, restarting): a caller may retry those later or go on without the index. Anything else
    is a bug, to be let through or logged with its traceback.
    """

    unavailable_errors: ClassVar[tuple[type[Exception], ...]] = (OSError,)

    @abstractmethod
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """Register (or re-register) a worker, live for ``ttl_s`` unless it heartbeats. A worker
        that registers again, e.g. after a restart, starts empty: its old entries are gone."""

    @abstractmethod
    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        """Extend a worker's life by ``ttl_s``; False if it is unknown or already lapsed (it
        must register again, then resync)."""

    @abstractmethod
    async def deregister(self, worker_id: str) -> None:
        """Remove a worker and its entries; unknown workers are ignored."""

    @abstractmethod
    async def live_workers(self, namespace: str | None = None) -> list[WorkerInfo]:
        """Registered workers whose heartbeat has not lapsed, optionally of one namespace,
        sorted by worker id."""

    @abstractmethod
    async def apply(self, worker_id: str, seq: int, events: Sequence[CacheEvent]) -> ApplyStatus:
        """Apply one batch of a worker's cache events, in order (see the module docstring)."""

    @abstractmethod
    async def resync(self, worker_id: str, seq: int, block_hashes: Iterable[bytes]) -> None:
        """Replace a worker's entries, all at once, with a snapshot consistent with batch
        ``seq``; later batches continue from ``seq + 1``. The worker is trusted again."""

    @abstractmethod
    async def match(self, namespace: str, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """For each live, trusted worker of ``namespace``: how many leading blocks of the chain
        ``block_hashes`` it holds (stopping at its first miss; 0 included)."""

    @abstractmethod
    async def worker_block_hashes(self, worker_id: str) -> set[bytes]:
        """Every hash the index holds for a worker (empty if it holds none or is unknown); for
        audits, not for the request path."""

    @abstractmethod
    async def stats(self) -> IndexStats: ...

    @abstractmethod
    async def reclaim_expired(self) -> int:
        """Delete the entries of workers whose heartbeat lapsed; returns how many workers."""

    async def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing)
        """Release connections; the default has none."""


def check_seq(seq: int) -> None:
    if seq <= 0:
        raise ValueError(f"event batch sequence numbers start at 1, got {seq}")


async def reclaim_forever(index: BlockIndex, interval_s: float) -> None:
    """Every ``interval_s``, delete the entries of workers whose heartbeat lapsed; runs until
    cancelled. Lapsed workers are out of ``match`` at once; this only frees their memory."""
    if interval_s <= 0:
        raise ValueError(f"interval_s must be positive, got {interval_s}")
    while True:
        await asyncio.sleep(interval_s)
        try:
            num_reclaimed = await index.reclaim_expired()
        except index.unavailable_errors as e:  # it may be restarting: try again next time
            end_if_cancelled()  # unless the error was this loop's own stop, swallowed
            logger.warning("reclaiming lapsed workers failed: %s", e)
            continue
        except Exception:
            # NOTE: a bug in one round must not end the loop, or lapsed entries pile up unseen.
            end_if_cancelled()
            logger.exception("reclaiming lapsed workers failed; trying again in %g s", interval_s)
            continue
        if num_reclaimed:
            logger.info("reclaimed the entries of %d lapsed workers", num_reclaimed)
