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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class _Guess:
    worker_id: str
    block_hashes: tuple[bytes, ...]
    expires_s: float
    live: bool = True


class PendingBlocks:
    """Guesses per worker, each one a chain prefix with a deadline. No I/O.

    A chained hash names its whole prefix, so a guess that holds block ``i`` of a lookup holds
    blocks ``0..i`` too: the workers guessed to hold block ``i + 1`` are a subset of those for
    block ``i``. An inverted map from block hash to the workers guessed to hold it (with a count
    of their guesses) therefore answers a lookup in one walk down its chain, however many guesses
    are live. Every guess has the same lifetime, so a queue in arrival order is also a queue in
    deadline order.
    """

    def __init__(self, ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._hash_to_workers: dict[bytes, dict[str, int]] = {}  # -> live guesses holding it
        self._chain_end_to_guesses: dict[bytes, dict[str, _Guess]] = {}  # by worker id
        self._by_deadline: deque[_Guess] = deque()
        self._num_live = 0
        self.num_confirmed = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return self._num_live

    def add(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """``worker_id`` will soon hold the chain ``block_hashes`` (full blocks only)."""
        if not block_hashes:
            return
        # NOTE: the last hash names the whole chain; a repeated guess replaces the old one, so a
        # burst on one document keeps one guess per worker, with the latest deadline.
        old = self._chain_end_to_guesses.get(block_hashes[-1], {}).get(worker_id)
        if old is not None:
            self._drop(old)
        guess = _Guess(worker_id, tuple(block_hashes), self._clock() + self.ttl_s)
        hash_to_workers = self._hash_to_workers
        for block_hash in guess.block_hashes:
            workers = hash_to_workers.get(block_hash)
            if workers is None:
                hash_to_workers[block_hash] = {worker_id: 1}
            else:
                workers[worker_id] = workers.get(worker_id, 0) + 1
        self._chain_end_to_guesses.setdefault(block_hashes[-1], {})[worker_id] = guess
        self._by_deadline.append(guess)
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
        get_workers = self._hash_to_workers.get
        get_ends = self._chain_end_to_guesses.get
        workers: dict[str, int] = {}  # guessed to hold every block so far
        num_walked = 0
        for block_hash in block_hashes:
            holders = get_workers(block_hash)
            if holders is None:
                break
            if len(holders) < len(workers):
                # The set only shrinks down the chain: those that left it stop here.
                self._raise(matches, (w for w in workers if w not in holders), num_walked)
            workers = holders
            num_walked += 1
            ends = get_ends(block_hash)
            if ends:
                confirmed += (g for w, g in ends.items() if index_matches.get(w, 0) >= num_walked)
        self._raise(matches, workers, num_walked)
        for guess in confirmed:
            self.num_confirmed += 1
            self._drop(guess)
        return matches

    def forget_worker(self, worker_id: str) -> None:
        """Drop every guess about a worker (it failed or left)."""
        for guess in list(self._by_deadline):
            if guess.worker_id == worker_id and guess.live:
                self._drop(guess)

    @staticmethod
    def _raise(matches: dict[str, int], worker_ids: Iterable[str], num_blocks: int) -> None:
        for worker_id in worker_ids:
            if num_blocks > matches.get(worker_id, 0):
                matches[worker_id] = num_blocks

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
        worker_id = guess.worker_id
        end = guess.block_hashes[-1]
        ends = self._chain_end_to_guesses[end]
        if ends.get(worker_id) is guess:
            del ends[worker_id]
            if not ends:
                del self._chain_end_to_guesses[end]
        hash_to_workers = self._hash_to_workers
        for block_hash in guess.block_hashes:
            workers = hash_to_workers[block_hash]
            if workers[worker_id] == 1:
                del workers[worker_id]
                if not workers:
                    del hash_to_workers[block_hash]
            else:
                workers[worker_id] -= 1
