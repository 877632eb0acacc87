"""KV events published the way a vLLM engine publishes them (``--kv-events-config``), so that
any router that reads vLLM's events can follow a kvswitch worker, and kvswitch's own feed can be
tested against the protocol.

    PUB    (endpoint)         one message a batch: [topic, seq (8 bytes, big-endian), payload]
    ROUTER (replay_endpoint)  a DEALER sends [b"", start seq]; it gets every batch still held
                              from there, [b"", topic, seq, payload], then [b"", topic, -1, b""]

The PUB socket binds where the endpoint has ``*``, ``::``, ``ipc://`` or ``inproc://`` and
connects otherwise; data-parallel rank r publishes on port base + r (both sockets). Sequence
numbers count from 0 in each publisher: a restarted one starts again at 0. The last
``buffer_steps`` batches are held for replay. One thread owns both sockets; ``publish`` only
queues.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvswitch.cache_index.vllm_events import EngineEvent, EngineEventBatch, encode_batch
from kvswitch.security import is_loopback

logger = logging.getLogger(__name__)

END_SEQ_BYTES = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: vLLM's field names and defaults (one JSON object). Publishing is
    on with ``enable_kv_cache_events``; ``publisher`` is "zmq" then, "null" otherwise."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher is zmq or null, not {self.publisher!r}")
        if self.buffer_steps <= 0 or self.hwm < 0:
            raise ValueError("kv_events_config: buffer_steps must be positive and hwm >= 0")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """ValueError naming what is wrong: not a JSON object, or a field vLLM does not have."""
        if not text:
            return cls()
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError(
                "kv_events_config is a JSON object, e.g. "
                '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}'
            )
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"kv_events_config: unknown fields {', '.join(unknown)}")
        return cls(**fields)

    def exposed_endpoints(self) -> list[str]:
        """The endpoints it binds beyond this machine (events carry prompts' tokens, in the
        clear, to whoever connects); none when it does not publish."""
        if not self.publishes:
            return []
        endpoints = [
            e for e in (self.endpoint, self.replay_endpoint or "") if e.startswith("tcp://")
        ]
        exposed = []
        for endpoint in endpoints:
            host = endpoint.removeprefix("tcp://").rpartition(":")[0]
            if (endpoint == self.replay_endpoint or binds(endpoint)) and not is_loopback(host):
                exposed.append(endpoint)
        return exposed


def offset_port(endpoint: str, rank: int) -> str:
    """``endpoint`` for data-parallel rank ``rank``: a TCP port moved up by it, an in-process
    name suffixed."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"a data-parallel rank needs a tcp:// or inproc:// endpoint, not {endpoint!r}")


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str = "",
        *,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be positive, got {buffer_steps}")
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[EngineEventBatch | int | None] = queue.SimpleQueue()
        self._next_seq = 0
        self._num_to_lose = 0
        # NOTE: a context of its own unless given one, ended by close(): its ports are free once
        # close returns (a restarted publisher binds them again).
        self._own_context = context is None
        context = context or zmq.Context()
        self._context = context
        # NOTE: XPUB sends as PUB does and hears each subscription, so that a caller can wait
        # for a subscriber before publishing (a batch sent before one is heard goes nowhere).
        self._pub = context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._num_subscriptions = 0
        self._subscribed = threading.Condition()
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.IPV6, 1)  # NOTE: tcp://[::1]:PORT, loopback only
        self._pub.set_hwm(hwm)
        endpoint = offset_port(endpoint, data_parallel_rank)
        if binds(endpoint):
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self._replay: zmq.Socket | None = None
        self.replay_endpoint = ""
        if replay_endpoint:
            self._replay = context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.IPV6, 1)
            self._replay.bind(offset_port(replay_endpoint, data_parallel_rank))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[EngineEvent], ts: float | None = None) -> None:
        """Queue one batch (a step's events); numbered and sent in order by the thread."""
        batch = EngineEventBatch(
            time.time() if ts is None else ts, tuple(events), self.data_parallel_rank
        )
        self._queue.put(batch)

    def lose(self, num_batches: int) -> None:
        """Hold the next ``num_batches`` published for replay without sending them: what a
        subscriber that dropped them sees (fault injection, for tests)."""
        self._queue.put(num_batches)

    def wait_subscribed(self, num_subscriptions: int = 1, timeout_s: float = 30.0) -> bool:
        """Whether ``num_subscriptions`` subscriptions (one per subscriber, again after each
        reconnection) were heard within ``timeout_s``: batches published after one is heard
        reach that subscriber."""
        with self._subscribed:
            return self._subscribed.wait_for(
                lambda: self._num_subscriptions >= num_subscriptions, timeout_s
            )

    def close(self) -> None:
        """Send what is queued, then close both sockets."""
        self._queue.put(None)
        self._thread.join(timeout=10)
        if self._own_context:
            self._context.term()

    def _serve(self) -> None:
        try:
            while True:
                while self._pub.poll(0):
                    self._hear_subscription(self._pub.recv())
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._answer_replay()
                try:
                    batch = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                if isinstance(batch, int):
                    self._num_to_lose = batch
                    continue
                seq, payload = self._next_seq, encode_batch(batch)
                self._next_seq += 1
                if self._num_to_lose:
                    self._num_to_lose -= 1
                else:
                    self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
                self._buffer.append((seq, payload))
        except Exception:
            logger.exception("the KV event publisher failed")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _hear_subscription(self, message: bytes) -> None:
        if message[:1] == b"\x01":  # NOTE: b"\x00" + topic is an unsubscription
            with self._subscribed:
                self._num_subscriptions += 1
                self._subscribed.notify_all()

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("a replay request of %d frames: ignored", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                )
        self._replay.send_multipart([client, b"", self._topic, END_SEQ_BYTES, b""])
