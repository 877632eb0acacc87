"""A load test's report (``live.py``) as a table for a terminal: one column per policy, one row
per figure, the way ``vllm bench serve`` summarises a run (the JSON holds more: p90s, per-worker
and per-router counts)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

LATENCIES = [
    ("ttft_ms", "TTFT"),
    ("tpot_ms", "TPOT"),
    ("itl_ms", "ITL"),
    ("e2el_ms", "E2E latency"),
]
STATS = [("mean", "mean"), ("median", "median"), ("p99", "P99")]


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percent(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _rows(report: Mapping[str, Any]) -> list[tuple[str, Callable[[Mapping], str]]]:
    """(label, what it shows of a policy's figures) for each row of the table."""
    rows: list[tuple[str, Callable[[Mapping], str]]] = [
        ("Successful requests", lambda f: str(f["completed"])),
        ("Failed requests", lambda f: str(f["failed"])),
        ("Duration (s)", lambda f: _number(f["duration_s"])),
        ("Request throughput (req/s)", lambda f: _number(f["request_throughput"])),
        ("Output token throughput (tok/s)", lambda f: _number(f["output_token_throughput"])),
        ("Total token throughput (tok/s)", lambda f: _number(f["total_token_throughput"])),
    ]
    config = report.get("config", {})
    if any(config.get(slo) for slo in ("slo_ttft_ms", "slo_tpot_ms", "slo_e2el_ms")):
        rows.append(("Goodput (req/s)", lambda f: _number(f["goodput"])))
    rows += [
        ("Prompt tokens from cache", lambda f: _percent(f["token_hit_rate"])),
        ("Load imbalance (busiest / mean)", lambda f: _number(f["load_imbalance"])),
    ]
    for key, name in LATENCIES:
        for stat, stat_name in STATS:
            rows.append(
                (f"{name} {stat_name} (ms)", lambda f, key=key, stat=stat: _number(f[key][stat]))
            )
    return rows


def report_table(report: Mapping[str, Any]) -> str:
    """The report's figures, a column per policy in the order run, then what failed and where
    the plots went."""
    policies: Mapping[str, Mapping] = report["policies"]
    rows = [(label, [show(f) for f in policies.values()]) for label, show in _rows(report)]
    label_width = max(len(label) for label, _ in rows)
    widths = [
        max(len(policy), *(len(cells[i]) for _, cells in rows)) for i, policy in enumerate(policies)
    ]

    def line(label: str, cells: list[str]) -> str:
        padded = "  ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True))
        return f"{label.ljust(label_width)}  {padded}"

    header = line("policy", list(policies))
    lines = [header, "-" * len(header)]
    lines += [line(label, cells) for label, cells in rows]
    for policy, figures in policies.items():
        for error, num in sorted(figures["errors"].items()):
            lines.append(f"{policy}: {num} failed with {error}")
    if report.get("plots"):
        lines.append(f"plots: {', '.join(report['plots'])}")
    return "\n".join(lines)
