"""How much of the recent traffic each shared prefix carries, so that a hot one can be spread.

A prefix that a large share of requests open with (a popular system prompt, a much-asked
document) belongs on more than one worker: left to a myopic cost, every request that shares it
goes where it is cached, and its holders queue while the others idle. ``PrefixHeat`` keeps a
decayed count of the requests routed with each prefix, and calls a prefix *hot* when it has been
asked for over at least ``min_age_s`` and its share of the traffic is more than
``replicate_share`` times the share of the workers holding it. A policy may then treat a hot
prefix as if every worker held it: the first request sent to a new worker pays its prefill once,
and the prefix has one more holder from then on. A burst on a new document is not hot yet: its
requests follow the first one's prefill on one worker.

Counting every block of every prompt would cost a dict update per block per request; the counts
are kept at power-of-two depths (blocks 1, 2, 4, 8, ... of the chain), which name their whole
prefix as any block of a chain does::

    chain   | b0 | b1 | b2 | b3 | b4 | b5 | b6 | b7 | b8 | ...
    counted |  1 |  2 |    |  4 |    |    |    |  8 |    |       (depth = blocks up to here)

The same counts tell where a prompt's shared part ends. Each keeps the last block and length of
the longest chain routed with its prefix; a request that does not extend that chain (nor repeat
it) has gone another way after the prefix, which is then *shared*: several conversations, or
documents, open with it. A conversation's turns each extend the last, so its own history stays
on one line and is never shared, however often it is asked for::

    system prompt | turn 1      | turn 2       | ...        one conversation: one line
                  | other conversation's turns | ...        a branch: the system prompt is shared

No I/O; the router records every routed request and asks before it scores.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Count:
    requests: float  # decayed, as of `as_of_s`
    as_of_s: float
    first_s: float  # when the prefix was first counted
    tip: bytes = b""  # the last block of the longest chain routed with this prefix
    num_tip_blocks: int = 0  # and its length
    shared: bool = False  # a routed chain has gone another way than that one

    def follow(self, block_hashes: Sequence[bytes]) -> None:
        """Another chain with this prefix was routed: the longest one yet, or a branch."""
        if self.shared:
            return
        num_blocks = len(block_hashes)
        # NOTE: hashes are chained: equal blocks at one depth mean equal chains up to there.
        if num_blocks < self.num_tip_blocks or block_hashes[self.num_tip_blocks - 1] != self.tip:
            self.shared = True
        else:
            self.tip, self.num_tip_blocks = block_hashes[-1], num_blocks


class PrefixHeat:
    def __init__(
        self,
        time_constant_s: float = 30.0,
        replicate_share: float = 1.5,
        min_requests: float = 3.0,
        min_age_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < time_constant_s < math.inf:
            raise ValueError(f"time_constant_s must be positive, got {time_constant_s}")
        self.time_constant_s = time_constant_s
        self.replicate_share = replicate_share
        self.min_requests = min_requests  # fewer recent requests than this are never hot
        self.min_age_s = min_age_s
        self._clock = clock
        self._counts: dict[bytes, _Count] = {}  # by the hash of a prefix's last block
        self._total = _Count(0.0, clock(), clock())
        self._prune_at = 4096

    def __len__(self) -> int:
        return len(self._counts)

    def record(self, block_hashes: Sequence[bytes], at_s: float | None = None) -> None:
        """A request with this chain was routed (``at_s``: then, by this clock; default now,
        and never before the last record)."""
        now = self._clock() if at_s is None else at_s
        self._bump(self._total, now)
        counts = self._counts
        depth = 1
        while depth <= len(block_hashes):
            count = counts.get(block_hashes[depth - 1])
            if count is None:
                counts[block_hashes[depth - 1]] = _Count(
                    1.0, now, now, block_hashes[-1], len(block_hashes)
                )
            else:
                self._bump(count, now)
                count.follow(block_hashes)
            depth *= 2
        if len(counts) >= self._prune_at:
            self._prune(now)

    def hot_blocks(
        self, block_hashes: Sequence[bytes], matches: Mapping[str, int], num_workers: int
    ) -> int:
        """The deepest counted prefix of ``block_hashes`` that some worker holds (per
        ``matches``: leading blocks per worker) and that is hot; 0 if none is."""
        if not matches or num_workers <= 0:
            return 0
        now = self._clock()
        total = self._decayed(self._total, now)
        deepest = min(max(matches.values()), len(block_hashes))
        depth = 1 << (deepest.bit_length() - 1) if deepest > 0 else 0
        while depth:
            count = self._counts.get(block_hashes[depth - 1])
            if count is not None and now - count.first_s >= self.min_age_s:
                requests = self._decayed(count, now)
                holders = sum(1 for m in matches.values() if m >= depth)
                if requests >= self.min_requests and requests > (
                    self.replicate_share * holders / num_workers * total
                ):
                    return depth
            depth //= 2
        return 0

    def shared_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """The deepest counted prefix of ``block_hashes`` that is shared (routed requests went on
        from it in different ways); 0 if none is. The blocks past it have been routed on one
        line only, or never."""
        depth = 1 << (len(block_hashes).bit_length() - 1) if block_hashes else 0
        while depth:
            count = self._counts.get(block_hashes[depth - 1])
            if count is not None and count.shared:
                return depth
            depth //= 2
        return 0

    def _bump(self, count: _Count, now: float) -> None:
        count.requests = self._decayed(count, now) + 1.0
        count.as_of_s = now

    def _decayed(self, count: _Count, now: float) -> float:
        return count.requests * math.exp(-(now - count.as_of_s) / self.time_constant_s)

    def _prune(self, now: float) -> None:
        # NOTE: under 0.01 requests is a prefix nobody has asked for in ~5 time constants.
        self._counts = {k: c for k, c in self._counts.items() if self._decayed(c, now) >= 0.01}
        self._prune_at = max(4096, 2 * len(self._counts))
