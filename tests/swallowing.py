"""A call that hangs and turns its caller's cancellation into an ordinary error, or into a
normal return, once: what a client library's own timeout may do to a background loop's stop."""

from __future__ import annotations

import asyncio


class SwallowsCancellationOnce:
    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.entered = asyncio.Event()
        self.swallowed = False

    async def __call__(self) -> None:
        """Hang until cancelled; raise ``error`` for the first cancellation (return, where it is
        None), and let any later one through (so a loop that does not stop still ends when the
        test cleans up)."""
        self.entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if self.swallowed:
                raise
            self.swallowed = True
            if self.error is not None:
                raise self.error from None
