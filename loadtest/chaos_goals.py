"""The goals of a fault run (docs/RELIABILITY.md), read off its summary (``chaos.run``): each
goal with the figure it is judged on and whether it held. No I/O here.

- no request fails where a retry or a resume was possible: all but the streams under way when
  the router was killed (``router-kill``), which the client SDK cannot resume (it retries only
  before the first token, or it would repeat tokens);
- no token lost, repeated or changed: every completed request gave its reference's tokens;
- every failure has a clear status: UNAVAILABLE, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, with
  a message;
- the index is rebuilt within 5 s of the Redis coming back;
- a stalled or cut-off worker is left out by the router within 2 s;
- no worker leaks a KV block, and the index agrees with the workers (after every fault and at
  the end);
- soak: memory is flat over the last stretch of the run: no process (each that lived through at
  least a minute of it, or half of a shorter stretch, once warmed up) grew by more than 10 MiB,
  and none that lived through four minutes of it or more by more than 1 MiB a minute.
"""

from __future__ import annotations

from typing import Any

INDEX_REBUILT_WITHIN_S = 5.0
LEFT_OUT_WITHIN_S = 2.0
MEMORY_MIN_SECONDS = 60.0  # an incarnation shorter than this in the window is not judged
MEMORY_MAX_GROWTH_MIB = 10.0  # from its first to its last sample in the window
MEMORY_MAX_MIB_PER_MIN = 1.0  # the trend, judged over this long or more:
MEMORY_SLOPE_MIN_SECONDS = 240.0  # over two minutes a 600 MiB process moves ~1 MiB by noise


def _goal(held: bool, value: Any) -> dict[str, Any]:
    return {"held": held, "value": value}


def goals(summary: dict[str, Any], schedule: str) -> dict[str, dict[str, Any]]:
    faults = summary["faults"]
    requests = summary["requests"]
    unresumable = sum(
        f["requests"]["num_failed_mid_stream"] for f in faults if f["fault"] == "router-kill"
    )
    report = {
        "run_completed": _goal(not summary["error"], summary["error"]),
        "no_failure_where_retry_or_resume_possible": _goal(
            requests["num_failed"] - unresumable == 0, requests["num_failed"] - unresumable
        ),
        "no_token_lost_or_repeated": _goal(
            requests["num_not_exact"] == 0, requests["num_not_exact"]
        ),
        "every_failure_has_a_clear_status": _goal(
            requests["num_failed_unclear"] == 0, requests["num_failed_unclear"]
        ),
    }
    rebuilt = [f["index_rebuilt_after_back_s"] for f in faults if f["fault"].startswith("redis")]
    if rebuilt:
        report["index_rebuilt_within_5_s"] = _goal(
            max(rebuilt) <= INDEX_REBUILT_WITHIN_S, max(rebuilt)
        )
    left_out = [
        f["left_out_after_s"] for f in faults if f["fault"] in ("worker-stall", "partition")
    ]
    if left_out:
        held = all(s is not None and s <= LEFT_OUT_WITHIN_S for s in left_out)
        report["stalled_worker_left_out_within_2_s"] = _goal(held, left_out)
    checks = [f for f in faults if "leaked_blocks" in f] + [summary["final"]]
    leaked = sum(n for check in checks for n in check["leaked_blocks"].values())
    report["no_leaked_blocks"] = _goal(leaked == 0, leaked)
    num_unclean = sum(not check["index_clean"] for check in checks)
    report["index_audit_clean"] = _goal(num_unclean == 0, num_unclean)
    if schedule == "soak":
        report["memory_flat"] = _memory_flat(summary["memory"], summary["config"]["rss_window_s"])
    return report


def _memory_flat(memory: dict[str, list[dict[str, Any]]], window_s: float) -> dict[str, Any]:
    """Each process incarnation that lived through enough of the window (a minute, or half a
    short window) grew by at most ``MEMORY_MAX_GROWTH_MIB``; one that lived through four minutes
    of it or more, also at most ``MEMORY_MAX_MIB_PER_MIN`` (a shorter trend is mostly noise)."""
    min_seconds = min(MEMORY_MIN_SECONDS, window_s / 2)
    growing, judged = set(), set()
    for name, incarnations in memory.items():
        if name == "redis":  # an empty server that fills again grows by design
            continue
        for i in incarnations:
            if i["seconds"] < min_seconds:
                continue
            judged.add(name)
            too_steep = (
                i["seconds"] >= MEMORY_SLOPE_MIN_SECONDS
                and i["mib_per_min"] > MEMORY_MAX_MIB_PER_MIN
            )
            if i["last_mib"] - i["first_mib"] > MEMORY_MAX_GROWTH_MIB or too_steep:
                growing.add(name)
    return _goal(
        bool(judged) and not growing, {"growing": sorted(growing), "judged": sorted(judged)}
    )
