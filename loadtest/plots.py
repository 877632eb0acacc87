"""PNG plots of a load test: TTFT distribution and token hit rate per policy, and each worker's
running requests over time. matplotlib is imported here only, so the figures need it only when
plots are asked for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvswitch.loadtest.figures import RequestRecord, worker_load_over_time


def write_plots(
    out_dir: Path,
    records: Mapping[str, Sequence[RequestRecord]],
    report: Mapping[str, Mapping],
    origins_s: Mapping[str, float],
) -> list[Path]:
    """Write ``ttft_cdf.png``, ``hit_rate.png`` and ``worker_load.png`` for the phases in
    ``records`` (by policy) into ``out_dir``; returns their paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    policies = list(records)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        ttfts_ms = np.sort([r.ttft_s * 1000 for r in records[policy] if r.ok and not r.warmup])
        if len(ttfts_ms):
            ax.step(ttfts_ms, np.arange(1, len(ttfts_ms) + 1) / len(ttfts_ms), label=policy)
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="Time to first token")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rates = [100 * report[policy]["token_hit_rate"] for policy in policies]
    ax.bar(policies, rates)
    ax.set(ylabel="token hit rate (%)", title="Prompt tokens served from a prefix cache")
    ax.set_ylim(0, 100)
    paths.append(_save(fig, out_dir / "hit_rate.png"))

    paths.append(_save(worker_load_figure(records, origins_s), out_dir / "worker_load.png"))
    return paths


LINE_STYLES = ["-", "--", ":", "-."]


def worker_line_styles(num_workers: int) -> list[dict[str, Any]]:
    """matplotlib line properties for ``num_workers`` curves that may lie on top of each other
    (two workers running as many requests): each later one narrower and in another dash pattern,
    so the one beneath shows around it."""
    widths = np.linspace(4.0, 1.2, num_workers) if num_workers > 1 else [1.5]
    return [
        {"linestyle": LINE_STYLES[i % len(LINE_STYLES)], "linewidth": float(width), "alpha": 0.8}
        for i, width in enumerate(widths)
    ]


def worker_load_figure(
    records: Mapping[str, Sequence[RequestRecord]], origins_s: Mapping[str, float]
) -> Any:  # a matplotlib Figure
    """Each worker's running requests over time, one panel per policy."""
    plt = _pyplot()
    policies = list(records)
    fig, axes = plt.subplots(
        len(policies), 1, figsize=(8, 2.6 * len(policies)), sharex=True, squeeze=False
    )
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        curves = worker_load_over_time(records[policy], origins_s[policy])
        styles = worker_line_styles(len(curves))
        for (worker_id, (times, counts)), style in zip(curves.items(), styles, strict=True):
            ax.step(times, counts, where="post", label=worker_id, **style)
        ax.set(ylabel="running requests", title=policy)
        ax.legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("time from the phase's start (s)")
    return fig


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:  # a matplotlib Figure
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
