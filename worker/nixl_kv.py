"""One engine's KV cache behind a NIXL agent: peers read its blocks one-sided, with no part
taken by its Python code.

    holder                                        reader
      NixlKVAgent(kv_caches)                        NixlKVAgent(kv_caches)
        registers each layer's key and value          (its own cache, registered the same way)
      peer_info().to_bytes()  -------------------->   NixlPeerInfo.from_bytes(...)
                                                      read_blocks(peer, peer_ids, block_ids):
                                                        layouts equal? (else ValueError)
                                                        the peer's agent added once (by name)
                                                        one READ: per layer, key then value, a
                                                        descriptor per run of consecutive ids
      UCX's progress thread serves the read  <-----     waits (a timeout), releases the handle
                                                      post_read(...): the same, not waiting;
                                                        its poll() says when it is over

NIXL is an extra (``pip install 'kvswitch[nixl]'``, the ``nixl-cu12`` wheel): this module imports
without it, and ``NixlKVAgent`` raises ``NixlUnavailable`` naming the extra. A cache lives in
DRAM on the CPU, in VRAM on a GPU; each per-layer tensor is ``[num_blocks, block_size,
num_kv_heads, head_dim]``, contiguous, so block ``b`` of a tensor is ``bytes_per_tensor_block``
bytes at ``base + b * bytes_per_tensor_block``.

``UCX_TLS`` is left to the user: unset, UCX chooses per peer (CMA between processes of one host,
TCP or RDMA between hosts, CUDA transports for VRAM). No setting measured faster on one host
(docs/BENCHMARKS.md), and each one tried shuts out a transport some peer needs; what each needs
of a container: docs/DISAGGREGATION.md.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from kvswitch.worker.kv_layout import KVLayout

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'kvswitch[nixl]' (the nixl-cu12 wheel)"
# The modules NIXL's Python API comes as: the CUDA 12 wheel's, then the one other wheels install.
_MODULES = ("nixl_cu12._api", "nixl._api")
DEFAULT_TIMEOUT_S = 10.0
# The longest a worker's read may run: the holder holds the blocks ``block_transfer``'s
# MAPPED_HOLD_S (10 s) from its answer, and a read must be over, or cancelled, before the holder
# may reuse them.
MAX_READ_S = 9.0
INFO_FORMAT = "kvswitch-nixl-kv"
INFO_VERSION = 1
# A transfer still running is polled at first at once, then less and less often, up to this.
_MAX_POLL_PAUSE_S = 1e-3


class NixlUnavailable(ImportError):
    """NIXL's Python package is not installed (or does not load)."""


class NixlTransferError(RuntimeError):
    """A read from a peer failed or ran past its timeout: the local blocks it was to fill hold
    unknown bytes."""


def load_nixl() -> ModuleType:
    """NIXL's Python API module; ``NixlUnavailable``, naming the extra to install, if none
    imports."""
    reasons = []
    for name in _MODULES:
        raise_exceptions = logging.raiseExceptions  # NOTE: NIXL's logging setup turns it off
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            reasons.append(f"{name}: {e}")
            continue
        finally:
            logging.raiseExceptions = raise_exceptions
        _quiet_nixl_logger()
        return module
    raise NixlUnavailable(f"NIXL is not installed: {INSTALL_HINT} ({'; '.join(reasons)})")


def nixl_installed() -> bool:
    """Whether a NIXL package is installed, without importing it (a serving process asks; its
    engine core imports it)."""
    return any(importlib.util.find_spec(name.split(".")[0]) for name in _MODULES)


def nixl_available() -> bool:
    try:
        load_nixl()
    except NixlUnavailable:
        return False
    return True


def _quiet_nixl_logger() -> None:
    # NOTE: NIXL's logger writes INFO lines to stdout, where a command's JSON goes: it speaks
    # through ours instead (stderr), warnings and worse unless NIXL_LOG_LEVEL says otherwise.
    nixl_logger = logging.getLogger("nixl")
    nixl_logger.handlers.clear()
    nixl_logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def coalesce_runs(peer_block_ids: Sequence[int], block_ids: Sequence[int]) -> np.ndarray:
    """Runs of consecutive pairs whose ids both go up by one, as rows ``(peer_start, start,
    num_blocks)`` (int64), in the pairs' order: each run becomes one descriptor per tensor.

    ``peer 7 8 9 2 3 -> local 0 1 2 5 6`` is ``[(7, 0, 3), (2, 5, 2)]``."""
    if len(peer_block_ids) != len(block_ids):
        raise ValueError(f"{len(peer_block_ids)} peer block ids for {len(block_ids)} block ids")
    peer_ids = np.asarray(peer_block_ids, dtype=np.int64)
    ids = np.asarray(block_ids, dtype=np.int64)
    if not len(ids):
        return np.empty((0, 3), np.int64)
    breaks = (np.diff(peer_ids) != 1) | (np.diff(ids) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.append(starts, len(ids)))
    return np.stack((peer_ids[starts], ids[starts], lengths), axis=1)


@dataclasses.dataclass(frozen=True, slots=True)
class NixlPeerInfo:
    """What a reader needs to read a holder's blocks: its agent (name, NIXL metadata), its
    layout and where each tensor starts. Crosses processes as ``to_bytes`` (JSON: fields it
    does not know are ignored; another ``version`` is refused)."""

    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    num_blocks: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int  # the GPU's index; 0 for DRAM
    key_addrs: tuple[int, ...]  # per layer, the key tensor's first byte
    value_addrs: tuple[int, ...]

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": INFO_FORMAT,
                "version": INFO_VERSION,
                "agent_name": self.agent_name,
                "agent_metadata": base64.b64encode(self.agent_metadata).decode(),
                "layout": dataclasses.asdict(self.layout),
                "num_blocks": self.num_blocks,
                "mem_type": self.mem_type,
                "device_id": self.device_id,
                "key_addrs": list(self.key_addrs),
                "value_addrs": list(self.value_addrs),
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> NixlPeerInfo:
        """ValueError if ``data`` is not a peer's info of a version this code reads."""
        try:
            fields = json.loads(data)
            if fields.get("format") != INFO_FORMAT or fields.get("version") != INFO_VERSION:
                raise ValueError(
                    f"NIXL peer info {fields.get('format')!r} version {fields.get('version')!r}; "
                    f"this worker reads {INFO_FORMAT!r} version {INFO_VERSION}"
                )
            layout = fields["layout"]
            return cls(
                agent_name=fields["agent_name"],
                agent_metadata=base64.b64decode(fields["agent_metadata"]),
                layout=KVLayout(**{f.name: layout[f.name] for f in dataclasses.fields(KVLayout)}),
                num_blocks=fields["num_blocks"],
                mem_type=fields["mem_type"],
                device_id=fields["device_id"],
                key_addrs=tuple(fields["key_addrs"]),
                value_addrs=tuple(fields["value_addrs"]),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a NIXL peer info: {e!r}") from None

    @property
    def tensor_addrs(self) -> np.ndarray:
        """Every tensor's first byte, in descriptor order: layer 0 key, layer 0 value, ..."""
        return np.stack((self.key_addrs, self.value_addrs), axis=1).reshape(-1).astype(np.int64)


@dataclasses.dataclass(frozen=True, slots=True)
class NixlRead:
    num_blocks: int
    num_bytes: int
    num_descriptors: int  # on each side: 2 x layers x runs of consecutive ids


def bytes_per_tensor_block(layout: KVLayout) -> int:
    """One block of one layer's key (or value) tensor, in bytes."""
    return layout.bytes_per_block // (2 * layout.num_layers)


class NixlKVAgent:
    """A NIXL agent owning one engine's KV caches: registers them once, publishes what a peer
    needs to read them (``peer_info``), and reads a peer's blocks into its own
    (``read_blocks``). Its peers' reads are served by UCX's progress thread, not by the caller.

    Not thread-safe: one thread calls it at a time (an engine core's loop). The tensors must
    outlive it; ``close`` (or leaving a ``with`` block) deregisters them."""

    def __init__(self, kv_caches: Sequence[tuple[Any, Any]], name: str = "") -> None:
        """``kv_caches``: per layer, (key, value) torch tensors ``[num_blocks, block_size,
        num_kv_heads, head_dim]``, contiguous, all on one device. ``name``: the agent's name,
        unique among the agents its peers know (a fresh one by default); a worker that restarts
        under the same name replaces its old self in every reader."""
        nixl = load_nixl()
        tensors = [t for pair in kv_caches for t in pair]
        if not tensors:
            raise ValueError("no KV cache tensors to register")
        first = tensors[0]
        for tensor in tensors:
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise ValueError(f"KV tensors differ: {tuple(tensor.shape)}, {tuple(first.shape)}")
            if tensor.device != first.device or not tensor.is_contiguous():
                raise ValueError("KV tensors must be contiguous and all on one device")
        num_blocks, block_size, num_kv_heads, head_dim = first.shape
        dtype = str(first.dtype).removeprefix("torch.")
        self.layout = KVLayout(len(kv_caches), block_size, num_kv_heads, head_dim, dtype)
        self.num_blocks = num_blocks
        on_gpu = first.device.type == "cuda"
        self.mem_type = "VRAM" if on_gpu else "DRAM"
        self.device_id = (first.device.index or 0) if on_gpu else 0
        self._tensors = tensors  # NOTE: kept alive while registered
        self._addrs = np.array([t.data_ptr() for t in tensors], np.int64)
        self.name = name or f"kvswitch-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        config = nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
        try:
            self._agent = nixl.nixl_agent(self.name, config)
        except Exception as e:  # NOTE: NIXL's binding errors share no base class of ours
            # NOTE: e.g. a UCX_TLS without a transport to this process itself ("sm" alone).
            raise RuntimeError(
                f"NIXL's UCX backend did not start (UCX_TLS={os.environ.get('UCX_TLS', '')!r}): {e}"
            ) from e
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable(f"NIXL's UCX backend is missing ({INSTALL_HINT})")
        size = num_blocks * bytes_per_tensor_block(self.layout)
        regions = [(int(addr), size, self.device_id, "") for addr in self._addrs]
        self._registered = self._agent.register_memory(regions, self.mem_type)
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata it was added with
        self._metadata = self._agent.get_agent_metadata()

    def __enter__(self) -> NixlKVAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def peer_names(self) -> list[str]:
        """The peers' agents added so far."""
        return list(self._peers)

    def peer_info(self) -> NixlPeerInfo:
        return NixlPeerInfo(
            agent_name=self.name,
            agent_metadata=self._metadata,
            layout=self.layout,
            num_blocks=self.num_blocks,
            mem_type=self.mem_type,
            device_id=self.device_id,
            key_addrs=tuple(int(a) for a in self._addrs[0::2]),
            value_addrs=tuple(int(a) for a in self._addrs[1::2]),
        )

    def read_blocks(
        self,
        peer: NixlPeerInfo,
        peer_block_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> NixlRead:
        """Copy the peer's blocks ``peer_block_ids`` into this cache's ``block_ids`` (pair by
        pair) with one READ, and wait for it (``post_read``, then its ``poll`` until it ends)."""
        pending = self.post_read(peer, peer_block_ids, block_ids, timeout_s=timeout_s)
        pause_s = 0.0
        while (read := pending.poll()) is None:
            time.sleep(pause_s)
            pause_s = min(max(2 * pause_s, 1e-5), _MAX_POLL_PAUSE_S)
        return read

    def post_read(
        self,
        peer: NixlPeerInfo,
        peer_block_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> PendingRead:
        """Start copying the peer's blocks ``peer_block_ids`` into this cache's ``block_ids``
        (pair by pair) with one READ; its ``poll`` says when it is over. (On one host UCX may
        copy every byte inside the post; across hosts and on a GPU the read goes on meanwhile.)

        ValueError, before anything moves: the layouts differ, or an id is out of range.
        ``NixlTransferError``: the peer could not be reached."""
        self.layout.check_same(peer.layout)
        runs = coalesce_runs(peer_block_ids, block_ids)
        _check_ids(peer_block_ids, peer.num_blocks, "peer")
        _check_ids(block_ids, self.num_blocks, "local")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("a local block id appears twice")
        tensor_block_bytes = bytes_per_tensor_block(self.layout)
        read = NixlRead(len(block_ids), len(block_ids) * self.layout.bytes_per_block, 0)
        if not len(runs):
            return PendingRead(self, None, peer.agent_name, read, timeout_s)
        local = _descriptors(self._addrs, runs[:, 1], runs[:, 2], tensor_block_bytes)
        remote = _descriptors(peer.tensor_addrs, runs[:, 0], runs[:, 2], tensor_block_bytes)
        local[:, 2], remote[:, 2] = self.device_id, peer.device_id
        read = dataclasses.replace(read, num_descriptors=len(local))
        self._add_peer(peer)
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, self.mem_type),
                self._agent.get_xfer_descs(remote, peer.mem_type),
                peer.agent_name,
            )
        except Exception as e:  # NOTE: NIXL's binding errors share no base class of ours
            self._drop_peer(peer.agent_name)
            raise NixlTransferError(f"cannot read from {peer.agent_name}: {e}") from e
        pending = PendingRead(self, handle, peer.agent_name, read, timeout_s)
        pending.state = self._state(handle, start=True)
        return pending

    def close(self) -> None:
        """Forget every peer and deregister the cache."""
        for name in list(self._peers):
            self._drop_peer(name)
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None

    def _add_peer(self, peer: NixlPeerInfo) -> None:
        """Add the peer's agent, once; a peer known under its name with other metadata (it
        restarted) is replaced."""
        known = self._peers.get(peer.agent_name)
        if known == peer.agent_metadata:
            return
        if known is not None:
            self._drop_peer(peer.agent_name)
        try:
            name = self._agent.add_remote_agent(peer.agent_metadata)
        except Exception as e:
            raise NixlTransferError(f"cannot add the peer {peer.agent_name}: {e}") from e
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[name] = peer.agent_metadata
        if name != peer.agent_name:
            self._drop_peer(name)
            raise NixlTransferError(f"the metadata of {peer.agent_name} names agent {name}")

    def _drop_peer(self, name: str) -> None:
        if self._peers.pop(name, None) is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            logger.warning("removing the NIXL peer %s failed: %s", name, e)

    def _state(self, handle: Any, *, start: bool = False) -> str:
        """A transfer's state ("PROC", "DONE", or "ERR..."), started first with ``start``."""
        try:
            return self._agent.transfer(handle) if start else self._agent.check_xfer_state(handle)
        except Exception as e:  # NOTE: NIXL's binding errors share no base class of ours
            return f"ERR ({e})"

    def _release(self, handle: Any) -> bool:
        """Release a transfer that did not finish (NIXL cancels it); False if it could not be."""
        try:
            handle.release()
        except Exception as e:
            # NOTE: NIXL keeps a handle it failed to release and tries again when the agent
            # goes: the peer stays added meanwhile, since the transfer may still use it.
            logger.warning("releasing an unfinished NIXL read failed: %s", e)
            return False
        return True


class PendingRead:
    """A READ ``NixlKVAgent.post_read`` started. ``poll`` returns None while it runs, the
    ``NixlRead`` once it is done, and raises ``NixlTransferError`` when it failed or ran past
    its timeout: its handle is then released, which cancels it, and the peer dropped (its next
    read adds it again). Once ``poll`` has returned or raised, NIXL writes nothing more into the
    blocks: a read whose cancel NIXL refuses is polled on, past its timeout, until it ends."""

    def __init__(
        self, agent: NixlKVAgent, handle: Any, peer_name: str, read: NixlRead, timeout_s: float
    ) -> None:
        self._agent = agent
        self._handle = handle  # None once over
        self.peer_name = peer_name
        self.read = read
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.state = "DONE" if handle is None else "PROC"
        self._failure = ""  # why it failed, once known; it may still be running (cancel refused)

    def poll(self) -> NixlRead | None:
        if self._handle is None:
            if self._failure:
                raise NixlTransferError(self._failure)
            return self.read
        if self.state == "PROC":
            self.state = self._agent._state(self._handle)
        if self.state == "DONE" and not self._failure:
            self._handle.release()
            self._handle = None
            return self.read
        if self.state == "PROC" and (self._failure or time.monotonic() < self.deadline):
            return None  # running, or cancel refused and still running
        if not self._failure:
            what = (
                f"timed out after {self.timeout_s:g} s"
                if self.state == "PROC"
                else f"failed: {self.state}"
            )
            self._failure = (
                f"reading {self.read.num_blocks} blocks from {self.peer_name} {what}; the "
                "blocks it was to fill hold unknown bytes"
            )
        released = self._agent._release(self._handle)
        if not released and self.state == "PROC":
            return None  # NOTE: still running: its blocks must not be reused before it ends
        self._handle = None
        if released:
            self._agent._drop_peer(self.peer_name)
        raise NixlTransferError(self._failure)


def _check_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> None:
    if len(block_ids) and not 0 <= min(block_ids) <= max(block_ids) < num_blocks:
        raise ValueError(f"{side} block ids outside 0..{num_blocks - 1}")


def _descriptors(
    tensor_addrs: np.ndarray, starts: np.ndarray, lengths: np.ndarray, tensor_block_bytes: int
) -> np.ndarray:
    """``(address, size, device)`` rows (uint64, device left 0): for each tensor in order, one
    per run."""
    rows = np.zeros((len(tensor_addrs), len(starts), 3), np.uint64)
    rows[:, :, 0] = tensor_addrs[:, None] + starts[None, :] * tensor_block_bytes
    rows[:, :, 1] = lengths[None, :] * tensor_block_bytes
    return rows.reshape(-1, 3)
