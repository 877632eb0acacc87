"""Disaggregated prefill: when the router sends a prompt to a prefill worker instead of letting the
worker that decodes it prefill it too.

The decode worker is chosen first, as for any request (load, and the blocks it holds already).
Its prompt is prefilled elsewhere only when that is worth it::

    uncached tokens on the decode worker < min_remote_prefill_tokens  -> prefill there (a short
                                                                         prefill barely delays
                                                                         its decodes)
    no prefill worker, or the cheapest one has more than
    max_prefill_queue_tokens queued to prefill                        -> prefill there
    otherwise                                                         -> prefill on that worker

The prefill worker is the cheapest by the routing policy (its cache, its queue); it samples the
first token and holds the prompt's blocks under a lease of ``lease_s`` for the decode worker, which
takes the ones it lacks (``worker/block_transfer.py``) and decodes the rest.

Pure logic, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvswitch.router.policy import WorkerState

ON_TRANSFER_FAILURE = ("recompute", "fail")
TRANSPORTS = ("", "auto", "nixl", "mapped", "shm", "grpc")
MAX_LEASE_S = 600.0  # what a worker grants at most


@dataclass(frozen=True)
class DisaggConfig:
    """When and how the router splits a request between a prefill and a decode worker."""

    # A prompt with fewer uncached tokens on its decode worker is prefilled there.
    min_remote_prefill_tokens: int = 256
    # A prefill worker with more prompt tokens than this queued takes no more: prefill locally.
    max_prefill_queue_tokens: int = 32768
    # How long the prefill worker holds the blocks for the decode worker (each fetch restarts it).
    lease_s: float = 5.0
    # When the transfer fails: compute the missing blocks on the decode worker, or fail.
    on_transfer_failure: str = "recompute"
    # How the blocks travel: "nixl", "mapped", "shm", "grpc", or "auto" / "" (the first of those
    # that works; the decode worker decides).
    transport: str = ""

    def __post_init__(self) -> None:
        if self.min_remote_prefill_tokens < 0:
            raise ValueError(
                f"min_remote_prefill_tokens must be >= 0, got {self.min_remote_prefill_tokens}"
            )
        if self.max_prefill_queue_tokens < 0:
            raise ValueError(
                f"max_prefill_queue_tokens must be >= 0, got {self.max_prefill_queue_tokens}"
            )
        if not 0 < self.lease_s <= MAX_LEASE_S:
            raise ValueError(f"lease_s must be in (0, {MAX_LEASE_S:g}], got {self.lease_s}")
        if self.on_transfer_failure not in ON_TRANSFER_FAILURE:
            raise ValueError(
                f"on_transfer_failure must be one of {', '.join(ON_TRANSFER_FAILURE)}, "
                f"got {self.on_transfer_failure!r}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be auto, nixl, mapped, shm, grpc or empty, got {self.transport!r}"
            )


def prefill_locally(
    num_uncached_tokens: int, prefill_worker: WorkerState | None, config: DisaggConfig
) -> str | None:
    """Why the decode worker should prefill the prompt itself (a reason for the logs), or None
    when ``prefill_worker`` should. ``num_uncached_tokens``: what the decode worker would
    compute."""
    if prefill_worker is None:
        return "no prefill worker"
    if num_uncached_tokens < config.min_remote_prefill_tokens:
        return f"{num_uncached_tokens} uncached tokens"
    if prefill_worker.num_prefill_tokens > config.max_prefill_queue_tokens:
        return f"prefill queue {prefill_worker.num_prefill_tokens} tokens"
    return None
