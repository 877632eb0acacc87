"""``kvswitch worker`` whose serving loop blocks once: a real worker process whose event loop is
held up by a synchronous sleep, as a long CPU-bound step in the serving process would hold it.
Run as ``python tests/slow_worker.py worker ARGS``.

- ``KVSWITCH_TEST_HOLD_FILE``: a path. The first request's stream waits, the loop free (load polls
  answered), before its first chunk until the file exists; then
- ``KVSWITCH_TEST_BLOCK_S``: the serving loop blocks this long (``time.sleep``: nothing runs in
  it, load polls included), once, and the stream goes on.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from kvswitch.app.cli import main
from kvswitch.worker import servicer


def hold_then_block() -> None:
    hold_file = Path(os.environ["KVSWITCH_TEST_HOLD_FILE"])
    block_s = float(os.environ["KVSWITCH_TEST_BLOCK_S"])
    next_outputs = servicer._next_outputs
    blocked = [False]

    async def held_next_outputs(queue, *args):
        if not blocked[0]:
            blocked[0] = True
            while not hold_file.exists():
                await asyncio.sleep(0.01)
            time.sleep(block_s)  # NOTE: on purpose, in the event loop
        return await next_outputs(queue, *args)

    servicer._next_outputs = held_next_outputs


if __name__ == "__main__":
    hold_then_block()
    sys.exit(main(sys.argv[1:]))
