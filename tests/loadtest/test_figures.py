"""The load test's figures on hand-made records: vllm bench serve's definitions, exactly."""

from __future__ import annotations

import pytest

from kvswitch.loadtest.figures import (
    RequestRecord,
    SLOs,
    figures,
    load_imbalance,
    summary_ms,
    worker_load_over_time,
)


def _record(start_s, chunks_s, end_s, *, out, prompt=100, cached=0, worker="w0", warmup=False):
    return RequestRecord(
        0, 0, warmup, start_s, prompt, list(chunks_s), end_s, out, cached, worker, None
    )


RECORDS = [
    # TTFT 0.1 s, E2EL 0.5 s, 5 tokens: TPOT (0.5 - 0.1) / 4 = 0.1 s; ITLs 0.1, 0.3.
    _record(0.0, [0.1, 0.2, 0.5], 0.5, out=5, prompt=100, cached=64, worker="w0"),
    # TTFT 0.3 s, E2EL 0.3 s, one token: no TPOT, no ITL.
    _record(1.0, [1.3], 1.3, out=1, prompt=50, cached=0, worker="w1"),
    # Left out: warm-up, and a failure.
    _record(0.0, [9.0], 9.0, out=3, warmup=True),
    RequestRecord(0, 0, False, 2.0, 10, [], 2.5, 0, 0, "", "UNAVAILABLE"),
]


def test_latencies_throughput_and_hit_rate() -> None:
    f = figures(RECORDS, duration_s=2.0)
    assert (f["completed"], f["failed"], f["errors"]) == (2, 1, {"UNAVAILABLE": 1})
    assert f["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert f["ttft_ms"]["median"] == pytest.approx(200.0)
    assert f["tpot_ms"] == pytest.approx(
        {"mean": 100.0, "median": 100.0, "p90": 100.0, "p99": 100.0}
    )
    assert f["itl_ms"]["mean"] == pytest.approx(200.0)
    assert f["itl_ms"]["p90"] == pytest.approx(280.0)  # numpy's linear interpolation
    assert f["e2el_ms"]["mean"] == pytest.approx(400.0)
    assert f["request_throughput"] == pytest.approx(1.0)
    assert f["output_token_throughput"] == pytest.approx(3.0)
    assert f["total_token_throughput"] == pytest.approx((150 + 6) / 2)
    assert f["token_hit_rate"] == pytest.approx(64 / 150)
    assert f["per_worker"] == {
        "w0": {"requests": 1, "prefill_tokens": 36},
        "w1": {"requests": 1, "prefill_tokens": 50},
    }
    assert f["load_imbalance"] == pytest.approx(50 / 43)


def test_goodput_counts_requests_within_every_slo() -> None:
    assert figures(RECORDS, 2.0, SLOs(ttft_ms=150))["goodput"] == pytest.approx(0.5)
    assert figures(RECORDS, 2.0, SLOs(ttft_ms=400, tpot_ms=50))["goodput"] == pytest.approx(0.5)
    assert figures(RECORDS, 2.0, SLOs(e2el_ms=350))["goodput"] == pytest.approx(0.5)
    assert figures(RECORDS, 2.0, SLOs(ttft_ms=400, e2el_ms=500))["goodput"] == pytest.approx(1.0)


def test_idle_workers_count_in_the_imbalance() -> None:
    f = figures(RECORDS, 2.0, worker_ids=["w0", "w1", "w2"])
    assert f["per_worker"]["w2"] == {"requests": 0, "prefill_tokens": 0}
    assert f["load_imbalance"] == pytest.approx(50 / (86 / 3))
    assert load_imbalance([]) == 1.0 and load_imbalance([0, 0]) == 1.0


def test_summaries_and_load_curves() -> None:
    assert summary_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}
    assert summary_ms([0.001, 0.003])["median"] == pytest.approx(2.0)
    curves = worker_load_over_time(RECORDS, origin_s=0.0)
    # The warm-up request ran on w0 too (0 to 9 s): load is load, measured or not.
    assert curves["w0"] == ([0.0, 0.0, 0.0, 0.5, 9.0], [0, 1, 2, 1, 0])
    assert curves["w1"] == ([0.0, 1.0, 1.3], [0, 1, 0])
    assert "" not in curves  # the failed request ran nowhere
