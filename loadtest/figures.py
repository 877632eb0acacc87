"""A load test's figures, from what each request recorded, named and defined as ``vllm bench
serve`` does:

- TTFT: from sending the request to its first output token arriving.
- TPOT: ``(e2el - ttft) / (output tokens - 1)``, per request with at least two output tokens.
- ITL: the gaps between consecutive output messages of a stream, all requests pooled.
- E2EL: from sending the request to its last message.
- goodput: completed requests per second that met every SLO given.

Each latency is summarised as mean, median, p90 and p99, in milliseconds. Besides those: token
hit rate (prompt tokens served from a worker's prefix cache over prompt tokens); per worker the
requests and prefill tokens (prompt tokens it computed) it got, and per router the requests sent
through it; ``load_imbalance``, the busiest worker's prefill tokens over the mean of all workers.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    """One request of a load test, as the client saw it. Times in seconds on one clock."""

    session: int
    turn: int
    warmup: bool
    start_s: float
    num_prompt_tokens: int
    chunk_times_s: list[float] = field(default_factory=list)  # each output message's arrival
    end_s: float = 0.0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    worker_id: str = ""
    error: str | None = None
    router: str = ""  # the router it went through

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class SLOs:
    """Goodput's service-level objectives in milliseconds; None: not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        tpot_s = record.tpot_s
        return (
            (self.ttft_ms is None or record.ttft_s * 1000 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot_s is None or tpot_s * 1000 <= self.tpot_ms)
            and (self.e2el_ms is None or record.e2el_s * 1000 <= self.e2el_ms)
        )


def summary_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, p90 and p99 of ``values_s``, in milliseconds (None when there are none)."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def load_imbalance(prefill_tokens: Sequence[int]) -> float:
    """The busiest worker's prefill tokens over the mean (1.0: even; 0 workers or no work: 1.0)."""
    mean = sum(prefill_tokens) / len(prefill_tokens) if prefill_tokens else 0.0
    return max(prefill_tokens) / mean if mean else 1.0


def figures(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos: SLOs = SLOs(),
    worker_ids: Sequence[str] = (),
) -> dict:
    """The figures of the measured (non-warm-up) ``records`` of a phase that took
    ``duration_s``. ``worker_ids`` names workers that may have got no request (they count in the
    imbalance with zero work)."""
    measured = [r for r in records if not r.warmup]
    done = [r for r in measured if r.ok]
    per_worker: dict[str, dict[str, int]] = {
        w: {"requests": 0, "prefill_tokens": 0} for w in worker_ids
    }
    for r in done:
        worker = per_worker.setdefault(r.worker_id, {"requests": 0, "prefill_tokens": 0})
        worker["requests"] += 1
        worker["prefill_tokens"] += r.num_prompt_tokens - r.num_cached_tokens
    num_prompt = sum(r.num_prompt_tokens for r in done)
    num_output = sum(r.num_output_tokens for r in done)
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    itls = [b - a for r in done for a, b in itertools.pairwise(r.chunk_times_s)]
    per_router: dict[str, int] = {}
    for r in measured:
        per_router[r.router] = per_router.get(r.router, 0) + 1
    errors: dict[str, int] = {}
    for r in measured:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "completed": len(done),
        "failed": len(measured) - len(done),
        "errors": errors,
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_token_throughput": num_output / duration_s if duration_s else 0.0,
        "total_token_throughput": (num_prompt + num_output) / duration_s if duration_s else 0.0,
        "goodput": sum(slos.met_by(r) for r in done) / duration_s if duration_s else 0.0,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "token_hit_rate": sum(r.num_cached_tokens for r in done) / num_prompt if num_prompt else 0,
        "ttft_ms": summary_ms([r.ttft_s for r in done]),
        "tpot_ms": summary_ms(tpots),
        "itl_ms": summary_ms(itls),
        "e2el_ms": summary_ms([r.e2el_s for r in done]),
        "per_worker": dict(sorted(per_worker.items())),
        "per_router": dict(sorted(per_router.items())),  # measured requests sent through each
        "load_imbalance": load_imbalance([w["prefill_tokens"] for w in per_worker.values()]),
    }


def worker_load_over_time(
    records: Sequence[RequestRecord], origin_s: float
) -> Mapping[str, tuple[list[float], list[int]]]:
    """Per worker, the requests it was running over time: (times from ``origin_s``, counts),
    one point per start or end, for a step plot."""
    events: dict[str, list[tuple[float, int]]] = {}
    for r in records:
        if r.ok:
            events.setdefault(r.worker_id, []).extend([(r.start_s, 1), (r.end_s, -1)])
    curves = {}
    for worker_id, worker_events in sorted(events.items()):
        worker_events.sort()
        times, counts, running = [0.0], [0], 0
        for t, change in worker_events:
            running += change
            times.append(t - origin_s)
            counts.append(running)
        curves[worker_id] = (times, counts)
    return curves
