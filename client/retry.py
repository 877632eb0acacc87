"""When to try a request again, and the deadline that bounds all its attempts. No I/O here."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import grpc

from kvswitch.client.errors import KvswitchTimeoutError, error_from_rpc
from kvswitch.serving import retry_after_ms

# Transient failures: the router is unreachable, or it (or every worker) is busy for a moment,
# or it cancelled the call as it stopped (a call arriving as a router shuts down gets CANCELLED
# from its server; one this client cancels itself is never retried: its stream is closed).
# A busy server says how long to wait (``retry-after-ms``); a RESOURCE_EXHAUSTED without that
# is a limit the request broke (a message larger than gRPC takes), and is never retried.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)


class RetryBudget:
    """Retries of overloaded requests (RESOURCE_EXHAUSTED) as a share of the requests that get
    through, shared by every request of a client (gRPC's retry throttling, gRFC A6): such a
    failure spends a token, a request the server answers earns ``ratio`` of one, and those
    retries stop while half the ``max_tokens`` or fewer are left. A client facing an
    overloaded fleet then sends about ``1 + ratio`` attempts per request, not
    ``1 + max_retries``: its retries do not turn overload into a storm."""

    def __init__(self, max_tokens: float = 10.0, ratio: float = 0.1) -> None:
        if not (max_tokens > 0 and 0 < ratio <= max_tokens):
            raise ValueError(
                f"the retry budget needs max_tokens > 0 and ratio in (0, max_tokens], got "
                f"{max_tokens} and {ratio}"
            )
        self.max_tokens = max_tokens
        self.ratio = ratio
        self._tokens = max_tokens
        self._lock = threading.Lock()  # (a sync client is shared between threads)

    @property
    def tokens(self) -> float:
        return self._tokens

    def failed(self) -> bool:
        """Count a failed attempt; whether a retry is still allowed."""
        with self._lock:
            self._tokens = max(self._tokens - 1, 0.0)
            return self._tokens > self.max_tokens / 2

    def answered(self) -> None:
        """Count a request the server answered."""
        with self._lock:
            self._tokens = min(self._tokens + self.ratio, self.max_tokens)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: before retry ``n`` (0-based) the client sleeps a
    uniform random time in ``[0, min(max_backoff_s, initial_backoff_s * 2**n)]``."""

    max_retries: int = 3  # attempts after the first; 0 = never retry
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"backoffs must satisfy 0 <= initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s} and {self.max_backoff_s}"
            )

    def backoff_s(self, num_retries: int) -> float:
        """How long to sleep before the retry that follows ``num_retries`` earlier ones."""
        cap_s = min(self.max_backoff_s, self.initial_backoff_s * 2**num_retries)
        return random.uniform(0.0, cap_s)

    def retry_backoff_s(
        self,
        code: grpc.StatusCode,
        *,
        num_retries: int,
        num_messages: int,
        remaining_s: float | None,
    ) -> float | None:
        """The sleep before trying again after an attempt failed with ``code``, or None to give
        up. Never retries once a message has arrived (a new attempt would repeat its tokens),
        and never sleeps past the deadline (``remaining_s``; None = no deadline)."""
        if code not in RETRYABLE_CODES or num_messages > 0 or num_retries >= self.max_retries:
            return None
        backoff_s = self.backoff_s(num_retries)
        if remaining_s is not None and backoff_s >= remaining_s:
            return None
        return backoff_s


class Attempts:
    """The attempts of one request: the deadline that bounds them all, and the retries so far."""

    def __init__(
        self,
        request_id: str,
        policy: RetryPolicy,
        timeout_s: float | None,
        budget: RetryBudget | None = None,
    ) -> None:
        self.request_id = request_id
        self.policy = policy
        self.budget = budget
        self.num_retries = 0
        self._answered = False
        self._deadline_s = None if timeout_s is None else time.monotonic() + timeout_s

    def timeout_s(self) -> float | None:
        """The time left for the next attempt (None = no deadline); an error if none is left."""
        if self._deadline_s is None:
            return None
        remaining_s = self._deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise KvswitchTimeoutError("the deadline passed between attempts", self.request_id)
        return remaining_s

    def backoff_s(self, error: grpc.RpcError, *, num_messages: int) -> float:
        """The sleep before the next attempt, after one failed with ``error`` having received
        ``num_messages``; raises the error (as a ``KvswitchError``) when it is not retried."""
        remaining_s = None
        if self._deadline_s is not None:
            remaining_s = self._deadline_s - time.monotonic()
        backoff_s = self.policy.retry_backoff_s(
            error.code(),  # type: ignore[attr-defined]
            num_retries=self.num_retries,
            num_messages=num_messages,
            remaining_s=remaining_s,
        )
        # NOTE: only overload spends the budget. An unreachable router (restarting, say) costs
        # nothing to ask again, and is retried up to max_retries with backoff.
        overloaded = error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        retry_after_s = _retry_after_s(error)
        if overloaded and not retry_after_s:
            backoff_s = None  # not load but a limit: the same request would fail the same way
        elif overloaded and self.budget is not None and not self.budget.failed():
            backoff_s = None  # the client's retries are spent: the fleet is overloaded
        if backoff_s is not None:
            backoff_s = max(backoff_s, retry_after_s)
            if remaining_s is not None and backoff_s >= remaining_s:
                backoff_s = None
        if backoff_s is None:
            raise error_from_rpc(error, self.request_id) from error
        self.num_retries += 1
        return backoff_s

    def answered(self) -> None:
        """The server answered (a first message came): the retry budget earns its share."""
        if not self._answered and self.budget is not None:
            self._answered = True
            self.budget.answered()


def _retry_after_s(error: grpc.RpcError) -> float:
    """The wait an overloaded server asked for (0 if none)."""
    trailing = getattr(error, "trailing_metadata", None)
    return retry_after_ms(trailing() if trailing else None) / 1000
