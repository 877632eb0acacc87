"""The router's guesses of which blocks a worker is about to hold.

A worker reports a block only after computing it, and the report reaches the index some
milliseconds later. A burst of requests on one long document would see nothing cached in that
window and scatter. So after routing, the router guesses that the chosen worker will soon hold
the prompt's full blocks, and counts the guess as a match until the index confirms it (the
guess is then dropped: the index now says so) or until ``ttl_s`` passes unconfirmed (dropped as
wrong: the request may have failed, or its blocks were evicted at once).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class _Guess:
    worker_id: str
    block_hashes: tuple[bytes, ...]
    expires_s: float
    live: bool = True


class PendingBlocks:
    """Guesses per worker, each one a chain prefix with a deadline. No I/O.

    Only guesses that share a lookup's first block can add to its matches, so guesses are
    filed by their first block; every guess has the same lifetime, so a queue in arrival order
    is also a queue in deadline order.
    """

    def __init__(self, ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_first_block: dict[bytes, list[_Guess]] = {}
        self._by_deadline: deque[_Guess] = deque()
        self._by_chain_end: dict[tuple[str, bytes], _Guess] = {}
        self.num_confirmed = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return sum(len(guesses) for guesses in self._by_first_block.values())

    def add(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """``worker_id`` will soon hold the chain ``block_hashes`` (full blocks only)."""
        if not block_hashes:
            return
        # NOTE: the last hash names the whole chain; a repeated guess replaces the old one, so a
        # burst on one document keeps one guess per worker, with the latest deadline.
        key = (worker_id, block_hashes[-1])
        old = self._by_chain_end.get(key)
        if old is not None and old.live:
            self._drop(old)
        guess = _Guess(worker_id, tuple(block_hashes), self._clock() + self.ttl_s)
        self._by_first_block.setdefault(guess.block_hashes[0], []).append(guess)
        self._by_deadline.append(guess)
        self._by_chain_end[key] = guess

    def match(
        self, block_hashes: Sequence[bytes], index_matches: Mapping[str, int]
    ) -> dict[str, int]:
        """Per worker, the leading blocks of ``block_hashes`` it holds or is guessed to hold
        soon: the index's count, raised by any live guess. Guesses the index now confirms
        (it reports at least the guessed chain) and guesses past their deadline are dropped."""
        self._expire()
        matches = dict(index_matches)
        if not block_hashes:
            return matches
        for guess in list(self._by_first_block.get(block_hashes[0], ())):
            num_shared = _num_shared(guess.block_hashes, block_hashes)
            num_indexed = index_matches.get(guess.worker_id, 0)
            if num_shared == len(guess.block_hashes) and num_indexed >= num_shared:
                self.num_confirmed += 1
                self._drop(guess)
            elif num_shared > matches.get(guess.worker_id, 0):
                matches[guess.worker_id] = num_shared
        return matches

    def forget_worker(self, worker_id: str) -> None:
        """Drop every guess about a worker (it failed or left)."""
        for guess in list(self._by_deadline):
            if guess.worker_id == worker_id and guess.live:
                self._drop(guess)

    def _expire(self) -> None:
        now = self._clock()
        while self._by_deadline and self._by_deadline[0].expires_s <= now:
            guess = self._by_deadline.popleft()
            if guess.live:
                self.num_expired += 1
                self._drop(guess)

    def _drop(self, guess: _Guess) -> None:
        # NOTE: the deadline queue keeps dropped guesses until their deadline; `live` tells.
        guess.live = False
        key = (guess.worker_id, guess.block_hashes[-1])
        if self._by_chain_end.get(key) is guess:
            del self._by_chain_end[key]
        first = guess.block_hashes[0]
        guesses = self._by_first_block[first]
        guesses.remove(guess)
        if not guesses:
            del self._by_first_block[first]


def _num_shared(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Length of the common leading run of two chains: chained hashes that differ once differ
    ever after, so the first mismatch ends it."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
