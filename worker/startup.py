"""Where a worker's start goes: its processes' ages, for the startup lines they log.

The serving process logs, once it serves, how long it took since its process began (the
interpreter, imports, parsing: ``startup_imports_s``; the engine core: ``startup_engine_core_s``);
the engine core logs the same for its own process once its engine is built. ``kvswitch bench
startup`` reads both lines; docs/WORKER.md says what the figures were.
"""

from __future__ import annotations

import os


def process_age_s() -> float | None:
    """Seconds since this process began (to 10 ms on Linux); None where /proc cannot say."""
    try:
        with open("/proc/self/stat") as f:
            # NOTE: the fields after the parenthesized command name, which may hold spaces;
            # the start time (field 22) is in clock ticks since boot.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
