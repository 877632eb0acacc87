"""When sessions start: an open loop (arrivals at a rate, Poisson or bursty) or a trace's own
times. A closed loop (fixed concurrency) needs no times: the runner starts a session whenever one
ends.

Gamma-distributed gaps with shape ``burstiness`` and mean ``1 / rate`` (``vllm bench serve``'s
convention): burstiness 1 is a Poisson process, below 1 is burstier, above 1 is more even.
"""

from __future__ import annotations

import math

import numpy as np


def open_loop_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Start times in seconds from 0 of ``num`` sessions arriving at ``rate`` per second; the
    first arrives at 0. ``rate`` inf sends them all at once."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not rate > 0:
        raise ValueError(f"rate must be positive (inf: all at once), got {rate}")
    if not 0 < burstiness < math.inf:
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    if num == 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
