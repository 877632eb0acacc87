"""``RetryPolicy`` and ``Attempts``: what is retried, how long the client waits, the deadline."""

from __future__ import annotations

import grpc
import pytest

from kvswitch.client.errors import KvswitchError, KvswitchTimeoutError
from kvswitch.client.retry import Attempts, RetryBudget, RetryPolicy

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "down") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.5)
    for num_retries, cap_s in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.5), (10, 0.5)]:
        samples = [policy.backoff_s(num_retries) for _ in range(200)]
        assert all(0 <= s <= cap_s for s in samples)
        assert max(samples) > cap_s / 2  # jittered over the whole range


@pytest.mark.parametrize(
    ("code", "num_retries", "num_messages", "remaining_s", "retried"),
    [
        (grpc.StatusCode.UNAVAILABLE, 0, 0, None, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 2, 0, 10.0, True),
        (grpc.StatusCode.UNAVAILABLE, 0, 1, None, False),  # output already arrived
        (grpc.StatusCode.UNAVAILABLE, 3, 0, None, False),  # out of retries
        (grpc.StatusCode.UNAVAILABLE, 0, 0, 0.0, False),  # no time left
        (grpc.StatusCode.INVALID_ARGUMENT, 0, 0, None, False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 0, 0, None, False),
        (grpc.StatusCode.INTERNAL, 0, 0, None, False),
    ],
)
def test_what_is_retried(
    code: grpc.StatusCode,
    num_retries: int,
    num_messages: int,
    remaining_s: float | None,
    retried: bool,
) -> None:
    backoff_s = RetryPolicy(max_retries=3).retry_backoff_s(
        code, num_retries=num_retries, num_messages=num_messages, remaining_s=remaining_s
    )
    assert (backoff_s is not None) == retried


def test_attempts_count_retries_then_raise_the_last_error() -> None:
    attempts = Attempts("r", RetryPolicy(max_retries=2, initial_backoff_s=0.0), timeout_s=None)
    assert attempts.timeout_s() is None
    assert attempts.backoff_s(FakeRpcError(UNAVAILABLE), num_messages=0) == 0.0
    assert attempts.backoff_s(FakeRpcError(UNAVAILABLE), num_messages=0) == 0.0
    with pytest.raises(KvswitchError) as error:
        attempts.backoff_s(FakeRpcError(UNAVAILABLE, "still down"), num_messages=0)
    assert (error.value.code, error.value.details) == (UNAVAILABLE, "still down")
    assert attempts.num_retries == 2


def test_attempts_share_one_deadline() -> None:
    attempts = Attempts("r", RetryPolicy(), timeout_s=10.0)
    timeout_s = attempts.timeout_s()
    assert timeout_s is not None and 9.0 < timeout_s <= 10.0
    expired = Attempts("r", RetryPolicy(), timeout_s=1e-9)
    with pytest.raises(KvswitchTimeoutError) as error:
        expired.timeout_s()
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_deadline_error_from_the_server_is_a_timeout_error() -> None:
    attempts = Attempts("r", RetryPolicy(), timeout_s=None)
    with pytest.raises(KvswitchTimeoutError) as error:
        attempts.backoff_s(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), num_messages=0)
    assert str(error.value) == "request r failed with DEADLINE_EXCEEDED: late"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_retries": -1}, "max_retries must be >= 0, got -1"),
        ({"initial_backoff_s": 2.0}, "backoffs must satisfy 0 <= initial_backoff_s"),
    ],
)
def test_bad_policies_are_value_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        RetryPolicy(**kwargs)


class PushbackError(FakeRpcError):
    def __init__(self, retry_after_ms: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        self._retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after-ms", self._retry_after_ms),)


def test_the_retry_budget_stops_retries_once_half_is_spent_and_refills_with_answers() -> None:
    budget = RetryBudget(max_tokens=10, ratio=0.5)
    policy = RetryPolicy(max_retries=3, initial_backoff_s=0.0, max_backoff_s=0.0)
    error = PushbackError("1")
    num_retried = 0
    for n in range(10):
        attempts = Attempts(f"r{n}", policy, None, budget)
        try:
            attempts.backoff_s(error, num_messages=0)
            num_retried += 1
        except KvswitchError:
            pass
    # Tokens 10 -> 9 ... 6 allow a retry; at 5 (half) they stop, and every later failure too.
    assert num_retried == 4 and budget.tokens == 0
    for n in range(14):  # 14 answered requests: 7 tokens; a failure leaves 6, past half
        Attempts(f"ok{n}", policy, None, budget).answered()
    assert Attempts("again", policy, None, budget).backoff_s(error, num_messages=0) == 0.001
    assert budget.tokens == 6.0
    # One answer per request, however many messages it streams.
    attempts = Attempts("stream", policy, None, budget)
    attempts.answered()
    attempts.answered()
    assert budget.tokens == 6.5
    # An unreachable router spends nothing: asking it again costs the fleet nothing.
    unreachable = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    assert Attempts("down", policy, None, budget).backoff_s(unreachable, num_messages=0) == 0.0
    assert budget.tokens == 6.5


def test_a_retry_waits_at_least_what_the_server_asked() -> None:
    policy = RetryPolicy(max_retries=1, initial_backoff_s=0.0, max_backoff_s=0.0)
    assert Attempts("r", policy, None).backoff_s(PushbackError("250"), num_messages=0) == 0.25
    # No wait asked (or none that reads as one): a limit the request broke, not load.
    for hint in ("soon", "0"):
        with pytest.raises(KvswitchError):
            Attempts("r", policy, None).backoff_s(PushbackError(hint), num_messages=0)
    with pytest.raises(KvswitchError):
        Attempts("r", policy, None).backoff_s(
            FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED), num_messages=0
        )
    # A wait past the deadline is no retry.
    with pytest.raises(KvswitchError):
        Attempts("r", policy, 0.1).backoff_s(PushbackError("5000"), num_messages=0)


def test_a_retry_budget_needs_sane_figures() -> None:
    with pytest.raises(ValueError, match="retry budget"):
        RetryBudget(max_tokens=0)
    with pytest.raises(ValueError, match="retry budget"):
        RetryBudget(ratio=0)


def test_a_call_the_server_cancelled_before_any_message_is_retried() -> None:
    """A router cancels the calls that reach it as it shuts down: none of them ran."""
    policy = RetryPolicy(max_retries=1, initial_backoff_s=0.0, max_backoff_s=0.0)
    cancelled = FakeRpcError(grpc.StatusCode.CANCELLED, "CANCELLED")
    assert Attempts("r", policy, None).backoff_s(cancelled, num_messages=0) == 0.0
    with pytest.raises(KvswitchError):  # tokens arrived: a retry would repeat them
        Attempts("r", policy, None).backoff_s(cancelled, num_messages=2)
