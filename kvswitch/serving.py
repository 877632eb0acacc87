"""What every kvswitch server process shares: its event loop, its stop signals, its address."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Coroutine, Iterable
from typing import Any

# A server prints "kvswitch <what> listening on ADDRESS" on stdout once it serves; whoever
# launched it reads the address from that line.
READY_MARK = "listening on "

# request_id, lora and cache_salt are names, not payloads: this many characters at most, all
# printable (they reach log lines, where a newline would forge a line of its own). The router
# refuses others; the client SDK checks them before sending.
MAX_NAME_CHARS = 256


def check_name(field: str, value: str) -> None:
    """ValueError naming ``field`` unless ``value`` is a name a request may carry."""
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{field} must be at most {MAX_NAME_CHARS} characters, got {len(value)}")
    if not value.isprintable():
        raise ValueError(f"{field} must be printable characters, got {value!r}")


# Trailing metadata of a RESOURCE_EXHAUSTED from an overloaded router or worker: the least a
# caller should wait before trying it again, in milliseconds.
RETRY_AFTER_KEY = "retry-after-ms"
_RECANCEL_S = 0.1  # how often ``cancel_and_wait`` cancels again a task that ran on


def retry_after_ms(trailing_metadata: Any) -> int:
    """The wait a RESOURCE_EXHAUSTED asked for in its trailing metadata; 0 if none (or garbled)."""
    for key, value in trailing_metadata or ():
        if key == RETRY_AFTER_KEY:
            return int(value) if isinstance(value, str) and value.isdigit() else 0
    return 0


# Between kvswitch processes (router to worker, worker to worker): a ping every second when
# the connection is quiet, and any ping (those, or the ones gRPC sends on its own while data
# flows) unanswered for a second ends it. A link that dies silently (a cable, a cut network, a
# host that froze: no RST ever comes) then fails its calls within about 2 s instead of leaving
# them hanging until their deadline (tests/deploy/test_multihost.py cuts one).
KEEPALIVE_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    # NOTE: gRPC 1.85 ends a connection on this timeout, not on keepalive_timeout_ms alone: without
    # it a frozen peer (SIGSTOP) held a stream 29 s, until its 30 s deadline. A peer
    # whose serving loop is only busy still answers pings (gRPC's own threads ACK them: a 4 s
    # block, asleep or spinning with the GIL held, kept its stream), so this tells frozen from busy.
    ("grpc.http2.ping_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # NOTE: a server-streaming call sends no data after its request; without this, gRPC may
    # wait minutes between two pings of such a connection.
    ("grpc.http2.min_time_between_pings_ms", 1000),
]
# What a server must allow for those pings (by default it answers pings more often than every
# 5 minutes with GOAWAY).
KEEPALIVE_SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
]


def announce_ready(what: str, address: str) -> None:
    """Print the line that tells a launcher this server is up and where."""
    print(f"kvswitch {what} {READY_MARK}{address}", flush=True)


def start_server_process(
    args: list[str], prefix: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Run ``kvswitch ARGS`` (a server command) in a process of its own, its stderr dropped, and
    return it with its address once it says it serves; RuntimeError if it exits first.
    ``prefix``: a command that runs it (``ip netns exec NAME``, say)."""
    popen = subprocess.Popen(
        [*(prefix or []), sys.executable, "-m", "kvswitch.app.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert popen.stdout is not None
    for line in popen.stdout:
        if READY_MARK in line:
            return popen, line.split(READY_MARK, 1)[1].strip()
    popen.wait()
    raise RuntimeError(f"kvswitch {' '.join(args)} exited with {popen.returncode} before serving")


async def wait_for_stop_signal() -> None:
    """Return at the first SIGINT or SIGTERM. A second one then interrupts the shutdown, in
    case it hangs."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)


def end_if_cancelled() -> None:
    """Raise CancelledError if the running task itself is being cancelled.

    A background loop calls this after a round that caught an error: a client library may have
    turned the loop's own cancellation into a timeout or a connection error, and asyncio delivers
    a cancellation once, so a loop that went on would never end (and its stop would wait on it).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again any that ran on:
    asyncio delivers a cancellation once, and a task that swallowed it (a client library may
    catch it on its way out of a call) would otherwise keep its stop waiting for ever. What the
    tasks raised is retrieved and dropped."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        # NOTE: the timeout only paces the cancels; every task ends before this returns.
        done, pending = await asyncio.wait(pending, timeout=_RECANCEL_S)
        for task in done:
            if not task.cancelled():
                task.exception()


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop where it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
