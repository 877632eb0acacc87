"""What a load test shows a person: the report as a table, and worker-load curves that stay
visible where they overlap."""

from __future__ import annotations

import dataclasses
import re

from kvswitch.loadtest.figures import SLOs, figures
from kvswitch.loadtest.plots import worker_line_styles, worker_load_figure
from kvswitch.loadtest.report_table import report_table
from tests.loadtest.test_figures import RECORDS

# Measured: TTFT 100 ms, E2EL 500 ms, 5 tokens (TPOT 100 ms, ITLs 100 and 300 ms), 64 of 100
# prompt tokens cached; TTFT and E2EL 300 ms, one token; a failure (UNAVAILABLE).
COST = RECORDS
ROUND_ROBIN = [RECORDS[1]]


def _rows(table: str) -> dict[str, list[str]]:
    """The table's cells by row label (two spaces or more part the columns)."""
    rows = {}
    for line in table.splitlines()[2:]:
        label, *cells = re.split(r"\s{2,}", line.strip())
        rows[label] = cells
    return rows


def test_the_table_has_a_column_per_policy_and_vllm_bench_serves_rows() -> None:
    report = {
        "config": {"slo_ttft_ms": 0.0, "slo_tpot_ms": 0.0, "slo_e2el_ms": 0.0},
        "policies": {"cost": figures(COST, 2.0), "round_robin": figures(ROUND_ROBIN, 1.0)},
        "plots": ["out/ttft_cdf.png"],
    }
    table = report_table(report)
    lines = table.splitlines()
    assert lines[0].split() == ["policy", "cost", "round_robin"]
    rows = _rows(table)
    assert rows["Successful requests"] == ["2", "1"]
    assert rows["Failed requests"] == ["1", "0"]
    assert rows["Duration (s)"] == ["2.00", "1.00"]
    assert rows["Request throughput (req/s)"] == ["1.00", "1.00"]
    assert rows["Output token throughput (tok/s)"] == ["3.00", "1.00"]
    assert rows["Prompt tokens from cache"] == ["42.7%", "0.0%"]  # 64 of 150
    assert rows["TTFT mean (ms)"] == ["200.00", "300.00"]
    assert rows["TTFT P99 (ms)"] == ["298.00", "300.00"]
    assert rows["TPOT median (ms)"] == ["100.00", "-"]  # no request of two tokens
    assert rows["ITL mean (ms)"] == ["200.00", "-"]
    assert rows["E2E latency median (ms)"] == ["400.00", "300.00"]
    assert "Goodput (req/s)" not in rows  # no SLO given
    assert lines[-2:] == ["cost: 1 failed with UNAVAILABLE", "plots: out/ttft_cdf.png"]
    # Every row lines its cells up under the policies' names.
    widths = {len(line) for line in lines[2:-2]}
    assert widths == {len(lines[0])}


def test_goodput_is_a_row_when_an_slo_is_given() -> None:
    cost = figures(COST, 2.0, SLOs(ttft_ms=150.0))  # the first request's TTFT meets it
    report = {"config": {"slo_ttft_ms": 150.0}, "policies": {"cost": cost}}
    assert _rows(report_table(report))["Goodput (req/s)"] == ["0.50"]


def test_each_worker_load_curve_has_a_style_of_its_own() -> None:
    # Three workers running the same requests at the same times: their curves coincide.
    records = [dataclasses.replace(RECORDS[0], worker_id=w) for w in ("w0", "w1", "w2")]
    fig = worker_load_figure(
        {"cost": records, "round_robin": records[:2]}, {"cost": 0.0, "round_robin": 0.0}
    )
    for ax, num_curves in zip(fig.axes, (3, 2), strict=True):
        lines = ax.get_lines()
        assert len(lines) == num_curves
        styles = {(line.get_linestyle(), line.get_linewidth()) for line in lines}
        assert len(styles) == num_curves
        # Each later curve is narrower: the one beneath shows around it.
        widths = [line.get_linewidth() for line in lines]
        assert widths == sorted(widths, reverse=True)
    styles = worker_line_styles(9)
    assert len({(s["linestyle"], s["linewidth"]) for s in styles}) == 9
