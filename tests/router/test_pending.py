"""The router's guesses of soon-cached blocks: counted as matches until confirmed or expired."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvswitch.router.pending import PendingBlocks


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def chain(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode().ljust(16, b".") for i in range(n)]


DOC = chain("doc", 8)
QUESTION = [*DOC, *chain("q", 2)]  # the document, then two blocks of its own


def test_a_guess_counts_until_its_deadline() -> None:
    clock = Clock()
    pending = PendingBlocks(ttl_s=2.0, clock=clock)
    pending.add("w1", DOC)
    assert pending.match(QUESTION, {"w0": 0, "w1": 0}) == {"w0": 0, "w1": 8}
    # A longer index match is kept; a shorter one is raised to the guess.
    assert pending.match(QUESTION, {"w1": 3, "w2": 5}) == {"w1": 8, "w2": 5}
    clock.now_s = 2.0
    assert pending.match(QUESTION, {"w1": 3}) == {"w1": 3}
    assert (pending.num_expired, pending.num_confirmed, len(pending)) == (1, 0, 0)


def test_a_guess_the_index_confirms_is_dropped() -> None:
    pending = PendingBlocks(clock=Clock())
    pending.add("w1", DOC)
    assert pending.match(QUESTION, {"w1": 8}) == {"w1": 8}
    assert (pending.num_confirmed, len(pending)) == (1, 0)


def test_only_the_shared_leading_run_counts() -> None:
    pending = PendingBlocks(clock=Clock())
    pending.add("w1", QUESTION)
    other_question = [*DOC, *chain("other", 3)]
    assert pending.match(other_question, {}) == {"w1": 8}
    assert pending.match(chain("unrelated", 4), {}) == {}
    # A lookup that diverges cannot confirm the guess: it stays.
    assert pending.match(other_question, {"w1": 8}) == {"w1": 8}
    assert len(pending) == 1


def test_a_repeated_guess_replaces_the_old_one_and_renews_it() -> None:
    clock = Clock()
    pending = PendingBlocks(ttl_s=2.0, clock=clock)
    pending.add("w1", DOC)
    clock.now_s = 1.5
    pending.add("w1", DOC)
    pending.add("w2", DOC)
    assert len(pending) == 2
    clock.now_s = 3.0  # past the first deadline, not the second
    assert pending.match(QUESTION, {}) == {"w1": 8, "w2": 8}
    assert pending.num_expired == 0


def test_a_discarded_guess_goes_once_no_request_stands_behind_it() -> None:
    pending = PendingBlocks(clock=Clock())
    pending.add("w1", DOC)
    pending.add("w1", DOC)  # a second request on the same document, the same worker
    pending.add("w1", QUESTION)
    pending.add("w2", DOC)
    pending.discard("w1", DOC)  # one of the two was refused: the other still stands
    assert pending.match(DOC, {}) == {"w1": 8, "w2": 8}
    pending.discard("w1", DOC)
    pending.discard("w2", chain("never", 3))  # never guessed: nothing changes
    pending.discard("w3", DOC)
    # The question's own guess still holds the document: its blocks lead its chain.
    assert pending.match(QUESTION, {}) == {"w1": 10, "w2": 8}
    pending.discard("w1", QUESTION)
    assert pending.match(QUESTION, {}) == {"w2": 8}
    assert (len(pending), pending.num_expired, pending.num_confirmed) == (1, 0, 0)


def test_forgetting_a_worker_drops_its_guesses() -> None:
    pending = PendingBlocks(clock=Clock())
    pending.add("w1", DOC)
    pending.add("w2", QUESTION)
    pending.forget_worker("w1")
    assert pending.match(QUESTION, {}) == {"w2": 10}


def test_the_counts_of_dropped_guesses_do_not_pile_up() -> None:
    """A document asked for again and again is guessed, then confirmed, each time, while a longer
    guess on it stays live: what the dropped guesses held is folded away, not kept."""
    pending = PendingBlocks(clock=Clock())
    pending.add("w1", QUESTION)
    for _ in range(100):
        pending.add("w1", DOC)
        assert pending.match(DOC, {"w1": 8}) == {"w1": 8}  # confirms DOC, not QUESTION
    assert (pending.num_confirmed, len(pending)) == (100, 1)
    assert pending.match(QUESTION, {}) == {"w1": 10}
    guesses = pending._workers["w1"]
    assert len(guesses._num_dropped) <= len(QUESTION)
    assert sum(guesses._num_added.values()) <= 2 * len(QUESTION)


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        PendingBlocks(ttl_s=0)


def chained(tokens: list[int]) -> list[bytes]:
    """Hashes that name their whole prefix, as block hashes do."""
    hashes, parent = [], b""
    for token in tokens:
        parent = hashlib.sha256(parent + bytes([token])).digest()[:16]
        hashes.append(parent)
    return hashes


def test_the_one_walk_agrees_with_comparing_every_guess() -> None:
    """Random chains over a 3-token alphabet share prefixes often; the reference compares each
    live guess with the lookup, as the documented semantics say."""
    rng = random.Random(7)
    clock = Clock()
    pending = PendingBlocks(ttl_s=2.0, clock=clock)
    guesses: dict[tuple[str, bytes], tuple[list[bytes], float]] = {}  # the reference's
    num_lookups = 0
    for _ in range(3000):
        clock.now_s += rng.random() * 0.02
        hashes = chained([rng.randrange(3) for _ in range(rng.randrange(1, 10))])
        if rng.random() < 0.5:
            worker_id = f"w{rng.randrange(4)}"
            pending.add(worker_id, hashes)
            guesses[(worker_id, hashes[-1])] = (hashes, clock.now_s + 2.0)
            continue
        index = {f"w{i}": rng.randrange(len(hashes) + 1) for i in range(4) if rng.random() < 0.6}
        expected = dict(index)
        for key, (guess, expires_s) in list(guesses.items()):
            shared = 0
            while shared < min(len(guess), len(hashes)) and guess[shared] == hashes[shared]:
                shared += 1
            if expires_s <= clock.now_s:
                del guesses[key]
            elif shared == len(guess) and index.get(key[0], 0) >= shared:
                del guesses[key]  # confirmed
            elif shared > expected.get(key[0], 0):
                expected[key[0]] = shared
        assert pending.match(hashes, index) == expected
        assert len(pending) == len(guesses)
        num_lookups += 1
    assert num_lookups > 1000 and pending.num_confirmed > 100 and pending.num_expired > 100
