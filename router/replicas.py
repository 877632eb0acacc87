"""Router replicas that route as one: each tells the others what it routed, over Redis pub/sub.

Several routers in front of one fleet (``kvswitch router --processes N``, or routers on several
hosts sharing one Redis index) each see part of the traffic. Alone, a router counts only its own
requests in flight on a worker and guesses only its own prompts' blocks (``router/pending.py``):
two routers that see a burst on one document each pick a worker to prefill it on, and each
sends its share to a holder the other has already loaded. So every router publishes, on one
channel of the index's Redis, what changes the others' choices, and applies what they publish:

    message   {"v": 1, "router": <its id>, "items": [item, ...]}          one msgpack map
    "route"     {"worker", "chain": <16-byte block hashes, joined>, "guess": bool}
                a request went there: its blocks soon will be (unless "guess" is false: its
                prefix is on its way from a peer), its prefix counts as asked for (heat), and
                the rotation over tied workers moves on
    "inflight"  {"worker", "requests", "prefill", "output"}: what the sender's requests in flight
                there changed by: a request began (1, its uncached prompt tokens, the output
                tokens it may produce), was prefilled (0, minus its prompt tokens) or ended
                (minus 1); the output tokens streamed there since the last item, taken off
    "withdraw"  {"worker", "chain"}: a route's request will not run there after all
    "confirm"   {"worker", "end": <the chain's last hash>}: the index now lists a guess's
                blocks there, so the guess goes (else the others' copies would outlive it: if
                the blocks were evicted meanwhile, they would still count them as held)
    "load"      {"loads": {worker: [requests, prefill, output]}}: the sum of the sender's
                "inflight" items so far, every ``heartbeat_s``: it replaces what the others
                summed, so one lost message is not counted for ever
    "hello"     a router started; the others answer "state"
    "state"     {"to": <the hello's router>, "guesses": [[worker, chain, seconds left], ...]}:
                the sender's live guesses, for the router that said hello
    "bye"       the sender stops: its load is dropped at once (else after ``peer_timeout_s``)

Each key is the item's ``"k"``. Items apply in order (one publisher's messages arrive in the
order sent); unknown kinds and fields are ignored, a later major version is ignored whole. A
router's own messages come back to it and are skipped.

What it costs: a request adds four items (about 200 bytes and its chain's 16 bytes a block):
"route" and "inflight" as it is routed, one "inflight" at its first token and one as it ends
(its output tokens between go out with those, or in the next "load");
the items of one event-loop turn go out in one PUBLISH, and every other router applies them (a
guess and a heat count, as for its own request, and three sums).

Consistency is eventual: two routers that route at the same moment (within about the channel's
delivery time, a millisecond or less on one network) do not see each other's choice; a request
that arrives after another was routed sees it. The others hear of a request's output tokens
with the next item about its worker, or within ``heartbeat_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvswitch.cache_index.connect import pubsub_client
from kvswitch.cache_index.hashing import HASH_BYTES
from kvswitch.cache_index.redis_clients import keeping_cancel
from kvswitch.logs import Throttled
from kvswitch.serving import cancel_and_wait

if TYPE_CHECKING:
    from kvswitch.router.router import Router

logger = logging.getLogger(__name__)

VERSION = 1
CHANNEL_SUFFIX = ":routers"  # the channel is the index's key prefix and this
RECONNECT_S = 0.5
SUBSCRIBE_TIMEOUT_S = 5.0

Loads = dict[str, tuple[int, int, int]]  # worker id -> requests, prefill tokens, output tokens


@dataclass(frozen=True)
class ReplicaConfig:
    heartbeat_s: float = 0.1  # how often a router publishes its own load
    peer_timeout_s: float = 1.0  # a router not heard from this long is gone: its load dropped

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.peer_timeout_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be positive and under peer_timeout_s "
                f"({self.peer_timeout_s})"
            )


@dataclass
class _Peer:
    """Another router, as its messages tell: its requests in flight per worker, as of its last
    "load" and the "inflight" items since."""

    heard_s: float
    loads: dict[str, list[int]] = field(default_factory=dict)


def join_chain(block_hashes: Sequence[bytes]) -> bytes:
    return b"".join(block_hashes)


def split_chain(chain: bytes) -> list[bytes]:
    if len(chain) % HASH_BYTES:
        raise ValueError(f"a chain is {HASH_BYTES}-byte hashes, got {len(chain)} bytes")
    return [chain[i : i + HASH_BYTES] for i in range(0, len(chain), HASH_BYTES)]


class ReplicaSync:
    """This router's side of the channel: ``routed``, ``withdrawn`` and ``began`` queue what the
    others must hear (published once per event-loop turn); what they publish updates this
    router's pending guesses, prefix heat and the peer load of each worker handle."""

    def __init__(
        self,
        redis: Redis,
        channel: str,
        router: Router,
        config: ReplicaConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_id = uuid.uuid4().hex[:12]
        self.channel = channel
        self.config = config or ReplicaConfig()
        self._redis = redis
        self._router = router
        self._clock = clock
        self._items: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._peers: dict[str, _Peer] = {}
        # This router's requests in flight, per worker: what its "load" says. Output tokens
        # come in it before they go out in an "inflight" item.
        self._ledger: dict[str, list[int]] = {}
        self._unsent_output: dict[str, int] = {}  # per worker: not in an item yet
        self._tasks: list[asyncio.Task] = []
        self._state_taken = False  # a "state" answer to this router's "hello" was applied
        self._warning = Throttled(logger)
        self.num_published = 0  # messages
        self.num_applied = 0  # the others' messages applied
        self.num_routes_applied = 0  # their "route" items
        self.num_inflight_applied = 0  # their "inflight" items
        self.num_guesses_taken = 0  # guesses taken from another router's "state" on starting
        self.num_errors = 0  # publishes and subscriptions that failed

    @classmethod
    def for_router(
        cls, url: str, prefix: str, router: Router, config: ReplicaConfig | None = None
    ) -> ReplicaSync:
        """The sync of routers sharing the Redis index at ``url`` (its password as the index
        takes it; a Redis Cluster URL names one of its nodes, and pub/sub reaches every node)
        and the index prefix ``prefix``."""
        return cls(pubsub_client(url), prefix + CHANNEL_SUFFIX, router, config)

    @property
    def num_peers(self) -> int:
        """Other routers heard from within ``peer_timeout_s``."""
        return len(self._peers)

    async def start(self) -> None:
        """Subscribe (the channel answers before this returns), say hello, start publishing."""
        pubsub = self._redis.pubsub()
        # NOTE: a pub/sub's commands are not the client's: keeping_cancel (see redis_clients).
        await keeping_cancel(pubsub.subscribe(self.channel))
        # NOTE: the answer read now, so that a channel this user may not use fails the start.
        deadline_s = self._clock() + SUBSCRIBE_TIMEOUT_S
        while (await pubsub.get_message(timeout=0.1) or {}).get("type") != "subscribe":
            if self._clock() > deadline_s:
                await pubsub.aclose()
                raise TimeoutError(f"no answer to SUBSCRIBE {self.channel}")
        pubsub.ignore_subscribe_messages = True
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._receive(pubsub), name="replicas-receive"),
            loop.create_task(self._publish_forever(), name="replicas-publish"),
            loop.create_task(self._heartbeat_forever(), name="replicas-heartbeat"),
        ]
        self.hello()

    def hello(self) -> None:
        """Ask the other routers for their guesses (they answer with "state")."""
        self._state_taken = False
        self._queue({"k": "hello"})

    async def close(self) -> None:
        """Close the connections, saying nothing (``start`` failed, or never ran)."""
        await self._redis.aclose()

    async def stop(self) -> None:
        """Say bye (the others drop this router's load at once) and close."""
        await cancel_and_wait(self._tasks)
        self._tasks = []
        self._items.append({"k": "bye"})
        with contextlib.suppress(RedisError, OSError):
            await self._flush()
        await self._redis.aclose()

    # -- what this router did ----------------------------------------------------------------

    def routed(self, worker_id: str, block_hashes: Sequence[bytes], guessed: bool) -> None:
        self._queue(
            {"k": "route", "worker": worker_id, "chain": join_chain(block_hashes), "guess": guessed}
        )

    def confirmed(self, worker_id: str, last_hash: bytes) -> None:
        self._queue({"k": "confirm", "worker": worker_id, "end": last_hash})

    def withdrawn(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        self._queue({"k": "withdraw", "worker": worker_id, "chain": join_chain(block_hashes)})

    def load_changed(
        self,
        worker_id: str,
        num_requests: int,
        num_prefill_tokens: int,
        num_output_tokens: int,
        urgent: bool,
    ) -> None:
        """This router's requests in flight on ``worker_id`` changed by these counts (the
        directory's ``on_load``). An urgent change goes out now, with the output tokens come
        there since the last; the others wait for it or the next "load"."""
        counts = self._ledger.setdefault(worker_id, [0, 0, 0])
        counts[0] += num_requests
        counts[1] += num_prefill_tokens
        counts[2] += num_output_tokens
        if counts == [0, 0, 0]:
            del self._ledger[worker_id]
        num_output_tokens += self._unsent_output.pop(worker_id, 0)
        if not urgent:
            self._unsent_output[worker_id] = num_output_tokens
            return
        self._queue(
            {
                "k": "inflight",
                "worker": worker_id,
                "requests": num_requests,
                "prefill": num_prefill_tokens,
                "output": num_output_tokens,
            }
        )

    # -- what the others did ------------------------------------------------------------------

    def apply(self, message: bytes) -> None:
        """One message from the channel (this router's own skipped); ValueError for one that
        is not a message of this format."""
        try:
            body = msgpack.unpackb(message)
        except (msgpack.UnpackException, ValueError) as e:
            raise ValueError(f"not a msgpack map: {e}") from e
        if not isinstance(body, dict):
            raise ValueError("not a msgpack map")
        if body.get("v", VERSION) > VERSION:
            self._warning.warning("a router speaks version %s of the replica channel", body["v"])
            return
        sender = body.get("router")
        if sender == self.router_id or not isinstance(sender, str):
            return
        peer = self._peers.get(sender)
        if peer is None:
            peer = self._peers[sender] = _Peer(self._clock())
            logger.info("router replica %s joined", sender)
        peer.heard_s = self._clock()
        for item in body.get("items", ()):
            self._apply_item(sender, peer, item)
        self.num_applied += 1

    def _apply_item(self, sender: str, peer: _Peer, item: dict[str, Any]) -> None:
        kind = item.get("k")
        router = self._router
        if kind == "route":
            block_hashes = split_chain(item["chain"])
            if item.get("guess", True):
                router.pending.add(item["worker"], block_hashes)
            router.heat.record(block_hashes)
            router.num_routed += 1
            self.num_routes_applied += 1
        elif kind == "inflight":
            counts = (item.get("requests", 0), item.get("prefill", 0), item.get("output", 0))
            worker_load = peer.loads.setdefault(item["worker"], [0, 0, 0])
            for i, count in enumerate(counts):
                worker_load[i] += count
            router.directory.peer_load(item["worker"]).add(*counts)
            self.num_inflight_applied += 1
        elif kind == "withdraw":
            router.pending.discard(item["worker"], split_chain(item["chain"]))
        elif kind == "confirm":
            router.pending.confirmed(item["worker"], item["end"])
        elif kind == "load":
            self._drop_load(peer)
            peer.loads = {w: list(counts) for w, counts in item.get("loads", {}).items()}
            for worker_id, counts in peer.loads.items():
                router.directory.peer_load(worker_id).add(*counts)
        elif kind == "hello":
            self._answer_hello(sender)
        elif kind == "state" and item.get("to") == self.router_id and not self._state_taken:
            # NOTE: every router answers a hello with the same guesses; one answer is enough.
            self._state_taken = True
            for worker_id, chain, ttl_s in item.get("guesses", ()):
                if ttl_s > 0:
                    router.pending.add(worker_id, split_chain(chain), ttl_s)
                    self.num_guesses_taken += 1
        elif kind == "bye":
            self._forget(sender)

    def _answer_hello(self, sender: str) -> None:
        guesses = [
            [worker_id, join_chain(chain), ttl_s]
            for worker_id, chain, ttl_s in self._router.pending.live()
        ]
        self._queue({"k": "state", "to": sender, "guesses": guesses})

    def _drop_load(self, peer: _Peer) -> None:
        for worker_id, counts in peer.loads.items():
            self._router.directory.peer_load(worker_id).add(*(-count for count in counts))
        peer.loads = {}

    def _forget(self, sender: str) -> None:
        peer = self._peers.pop(sender, None)
        if peer is not None:
            self._drop_load(peer)
            logger.info("router replica %s left", sender)

    def expire_peers(self) -> None:
        """Forget the routers not heard from within ``peer_timeout_s`` (stopped without a bye,
        or cut off)."""
        deadline_s = self._clock() - self.config.peer_timeout_s
        for sender in [s for s, peer in self._peers.items() if peer.heard_s < deadline_s]:
            self._forget(sender)

    # -- the channel --------------------------------------------------------------------------

    def _queue(self, item: dict[str, Any]) -> None:
        self._items.append(item)
        self._wake.set()

    def take_message(self) -> bytes | None:
        """The items queued so far as one message (what the next publish sends); None if
        there are none."""
        items, self._items = self._items, []
        if not items:
            return None
        return msgpack.packb({"v": VERSION, "router": self.router_id, "items": items})

    def heartbeat(self) -> None:
        """Forget the routers gone quiet and queue this router's "load"."""
        self.expire_peers()
        # NOTE: a copy: the items queued after this one must not show in it.
        loads = {worker_id: list(counts) for worker_id, counts in self._ledger.items()}
        self._unsent_output.clear()
        self._queue({"k": "load", "loads": loads})

    async def _flush(self) -> None:
        message = self.take_message()
        if message is not None:
            await self._redis.publish(self.channel, message)
            self.num_published += 1

    async def _publish_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._flush()
            except (RedisError, OSError) as e:
                # NOTE: lost, not retried: the next "load" corrects the others' counts, and
                # guesses are short-lived anyway.
                self.num_errors += 1
                self._warning.warning("cannot publish to the other routers: %s", e)

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            self.heartbeat()

    async def _receive(self, pubsub: Any) -> None:
        while True:
            try:
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    try:
                        self.apply(message["data"])
                    except (ValueError, KeyError, TypeError) as e:
                        self._warning.warning("a malformed message on %s: %s", self.channel, e)
            except (RedisError, OSError) as e:
                self.num_errors += 1
                self._warning.warning("lost the other routers' channel (%s); resubscribing", e)
                await asyncio.sleep(RECONNECT_S)
                with contextlib.suppress(RedisError, OSError):
                    await keeping_cancel(pubsub.subscribe(self.channel))
                    self.hello()
