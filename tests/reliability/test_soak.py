"""The churn run of docs/RELIABILITY.md, short enough for every test run: the fault runner
(``python -m kvswitch.loadtest.chaos --schedule soak``) on ``kvswitch up --redis local``'s
cluster, each worker killed once under checked load and started again by the cluster, the
Redis killed once and restarted by the cluster. The 10-minute run is the same command with
``--duration-s 600`` (its figures are in docs/RELIABILITY.md)."""

from __future__ import annotations

import json
from pathlib import Path

from kvswitch.loadtest.chaos import ChaosConfig, run


def test_a_short_churn_run_keeps_every_goal(tmp_path: Path) -> None:
    config = ChaosConfig(
        schedule="soak",
        redis="local",
        duration_s=36.0,
        kill_every_s=11.0,
        rss_window_s=20.0,
        rss_every_s=0.5,
        progress_every_s=12.0,
        log_dir=str(tmp_path),
    )
    said: list[str] = []
    summary = run(config, say=said.append)

    # NOTE: first, with each process's figures in full (a tuple's repr is cut short).
    memory = summary["goals"]["memory_flat"]
    assert memory["held"], json.dumps({"memory_flat": memory, "memory": summary["memory"]})

    assert {name: goal["held"] for name, goal in summary["goals"].items()} == {
        "run_completed": True,
        "no_failure_where_retry_or_resume_possible": True,
        "no_token_lost_or_repeated": True,
        "every_failure_has_a_clear_status": True,
        "index_rebuilt_within_5_s": True,
        "no_leaked_blocks": True,
        "index_audit_clean": True,
        "memory_flat": True,
    }, json.dumps({"goals": summary["goals"], "requests": summary["requests"], "said": said})
    injected = [(f["fault"], f["target"]) for f in summary["faults"]]
    # NOTE: each fault is injected once the one before it is over (a killed worker back and
    # registered), so how many fit in 36 s is up to the machine's speed: kills every 11 s plan
    # three, a busy machine fits fewer. The Redis is killed once; workers are killed in turn.
    assert injected.count(("redis-kill", "redis")) == 1, said
    kills = [target for fault, target in injected if fault == "worker-kill"]
    assert kills and kills == [f"worker-{i}" for i in range(len(kills))], said
    requests = summary["requests"]
    # NOTE: how many fit in the 36 s is the machine's speed too (74 on a slow day, 100+ on a
    # quick one): enough to span the faults, each exact.
    assert requests["num_exact"] == requests["num_requests"] >= 30, requests
    assert "router" in summary["goals"]["memory_flat"]["value"]["judged"]
