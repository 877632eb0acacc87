"""Steady greedy load through the client SDK, every answer checked token for token.

``CheckedLoad`` keeps ``concurrency`` requests running against a router: a closed loop over a
fixed pool of prompts (documents, each asked several questions, so that the cache and the index
matter). Each prompt's answer is taken once, one request at a time on the quiet fleet, before the
load starts (``take_references``); from then on greedy decoding must give exactly those tokens
however the request was served (failed over, resumed mid-stream, retried). Each request leaves one
``Outcome``::

    completed, exact       the streamed tokens are the reference's: none lost, none repeated
    completed, not exact   a token was lost, repeated or changed on the way
    failed                 the status code and message the client got

``tally`` counts a list of outcomes; ``clear_status`` says whether a failure tells the client
what happened (a status that names the cause, with a message).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvswitch.client import Client, KvswitchError

# The statuses that say what happened: the fleet cannot serve now, or the deadline passed.
CLEAR_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})
MAX_MESSAGES_PER_CODE = 3  # distinct failure messages kept per status code
# A thread whose request failed waits this long before its next one, as a client would: a
# fleet that fails requests at once would otherwise see thousands a second from the loop.
PAUSE_AFTER_FAILURE_S = 0.1


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request went, as the client saw it. Times are ``time.monotonic()``."""

    prompt_index: int
    request_id: str  # as the logs of the router and the workers name it
    sent_s: float
    done_s: float
    num_tokens: int  # tokens streamed to the client
    exact: bool  # streamed tokens and the final result are the reference's
    worker_id: str = ""  # the worker that finished it
    route_reason: str = ""  # starts with "failover" when a worker failed it
    max_gap_s: float = 0.0  # the longest wait for a message (the first one included)
    max_gap_from_s: float = 0.0  # when that wait began
    code: str = ""  # the status code's name, when it failed
    details: str = ""  # the failure's message

    @property
    def failed(self) -> bool:
        return bool(self.code)


def clear_status(outcome: Outcome) -> bool:
    """A failure the client can act on: a status that names the cause, and a message."""
    return outcome.code in CLEAR_CODES and bool(outcome.details.strip())


def tally(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The counts of ``outcomes``: completed, exact, failed by status code (with up to three
    distinct messages each, and the ids of up to three such requests), failed over."""
    failures: dict[str, list[str]] = {}
    failed_ids: dict[str, list[str]] = {}
    for outcome in outcomes:
        if outcome.failed:
            messages = failures.setdefault(outcome.code, [])
            if outcome.details not in messages and len(messages) < MAX_MESSAGES_PER_CODE:
                messages.append(outcome.details)
            request_ids = failed_ids.setdefault(outcome.code, [])
            if len(request_ids) < MAX_MESSAGES_PER_CODE:
                request_ids.append(outcome.request_id)
    completed = [o for o in outcomes if not o.failed]
    codes = Counter(o.code for o in outcomes if o.failed)
    return {
        "num_requests": len(outcomes),
        "num_completed": len(completed),
        "num_exact": sum(o.exact for o in completed),
        "num_not_exact": sum(not o.exact for o in completed),
        "num_failed": sum(codes.values()),
        # after tokens had reached the client: the SDK does not retry these (it would repeat them)
        "num_failed_mid_stream": sum(o.failed and o.num_tokens > 0 for o in outcomes),
        "num_failed_unclear": sum(o.failed and not clear_status(o) for o in outcomes),
        "num_failed_over": sum(o.route_reason.startswith("failover") for o in completed),
        "failed_by_code": {
            code: {"count": count, "messages": failures[code], "request_ids": failed_ids[code]}
            for code, count in sorted(codes.items())
        },
    }


def make_prompts(
    *,
    num_documents: int = 4,
    document_tokens: int = 256,
    questions_per_document: int = 6,
    question_tokens: int = 32,
    vocab_size: int = 256,
    seed: int = 0,
) -> list[list[int]]:
    """Documents, each followed by questions of its own: prompts that share prefixes."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab_size) for _ in range(n)]

    documents = [tokens(document_tokens) for _ in range(num_documents)]
    return [
        [*document, *tokens(question_tokens)]
        for _ in range(questions_per_document)
        for document in documents
    ]


class CheckedLoad:
    """A closed loop of ``concurrency`` greedy requests over ``prompts``, through one ``Client``.

    ``start`` / ``stop`` the loop; ``pause`` lets the running requests finish and sends no more
    until ``resume`` (the fleet is then quiet: its caches and index can be checked). The client
    retries a request that failed before its first token up to ``max_retries`` times.
    """

    def __init__(
        self,
        target: str,
        prompts: Sequence[Sequence[int]],
        *,
        concurrency: int = 4,
        max_tokens: int = 128,
        timeout_s: float = 10.0,
        # NOTE: retries back off with full jitter (capped at 1 s) and never past timeout_s; ten
        # could all be spent in under 2 s, less than a router takes to restart on a busy machine.
        max_retries: int = 30,
        seed: int = 0,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.prompts = [list(p) for p in prompts]
        self.references: list[list[int]] = []
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self._client = Client(target, timeout_s=timeout_s, max_retries=max_retries)
        self._concurrency = concurrency
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._outcomes: list[Outcome] = []
        self._running = 0  # requests in flight
        self._idle = threading.Condition(self._lock)
        self._go = threading.Event()  # clear while paused
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- references --------------------------------------------------------------------------

    def take_references(self) -> None:
        """Each prompt's answer, one request at a time on the quiet fleet."""
        self.references = []
        for prompt in self.prompts:
            result = self._client.generate(prompt_token_ids=prompt, max_tokens=self.max_tokens)
            self.references.append(list(result.token_ids))

    # -- the loop ------------------------------------------------------------------------------

    def start(self) -> None:
        if not self.references:
            raise RuntimeError("take_references() first: nothing to check answers against")
        self._go.set()
        self._threads = [
            threading.Thread(target=self._loop, name=f"load-{i}", daemon=True)
            for i in range(self._concurrency)
        ]
        for thread in self._threads:
            thread.start()

    def pause(self, timeout_s: float = 60.0) -> None:
        """Send nothing new, and return once the requests in flight have ended."""
        self._go.clear()
        with self._idle:
            if not self._idle.wait_for(lambda: self._running == 0, timeout_s):
                raise TimeoutError(f"{self._running} requests still running after {timeout_s} s")

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        """Let the requests in flight end, then stop the loop and close the client."""
        self._stopping.set()
        self._go.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._client.close()

    def outcomes(self, since_s: float = 0.0) -> list[Outcome]:
        """The requests that ended at or after ``since_s`` (``time.monotonic()``)."""
        with self._lock:
            return [o for o in self._outcomes if o.done_s >= since_s]

    def _loop(self) -> None:
        while True:
            self._go.wait()
            if self._stopping.is_set():
                return
            with self._lock:
                if not self._go.is_set():
                    continue  # paused between the wait and here
                self._running += 1
                index = self._rng.randrange(len(self.prompts))
            try:
                outcome = self._send(index)
            finally:
                with self._idle:
                    self._running -= 1
                    self._idle.notify_all()
            with self._lock:
                self._outcomes.append(outcome)
            if outcome.failed:
                self._stopping.wait(PAUSE_AFTER_FAILURE_S)

    def _send(self, index: int) -> Outcome:
        tokens: list[int] = []
        request_id = uuid.uuid4().hex
        sent_s = last_s = time.monotonic()
        max_gap_s, max_gap_from_s = 0.0, sent_s

        def failed(code: str, details: str) -> Outcome:
            return Outcome(
                index, request_id, sent_s, time.monotonic(), len(tokens), False,
                max_gap_s=max_gap_s, max_gap_from_s=max_gap_from_s, code=code, details=details,
            )  # fmt: skip

        try:
            stream = self._client.stream(
                prompt_token_ids=self.prompts[index],
                max_tokens=self.max_tokens,
                request_id=request_id,
                timeout_s=self.timeout_s,  # read per request: a test may change it under way
            )
            with stream:
                for chunk in stream:
                    now_s = time.monotonic()
                    if now_s - last_s > max_gap_s:
                        max_gap_s, max_gap_from_s = now_s - last_s, last_s
                    last_s = now_s
                    tokens += chunk.token_ids
                result = stream.result
        except KvswitchError as e:
            return failed(e.code.name, e.details)
        except grpc.RpcError as e:  # not expected: the SDK turns these into KvswitchError
            return failed(f"RPC_{e.code().name}", str(e))  # type: ignore[attr-defined]
        reference = self.references[index]
        return Outcome(
            index,
            request_id,
            sent_s,
            time.monotonic(),
            len(tokens),
            exact=tokens == reference and list(result.token_ids) == reference,
            worker_id=result.stats.worker_id,
            route_reason=result.route.reason,
            max_gap_s=max_gap_s,
            max_gap_from_s=max_gap_from_s,
        )
