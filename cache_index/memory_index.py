"""The embedded block-hash index: in-process, the single-node default."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvswitch.cache_index.events import CacheEvent, replay
from kvswitch.cache_index.hashing import HASH_BYTES
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, IndexStats, WorkerInfo, check_seq

_BYTES_PER_HASH_OBJECT = sys.getsizeof(b"\x00" * HASH_BYTES)


@dataclass(slots=True)
class _WorkerEntry:
    info: WorkerInfo
    expires_at: float
    last_seq: int = 0
    trusted: bool = True
    block_hashes: set[bytes] = field(default_factory=set)


class MemoryIndex(BlockIndex):
    """Everything in one dict; ``clock`` (seconds, monotonic) is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._workers: dict[str, _WorkerEntry] = {}

    def _live(self, worker_id: str) -> _WorkerEntry | None:
        entry = self._workers.get(worker_id)
        if entry is None or entry.expires_at <= self._clock():
            return None
        return entry

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        _check_ttl(ttl_s)
        self._workers[info.worker_id] = _WorkerEntry(info, self._clock() + ttl_s)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        _check_ttl(ttl_s)
        entry = self._live(worker_id)
        if entry is None:
            return False
        entry.expires_at = self._clock() + ttl_s
        return True

    async def deregister(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    async def live_workers(self, namespace: str | None = None) -> list[WorkerInfo]:
        now = self._clock()
        return sorted(
            (
                e.info
                for e in self._workers.values()
                if e.expires_at > now and (namespace is None or e.info.namespace == namespace)
            ),
            key=lambda info: info.worker_id,
        )

    async def apply(self, worker_id: str, seq: int, events: Sequence[CacheEvent]) -> ApplyStatus:
        check_seq(seq)
        entry = self._live(worker_id)
        if entry is None:
            return ApplyStatus.UNKNOWN_WORKER
        if seq <= entry.last_seq:
            return ApplyStatus.DUPLICATE
        if seq > entry.last_seq + 1 or not entry.trusted:
            entry.trusted = False
            return ApplyStatus.NEEDS_RESYNC
        replay(list(events), entry.block_hashes)
        entry.last_seq = seq
        return ApplyStatus.APPLIED

    async def resync(self, worker_id: str, seq: int, block_hashes: Iterable[bytes]) -> None:
        if seq < 0:
            raise ValueError(f"a snapshot's sequence number must be >= 0, got {seq}")
        entry = self._live(worker_id)
        if entry is None:
            raise KeyError(f"worker {worker_id!r} is not registered (or its registration lapsed)")
        entry.block_hashes = set(block_hashes)
        entry.last_seq = seq
        entry.trusted = True

    async def match(self, namespace: str, block_hashes: Sequence[bytes]) -> dict[str, int]:
        now = self._clock()
        result: dict[str, int] = {}
        for worker_id, entry in self._workers.items():
            if entry.expires_at <= now or not entry.trusted or entry.info.namespace != namespace:
                continue
            held = entry.block_hashes
            num_matched = 0
            for block_hash in block_hashes:
                if block_hash not in held:
                    break
                num_matched += 1
            result[worker_id] = num_matched
        return result

    async def worker_block_hashes(self, worker_id: str) -> set[bytes]:
        entry = self._live(worker_id)
        return set(entry.block_hashes) if entry else set()

    async def stats(self) -> IndexStats:
        now = self._clock()
        live = [e for e in self._workers.values() if e.expires_at > now]
        num_entries = sum(len(e.block_hashes) for e in live)
        memory = sum(sys.getsizeof(e.block_hashes) for e in live)
        return IndexStats(len(live), num_entries, memory + num_entries * _BYTES_PER_HASH_OBJECT)

    async def reclaim_expired(self) -> int:
        now = self._clock()
        expired = [w for w, e in self._workers.items() if e.expires_at <= now]
        for worker_id in expired:
            del self._workers[worker_id]
        return len(expired)


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
