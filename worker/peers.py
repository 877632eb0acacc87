"""Which peers a worker takes KV blocks from: the live workers of its own model in the block
index, and no other address, whoever names it.

A request's ``kv_source`` names the worker to pull its prompt's blocks from; the worker dials that
address with the fleet's credentials and caches what comes back under the prompt's real hashes,
which the index then advertises to every router. An address outside the fleet could hand it
garbage for a popular prompt, so the worker checks the address against the index first::

    kv_source.peer_address --> in the live workers read < MAX_AGE_S ago? -- yes --> pull
                                    | no
                                    v
                               read the index again (one read for all who wait) --> in? pull
                                                                                    not: refuse

The addresses are remembered for ``MAX_AGE_S``, so a burst of handoffs costs one index read, and
read again on a miss, so a prefill worker that just registered is found.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvswitch.cache_index.index import BlockIndex

logger = logging.getLogger(__name__)

MAX_AGE_S = 1.0  # how long a reading of the live workers answers for


class PeerRefused(Exception):
    """The address is not a live worker of this worker's model; the message says why."""


class FleetPeers:
    """The addresses of the live workers serving ``namespace``, read from the index that
    ``index_of`` returns (None: this worker publishes to no index, so it has no fleet)."""

    def __init__(
        self,
        index_of: Callable[[], BlockIndex | None],
        namespace: str,
        *,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index_of = index_of
        self._namespace = namespace
        self._max_age_s = max_age_s
        self._clock = clock
        self._addresses: frozenset[str] = frozenset()
        self._read_at_s = -float("inf")
        self._reading: asyncio.Task[None] | None = None  # the read that callers wait on

    async def check(self, address: str) -> None:
        """Return if ``address`` is a live worker of this fleet's model; ``PeerRefused`` if not,
        or if the index cannot say (this worker has none, or it cannot be read)."""
        if address in self._addresses and self._clock() - self._read_at_s < self._max_age_s:
            return
        index = self._index_of()
        if index is None:
            raise PeerRefused(
                f"this worker publishes to no block index (--index), so it has no fleet to take "
                f"KV blocks from; refused {address}"
            )
        failure = await self._read(index)
        if address in self._addresses:
            return
        if failure:
            raise PeerRefused(
                f"{address} is not among the live workers this worker last read from its index, "
                f"and the index cannot be read now ({failure})"
            )
        raise PeerRefused(
            f"{address} is not a live worker of model {self._namespace!r} in this worker's "
            "block index; a worker takes KV blocks only from those"
        )

    async def _read(self, index: BlockIndex) -> str:
        """Read the live workers again, or wait for the read already under way; what went
        wrong, or "" (the last good reading is kept when one fails)."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.get_running_loop().create_task(self._read_now(index))
            # NOTE: retrieved here too, for a read whose every waiter was cancelled.
            self._reading.add_done_callback(lambda task: task.cancelled() or task.exception())
        # NOTE: shielded: a caller that gives up (its RPC cancelled) does not cancel the read
        # the others wait on.
        try:
            await asyncio.shield(self._reading)
        except index.unavailable_errors as e:
            logger.warning("cannot read the live workers to check a KV peer: %s", e)
            return str(e) or type(e).__name__
        return ""

    async def _read_now(self, index: BlockIndex) -> None:
        workers = await index.live_workers(self._namespace)
        self._addresses = frozenset(w.address for w in workers if w.namespace == self._namespace)
        self._read_at_s = self._clock()
