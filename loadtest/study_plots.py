"""One PNG per fleet of the routing study: each policy's hit rate (as a fraction of the global
cache's) against its load imbalance, with the goals drawn in, and its mean TTFT beside the floor
no policy can beat. matplotlib is imported here only."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_study_plots(
    out_dir: Path, fleets: Sequence[dict[str, Any]], hit_goal: float, imbalance_goal: float
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fleet in fleets:
        policies = fleet["policies"]
        # NOTE: prefix can herd a whole trace onto one worker; its imbalance leaves the axes.
        shown = {p: f for p, f in policies.items() if f["load_imbalance"] <= 4}
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
        for policy, f in shown.items():
            left.scatter(f["load_imbalance"], 100 * f["hit_of_global"], s=40)
            left.annotate(
                policy,
                (f["load_imbalance"], 100 * f["hit_of_global"]),
                fontsize=8,
                xytext=(4, 3),
                textcoords="offset points",
            )
        left.axhline(100 * hit_goal, color="grey", linestyle="--", linewidth=0.8)
        left.axvline(imbalance_goal, color="grey", linestyle="--", linewidth=0.8)
        left.set(
            xlabel="load imbalance (busiest / mean prefill tokens)",
            ylabel="token hit rate (% of the global cache's)",
            title="hits against balance",
        )
        names = list(policies)
        ttfts = [policies[p]["ttft_mean_s"] for p in names]
        right.barh(names, ttfts)
        right.axvline(
            fleet["ttft_floor_s"],
            color="black",
            linestyle=":",
            linewidth=1,
            label="floor: no queueing, every hit",
        )
        right.set_xscale("log")
        right.set(xlabel="mean TTFT (s)", title="time to first token")
        right.legend(fontsize="small")
        fig.suptitle(
            f"{fleet['name']}: {fleet['capacity_blocks']} blocks a worker, rate scale "
            f"{fleet['rate_scale']:.3g}"
        )
        fig.tight_layout()
        path = out_dir / (re.sub(r"[^A-Za-z0-9]+", "_", fleet["name"]).strip("_") + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
