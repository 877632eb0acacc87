"""The arrival-rate scale at which a fleet is busy to a given degree, found by bisection.

Load is set by one policy, ``round_robin``, whose placement ignores the fleet's state: its mean
worker utilization rises with the rate (not quite in proportion: bigger decode batches cost less
per token). The search brackets the target, stepping along the line through its last two runs
(in log scale), then narrows the bracket, trying the point its two ends interpolate to but never
outside the bracket's middle half, so that it shrinks by a quarter at least each run.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

from kvswitch.loadtest.sim import PolicyRun, SimConfig, SimRequest, simulate

UTILIZATION_TOLERANCE = 0.005
MAX_RUNS = 24
_MAX_STEP = math.log(8)  # most a scale moves in one run before the target is bracketed
_LOAD_POLICY = "round_robin"


class RateSearchError(ValueError):
    """No rate scale gives the target utilization."""


def find_rate_scale(
    requests: Sequence[SimRequest],
    config: SimConfig,
    target: float,
    *,
    tolerance: float = UTILIZATION_TOLERANCE,
    max_runs: int = MAX_RUNS,
    quiet: bool = False,
) -> PolicyRun:
    """The ``round_robin`` run whose mean utilization is within ``tolerance`` of ``target``;
    its ``rate_scale`` is the scale found."""
    if not 0 < target < 1:
        raise ValueError(f"the target utilization must be in (0, 1), got {target}")
    below: tuple[float, float] | None = None  # (log scale, utilization) under the target
    above: tuple[float, float] | None = None
    last: tuple[float, float] | None = None  # the run before, while not bracketed
    log_scale = 0.0
    for _ in range(max_runs):
        run = simulate(requests, config, _LOAD_POLICY, math.exp(log_scale))
        utilization = run.utilization
        if not quiet:
            print(
                f"  rate scale {run.rate_scale:.4g}: {_LOAD_POLICY} utilization {utilization:.4f}",
                file=sys.stderr,
            )
        if abs(utilization - target) <= tolerance:
            return run
        if utilization < target:
            below = (log_scale, utilization)
        else:
            above = (log_scale, utilization)
        if below is None or above is None:
            step = _MAX_STEP
            if last is not None and utilization != last[1]:
                # The line through the last two runs: utilization bends below proportional.
                step = (target - utilization) * (log_scale - last[0]) / (utilization - last[1])
            elif utilization > 0:
                step = math.log(target / utilization)
            last = (log_scale, utilization)
            if step <= 0 < target - utilization or step >= 0 > target - utilization:
                step = math.copysign(_MAX_STEP, target - utilization)  # the line points away
            log_scale += min(max(step, -_MAX_STEP), _MAX_STEP)
            if abs(log_scale) > math.log(1e6):
                raise RateSearchError(
                    f"{_LOAD_POLICY}'s mean utilization stays at {utilization:.3f} however "
                    f"the rate is scaled; {target} cannot be reached"
                )
            continue
        (x0, u0), (x1, u1) = below, above
        low, high = min(x0, x1), max(x0, x1)
        guess = x0 + (target - u0) * (x1 - x0) / (u1 - u0)
        quarter = (high - low) / 4
        log_scale = min(max(guess, low + quarter), high - quarter)
    raise RateSearchError(
        f"no rate scale within {tolerance} of utilization {target} after {max_runs} runs"
    )
