"""``kvswitch bench pd``: disaggregated prefill against one-worker serving, when long prefills
interfere with decodes (the reason disaggregation exists: the tail of the time between tokens).

The same load runs against two local clusters of ``--num-workers`` workers each, one after the
other: all of role ``both``, then one prefill worker and the rest decode workers. The load:

- ``--num-streams`` decode streams in a closed loop: short prompts (``--short-prompt-tokens``),
  long answers (``--short-output-tokens``), one after another per stream;
- long prompts (``--long-prompt-tokens``, a few output tokens) arriving ``--long-per-s`` a second
  (Poisson), each a prefill that, on one worker, shares its steps with that worker's decodes.

Every prompt is random (no prefix is shared: what is measured is interference, not caching). Per
mode it reports, for the decode streams, the inter-token latency (ITL: the gap between two chunks
divided by the tokens in the later one) mean / p50 / p99 and time per output token, and for both
kinds of request the time to first token as the client saw it, with how many long prompts were
prefilled on another worker than the one that decoded them.
"""

from __future__ import annotations

import itertools
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvswitch.benchmarks.timing import machine_info, percentile


@dataclass(frozen=True)
class PDBenchConfig:
    num_workers: int = 2
    num_streams: int = 4
    short_prompt_tokens: int = 64
    short_output_tokens: int = 64
    long_prompt_tokens: int = 2048
    long_output_tokens: int = 4
    long_per_s: float = 1.0
    duration_s: float = 20.0
    kv_cache_bytes: int = 256 << 20
    kv_transport: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_workers < 2:
            raise ValueError("num_workers must be >= 2: one prefill worker and a decode worker")
        for name in ("num_streams", "short_prompt_tokens", "short_output_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("long_prompt_tokens", "long_output_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not self.long_per_s > 0 or not self.duration_s > 0:
            raise ValueError("long_per_s and duration_s must be positive")


@dataclass
class _Request:
    kind: str  # "short" or "long"
    sent_s: float
    chunk_times_s: list[tuple[float, int]]  # (arrival, tokens in the chunk)
    prefill_worker_id: str = ""
    decode_worker_id: str = ""


def _run_load(address: str, config: PDBenchConfig) -> list[_Request]:
    from kvswitch.client import Client

    rng = random.Random(config.seed)
    prompts_lock = threading.Lock()
    done: list[_Request] = []
    stop_at_s = time.monotonic() + config.duration_s

    def prompt(num_tokens: int) -> list[int]:
        with prompts_lock:
            return [rng.randrange(256) for _ in range(num_tokens)]

    def one(client: Client, kind: str, num_prompt: int, num_output: int) -> None:
        request = _Request(kind, time.monotonic(), [])
        with client.stream(prompt_token_ids=prompt(num_prompt), max_tokens=num_output) as stream:
            for chunk in stream:
                request.chunk_times_s.append((time.monotonic(), len(chunk.token_ids)))
            stats = stream.result.stats
        request.prefill_worker_id = stats.prefill_worker_id
        request.decode_worker_id = stats.decode_worker_id
        done.append(request)

    def decode_stream(client: Client) -> None:
        while time.monotonic() < stop_at_s:
            one(client, "short", config.short_prompt_tokens, config.short_output_tokens)

    def long_arrivals(client: Client) -> None:
        arrivals = random.Random(config.seed + 1)
        threads = []
        while True:
            time.sleep(arrivals.expovariate(config.long_per_s))
            if time.monotonic() >= stop_at_s:
                break
            thread = threading.Thread(
                target=one,
                args=(client, "long", config.long_prompt_tokens, config.long_output_tokens),
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()

    with Client(address, timeout_s=300) as client:
        # One request of each kind first, so that no figure includes a cold start.
        one(client, "short", config.short_prompt_tokens, 2)
        one(client, "long", config.long_prompt_tokens, 2)
        done.clear()
        stop_at_s = time.monotonic() + config.duration_s
        threads = [
            threading.Thread(target=decode_stream, args=(client,))
            for _ in range(config.num_streams)
        ]
        threads.append(threading.Thread(target=long_arrivals, args=(client,)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return done


def _figures(requests: list[_Request]) -> dict[str, Any]:
    shorts = [r for r in requests if r.kind == "short" and r.chunk_times_s]
    longs = [r for r in requests if r.kind == "long" and r.chunk_times_s]
    itls_ms = []
    tpots_ms = []
    for r in shorts:
        times = r.chunk_times_s
        for (before, _), (after, num_tokens) in itertools.pairwise(times):
            itls_ms += [(after - before) * 1e3 / num_tokens] * num_tokens
        num_tokens = sum(n for _, n in times)
        if num_tokens > 1:
            tpots_ms.append((times[-1][0] - times[0][0]) * 1e3 / (num_tokens - 1))

    def ttft_ms(rs: list[_Request]) -> dict[str, float]:
        values = [(r.chunk_times_s[0][0] - r.sent_s) * 1e3 for r in rs]
        return {
            "mean": statistics.fmean(values),
            "p50": percentile(values, 0.5),
            "p99": percentile(values, 0.99),
        }

    return {
        "num_short": len(shorts),
        "num_long": len(longs),
        "num_long_disaggregated": sum(r.prefill_worker_id != r.decode_worker_id for r in longs),
        "itl_ms": {
            "mean": statistics.fmean(itls_ms),
            "p50": percentile(itls_ms, 0.5),
            "p99": percentile(itls_ms, 0.99),
        },
        "tpot_ms_mean": statistics.fmean(tpots_ms),
        "short_ttft_ms": ttft_ms(shorts),
        "long_ttft_ms": ttft_ms(longs),
    }


def run(config: PDBenchConfig) -> dict[str, Any]:
    from kvswitch.deploy.local import ClusterConfig, LocalCluster

    modes = {
        "aggregated": ClusterConfig(
            workers=config.num_workers, port=0, kv_cache_bytes=config.kv_cache_bytes
        ),
        "disaggregated": ClusterConfig(
            prefill_workers=1,
            decode_workers=config.num_workers - 1,
            port=0,
            kv_cache_bytes=config.kv_cache_bytes,
            kv_transport=config.kv_transport,
        ),
    }
    report: dict[str, Any] = {}
    for mode, cluster_config in modes.items():
        print(f"{mode}: {config.duration_s:g} s of load ...", file=sys.stderr, flush=True)
        with LocalCluster(cluster_config) as cluster:
            report[mode] = _figures(_run_load(cluster.address, config))
        figures = report[mode]
        print(
            f"  ITL p50 {figures['itl_ms']['p50']:.1f} ms, p99 {figures['itl_ms']['p99']:.1f} ms; "
            f"long TTFT p50 {figures['long_ttft_ms']['p50']:.0f} ms",
            file=sys.stderr,
        )
    report["config"] = {k: getattr(config, k) for k in config.__dataclass_fields__}
    report["machine"] = machine_info()
    return report
