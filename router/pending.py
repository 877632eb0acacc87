"""The router's guesses of which blocks a worker is about to hold.

A worker reports a block only after computing it, and the report reaches the index some
milliseconds later. A burst of requests on one long document would see nothing cached in that
window and scatter. So after routing, the router guesses that the chosen worker will soon hold
the prompt's full blocks, and counts the guess as a match until the index confirms it (the
guess is then dropped: the index now says so) or until ``ttl_s`` passes unconfirmed (dropped as
wrong: the request may have failed, or its blocks were evicted at once). A guess whose request
will not run there after all (the worker refused it, or it never reached the worker) is taken
back at once (``discard``).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Guess:
    worker_id: str
    block_hashes: tuple[bytes, ...]
    expires_s: float
    num_requests: int = 1  # the routed requests behind it (a repeated guess adds its own)
    live: bool = True


@dataclass(slots=True, eq=False)
class _WorkerGuesses:
    """One worker's live guesses, and how many of them hold each block.

    A block is held while more of the guesses holding it were added than dropped. Both counts
    take a whole chain at once (``Counter.update`` counts in C, not a Python step a block); the
    dropped counts are folded away once they outweigh the live ones, so that they never hold
    more entries than the live guesses do.
    """

    by_end: dict[bytes, _Guess] = field(default_factory=dict)  # by the chain's last hash
    _num_added: Counter[bytes] = field(default_factory=Counter)
    _num_dropped: Counter[bytes] = field(default_factory=Counter)
    _num_live_entries: int = 0  # blocks over the live guesses
    _num_dropped_entries: int = 0  # blocks over the guesses dropped since the last fold

    def holds(self, block_hash: bytes) -> bool:
        return self._num_added.get(block_hash, 0) > self._num_dropped.get(block_hash, 0)

    def num_leading(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain ``block_hashes`` some guess holds."""
        if not block_hashes or not self.holds(block_hashes[0]):
            return 0  # the common case for a worker: none of this prompt
        # NOTE: a guess holding block i holds blocks 0..i too (a chained hash names its whole
        # prefix), so the held blocks lead the chain and a binary search finds where they end.
        return bisect.bisect_left(block_hashes, True, key=lambda h: not self.holds(h))

    def add(self, guess: _Guess) -> None:
        self.by_end[guess.block_hashes[-1]] = guess
        self._num_added.update(guess.block_hashes)
        self._num_live_entries += len(guess.block_hashes)

    def drop(self, guess: _Guess) -> None:
        del self.by_end[guess.block_hashes[-1]]
        self._num_live_entries -= len(guess.block_hashes)
        self._num_dropped_entries += len(guess.block_hashes)
        if self._num_dropped_entries <= self._num_live_entries:
            self._num_dropped.update(guess.block_hashes)
            return
        # NOTE: recounting the live guesses costs no more than the drops since the last time.
        self._num_added = Counter()
        for live in self.by_end.values():
            self._num_added.update(live.block_hashes)
        self._num_dropped.clear()
        self._num_dropped_entries = 0


class PendingBlocks:
    """Guesses per worker, each one a chain prefix with a deadline. No I/O.

    A chained hash names its whole prefix, so a guess that holds block ``i`` of a lookup holds
    blocks ``0..i`` too: the blocks of a lookup a worker is guessed to hold lead its chain, and a
    binary search over the chain finds how many, however many guesses are live. Every guess has
    the same lifetime, so a queue in arrival order is also a queue in deadline order.
    """

    def __init__(self, ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._workers: dict[str, _WorkerGuesses] = {}  # those with a live guess
        self._by_deadline: deque[_Guess] = deque()
        self._num_live = 0
        self.num_confirmed = 0
        self.num_expired = 0
        # Told of each guess the index confirms: its worker and its chain's last hash (router
        # replicas drop their copy, router/replicas.py).
        self.on_confirm: Callable[[str, bytes], None] | None = None

    def __len__(self) -> int:
        return self._num_live

    def add(
        self, worker_id: str, block_hashes: Sequence[bytes], ttl_s: float | None = None
    ) -> None:
        """``worker_id`` will soon hold the chain ``block_hashes`` (full blocks only), for
        ``ttl_s`` (default: this table's) unless confirmed first."""
        if not block_hashes:
            return
        # NOTE: the last hash names the whole chain; a repeated guess replaces the old one, so a
        # burst on one document keeps one guess per worker, with the latest deadline.
        guesses = self._workers.get(worker_id)
        old = guesses.by_end.get(block_hashes[-1]) if guesses is not None else None
        num_requests = 1
        if old is not None:
            num_requests += old.num_requests
            self._drop(old)
        guesses = self._workers.get(worker_id)
        if guesses is None:
            guesses = self._workers[worker_id] = _WorkerGuesses()
        expires_s = self._clock() + (self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s))
        guess = _Guess(worker_id, tuple(block_hashes), expires_s, num_requests)
        guesses.add(guess)
        if ttl_s is None or not self._by_deadline or self._by_deadline[-1].expires_s <= expires_s:
            self._by_deadline.append(guess)
        else:
            # NOTE: a shorter lifetime (a guess handed over by another router, some of its
            # lifetime spent) goes where its deadline falls: the queue stays in deadline order.
            bisect.insort(self._by_deadline, guess, key=lambda g: g.expires_s)
        self._num_live += 1

    def match(
        self, block_hashes: Sequence[bytes], index_matches: Mapping[str, int]
    ) -> dict[str, int]:
        """Per worker, the leading blocks of ``block_hashes`` it holds or is guessed to hold
        soon: the index's count, raised by any live guess. Guesses the index now confirms
        (it reports at least the guessed chain) and guesses past their deadline are dropped."""
        self._expire()
        matches = dict(index_matches)
        confirmed: list[_Guess] = []
        for worker_id, guesses in self._workers.items():
            num_guessed = guesses.num_leading(block_hashes)
            if num_guessed > matches.get(worker_id, 0):
                matches[worker_id] = num_guessed
            # A guess that ends within both the guessed run and what the index reports is a
            # prefix of this chain the index now holds: confirmed.
            num_confirmed = min(num_guessed, index_matches.get(worker_id, 0))
            if num_confirmed:
                ends = guesses.by_end.keys() & block_hashes[:num_confirmed]  # in C
                confirmed += (guesses.by_end[end] for end in ends)
        for guess in confirmed:
            self.num_confirmed += 1
            self._drop(guess)
            if self.on_confirm is not None:
                self.on_confirm(guess.worker_id, guess.block_hashes[-1])
        return matches

    def confirmed(self, worker_id: str, last_hash: bytes) -> None:
        """Another router's index lookup confirmed its copy of the guess that ``worker_id``
        holds the chain ending in ``last_hash``: drop this one too, if it is still here."""
        guesses = self._workers.get(worker_id)
        guess = guesses.by_end.get(last_hash) if guesses is not None else None
        if guess is not None:
            self.num_confirmed += 1
            self._drop(guess)

    def discard(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """Take back one ``add(worker_id, block_hashes)``: its request will not make the worker
        hold the chain after all (refused there, or never sent). The guess goes once no other
        request routed there with the same chain stands behind it; one already confirmed,
        expired or forgotten is left as it is."""
        if not block_hashes:
            return
        guesses = self._workers.get(worker_id)
        guess = guesses.by_end.get(block_hashes[-1]) if guesses is not None else None
        if guess is None:
            return
        guess.num_requests -= 1
        if guess.num_requests <= 0:
            self._drop(guess)

    def live(self) -> Iterator[tuple[str, tuple[bytes, ...], float]]:
        """Every live guess: its worker, its chain and the seconds it has left."""
        self._expire()
        now = self._clock()
        for worker_id, guesses in self._workers.items():
            for guess in guesses.by_end.values():
                yield worker_id, guess.block_hashes, guess.expires_s - now

    def forget_worker(self, worker_id: str) -> None:
        """Drop every guess about a worker (it failed or left)."""
        guesses = self._workers.pop(worker_id, None)
        if guesses is None:
            return
        for guess in guesses.by_end.values():
            guess.live = False
        self._num_live -= len(guesses.by_end)

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
        self._num_live -= 1
        guesses = self._workers[guess.worker_id]
        guesses.drop(guess)
        if not guesses.by_end:
            del self._workers[guess.worker_id]
