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
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

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

    fig, axes = plt.subplots(
        len(policies), 1, figsize=(8, 2.6 * len(policies)), sharex=True, squeeze=False
    )
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        for worker_id, (times, counts) in worker_load_over_time(
            records[policy], origins_s[policy]
        ).items():
            ax.step(times, counts, where="post", label=worker_id)
        ax.set(ylabel="running requests", title=policy)
        ax.legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("time from the phase's start (s)")
    paths.append(_save(fig, out_dir / "worker_load.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:  # a matplotlib Figure
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
