"""The fault runner's pure parts: counting outcomes, judging goals, reading log times, its
config. The runs themselves are in tests/reliability/."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvswitch.loadtest.chaos import ChaosConfig, process_kind
from kvswitch.loadtest.chaos_goals import goals
from kvswitch.loadtest.checked_load import Outcome, clear_status, make_prompts, tally
from kvswitch.loadtest.fleet_checks import MIB, RssSampler, log_times


def outcome(**fields: object) -> Outcome:
    values = {"prompt_index": 0, "request_id": "r", "sent_s": 0.0, "done_s": 1.0}
    values |= {"num_tokens": 4, "exact": True}
    return Outcome(**(values | fields))  # type: ignore[arg-type]


def test_tally_counts_each_way_a_request_ended() -> None:
    outcomes = [
        outcome(),
        outcome(route_reason="failover: lowest cost"),
        outcome(exact=False),
        outcome(request_id="a", num_tokens=0, exact=False, code="UNAVAILABLE", details="down"),
        outcome(request_id="b", num_tokens=3, exact=False, code="UNAVAILABLE", details="down"),
        outcome(request_id="c", num_tokens=0, exact=False, code="CANCELLED", details="CANCELLED"),
    ]
    assert tally(outcomes) == {
        "num_requests": 6,
        "num_completed": 3,
        "num_exact": 2,
        "num_not_exact": 1,
        "num_failed": 3,
        "num_failed_mid_stream": 1,
        "num_failed_unclear": 1,
        "num_failed_over": 1,
        "failed_by_code": {
            "CANCELLED": {"count": 1, "messages": ["CANCELLED"], "request_ids": ["c"]},
            "UNAVAILABLE": {"count": 2, "messages": ["down"], "request_ids": ["a", "b"]},
        },
    }
    assert clear_status(outcome(code="DEADLINE_EXCEEDED", details="Deadline Exceeded"))
    assert not clear_status(outcome(code="UNAVAILABLE", details=""))
    assert not clear_status(outcome(code="UNKNOWN", details="Channel is closed"))


def test_prompts_share_their_documents() -> None:
    prompts = make_prompts(num_documents=2, document_tokens=8, questions_per_document=3)
    assert len(prompts) == 6 and len({tuple(p[:8]) for p in prompts}) == 2
    assert prompts == make_prompts(num_documents=2, document_tokens=8, questions_per_document=3)


def summary(faults: list[dict], memory: dict | None = None) -> dict:
    requests = {"num_failed": 0, "num_not_exact": 0, "num_failed_unclear": 0}
    for fault in faults:
        requests["num_failed"] += fault["requests"]["num_failed"]
    final = {"leaked_blocks": {"worker-0": 0}, "index_clean": True}
    return {
        "faults": faults,
        "requests": requests,
        "final": final,
        "error": "",
        "memory": memory or {},
        "config": {"rss_window_s": 300.0},
    }


def fault(name: str, num_failed: int = 0, num_mid_stream: int = 0, **figures: object) -> dict:
    requests = {"num_failed": num_failed, "num_failed_mid_stream": num_mid_stream}
    return {"fault": name, "requests": requests, **figures}


def test_only_streams_broken_by_a_router_kill_may_fail() -> None:
    judged = goals(summary([fault("router-kill", 3, 3)]), "faults")
    assert judged["no_failure_where_retry_or_resume_possible"] == {"held": True, "value": 0}
    # One of them had no token yet: the client could have retried it.
    judged = goals(summary([fault("router-kill", 3, 2)]), "faults")
    assert judged["no_failure_where_retry_or_resume_possible"] == {"held": False, "value": 1}


def test_timing_goals() -> None:
    faults = [
        fault("redis-outage", index_rebuilt_after_back_s=0.9),
        fault("redis-kill", index_rebuilt_after_back_s=5.2),
        fault("worker-stall", left_out_after_s=1.1),
        fault("partition", left_out_after_s=None),  # never logged: never left out
    ]
    judged = goals(summary(faults), "faults")
    assert judged["index_rebuilt_within_5_s"] == {"held": False, "value": 5.2}
    assert judged["stalled_worker_left_out_within_2_s"] == {"held": False, "value": [1.1, None]}
    assert judged["no_leaked_blocks"]["held"] and judged["index_audit_clean"]["held"]


def test_memory_is_flat_unless_a_process_grows() -> None:
    def incarnation(seconds: float, first: float, last: float, slope: float) -> dict:
        return {"seconds": seconds, "first_mib": first, "last_mib": last, "mib_per_min": slope}

    memory = {
        "router": [incarnation(299, 71.5, 72.5, 0.2)],
        "worker-0/core": [incarnation(119, 580.9, 582.5, 1.06), incarnation(30, 500, 600, 9)],
        "redis": [incarnation(250, 12, 40, 5)],  # an empty server filling again: not judged
    }
    flat = goals(summary([], memory), "soak")["memory_flat"]
    assert flat == {"held": True, "value": {"growing": [], "judged": ["router", "worker-0/core"]}}
    memory["router"] = [incarnation(299, 71.5, 74.0, 1.4)]  # a steady 1.4 MiB a minute
    flat = goals(summary([], memory), "soak")["memory_flat"]
    assert flat["value"]["growing"] == ["router"] and not flat["held"]


def test_a_restarted_process_is_judged_once_it_has_filled_up_to_its_kind() -> None:
    sampler = RssSampler(dict, kind_of=process_kind)
    for second in range(40):  # two cores at 591 MiB; worker-0's restarted at 10 s, filling up
        sampler.record("worker-1/core", 11, second, 591 * MIB)
        sampler.record("router", 20, second, (70 + (second > 30)) * MIB)
        if second < 10:
            sampler.record("worker-0/core", 10, second, 591 * MIB)
        else:
            sampler.record("worker-0/core", 12, second, min(279 + 12 * (second - 10), 590) * MIB)
    growth = sampler.growth(since_s=19, warmup_s=2)
    # NOTE: the restarted core reaches 99 % of 591 MiB at 36 s: judged from there, flat.
    (restarted,) = growth["worker-0/core"]
    assert (restarted["pid"], restarted["first_mib"], restarted["last_mib"]) == (12, 590, 590)
    assert restarted["seconds"] == 3
    assert [i["seconds"] for i in growth["worker-1/core"]] == [20]
    assert growth["router"][0]["last_mib"] - growth["router"][0]["first_mib"] == 1

    still_filling = RssSampler(dict, kind_of=process_kind)
    for second in range(40):
        still_filling.record("worker-1/core", 11, second, 591 * MIB)
        still_filling.record("worker-0/core", 10 if second < 10 else 12, second, 400 * MIB)
    assert "worker-0/core" not in still_filling.growth(since_s=19, warmup_s=2)


def test_log_times_reads_both_log_formats(tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    log.write_text(
        'ts=2026-01-02T03:04:05.250Z level=WARNING logger=x msg="worker w1 stopped answering"\n'
        '{"ts": "2026-01-02T03:04:06.500Z", "level": "INFO", "msg": "w1 stopped answering"}\n'
        'ts=2026-01-02T03:04:07.000Z level=INFO logger=x msg="worker w2 stopped answering"\n'
    )
    start = 1767323045.0  # 2026-01-02T03:04:05Z
    assert log_times(log, "w1 stopped", start) == [start + 0.25, start + 1.5]
    assert log_times(log, "w1 stopped", start + 1.0) == [start + 1.5]
    assert log_times(tmp_path / "missing.log", "w1", 0.0) == []


def test_chaos_config_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unknown fault 'worker-melt'"):
        ChaosConfig(faults="worker-kill,worker-melt")
    with pytest.raises(ValueError, match="must pass the requests' deadline"):
        ChaosConfig(stall_s=5.0, timeout_s=8.0)
    config = ChaosConfig(redis="external")
    assert "redis-kill" not in config.fault_names()
    assert config.why_not("redis-kill") == "only a --redis local server is restarted by the cluster"
    assert ChaosConfig(redis="none", faults="redis-outage,worker-kill").fault_names() == [
        "worker-kill"
    ]
