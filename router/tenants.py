"""Per-tenant limits at the router's front door: how many streams a tenant may hold open and how
many requests it may start a second, so that one tenant flooding the router is refused at its
own limit (RESOURCE_EXHAUSTED, with how long to wait) while the others go on.

A tenant is named by a header the operator chooses (``--tenant-header``: gRPC metadata, or the
same HTTP header on the OpenAI API), else by the API key an HTTP client presented, else by the
client's address. Rates are token buckets: ``requests_per_s`` refill a bucket of ``burst``
requests. No I/O here; the clock is injectable for tests.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvswitch.router.limits import ClientStreams


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_s: float


class TenantLimits:
    def __init__(
        self,
        max_streams: int = 0,
        requests_per_s: float = 0.0,
        burst: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_streams``: open streams a tenant may hold (0: no limit); ``requests_per_s``:
        the rate its requests may start at (0: no limit), in bursts of ``burst`` (0: the rate,
        rounded up)."""
        if max_streams < 0 or not 0 <= requests_per_s < math.inf or burst < 0:
            raise ValueError(
                "max_streams_per_tenant, max_requests_per_tenant_per_s and tenant_burst must "
                f"be >= 0, got {max_streams}, {requests_per_s}, {burst}"
            )
        self.max_streams = max_streams
        self.requests_per_s = requests_per_s
        self.burst = burst or max(math.ceil(requests_per_s), 1)
        self._clock = clock
        self._streams = ClientStreams(max_streams)  # counted as a client's are
        self._buckets: dict[str, _Bucket] = {}

    @property
    def limits_anything(self) -> bool:
        return bool(self.max_streams or self.requests_per_s)

    def admit(self, tenant: str) -> tuple[str, float] | None:
        """Count a new stream of ``tenant``; or, counting nothing, why not (``"streams"`` or
        ``"rate"``) and how many seconds until it may try again."""
        if self.max_streams and self._streams.num_open(tenant) >= self.max_streams:
            # NOTE: when one ends, which nobody knows: a short wait, as for a client's streams.
            return "streams", 0.1
        if self.requests_per_s:
            now_s = self._clock()
            bucket = self._buckets.get(tenant)
            if bucket is None:
                bucket = self._buckets[tenant] = _Bucket(float(self.burst), now_s)
            refill = (now_s - bucket.updated_s) * self.requests_per_s
            bucket.tokens = min(bucket.tokens + refill, float(self.burst))
            bucket.updated_s = now_s
            if bucket.tokens < 1.0:
                return "rate", (1.0 - bucket.tokens) / self.requests_per_s
            bucket.tokens -= 1.0
        self._streams.open(tenant)
        return None

    def close(self, tenant: str) -> None:
        """A stream ``admit`` counted has ended."""
        self._streams.close(tenant)

    def num_open(self, tenant: str) -> int:
        return self._streams.num_open(tenant)


def key_tenant(api_key: str) -> str:
    """The tenant an API key names: a digest, never the key itself (it appears in logs)."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:12]
