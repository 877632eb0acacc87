"""KV blocks between workers: the holder's side (``send``: FetchBlocks) and the taker's (``pull``).

A pull, as a decode worker runs it for a request a prefill worker computed::

    taker                                            holder (its engine core holds the
      hash the prompt; what is cached here stays      request's blocks under a lease)
      FetchBlocks(the rest, transfer_id) ------------>  each chunk: read the blocks, extend
      <------------- chunks of whole blocks ---------   the lease
      write each chunk into the cache as it arrives     stream over (or cancelled): release
      nothing wanted: ReleaseBlocks(transfer_id) ---->  release

The bytes travel in the stream (gRPC) or, when both workers share a host, through a file in its
shared memory that the holder's engine core writes and the taker's reads (``shm``). A chunk is
written into the cache only whole, so a pull cut short leaves a leading run of the chain, never
a half-written block.

Two transports leave the holder's engine core out of the copy: the holder holds the blocks
under a lease and answers their ids in one chunk, and the taker's core copies them itself,
out of the holder's KV cache file in this host's shared memory (``mapped``) or with a one-sided
NIXL read from the holder's agent, DRAM or GPU memory, on any host (``nixl``)::

    taker                                            holder
      FetchBlocks(nixl, transfer_id) --------------->  hold the blocks; answer their ids, the
      <------------ block ids, agent info, lease ---   agent's info (its cache registered on
      core: one NIXL READ into its own blocks          first use) and the lease
      ReleaseBlocks(lease) ------------------------->  release

``auto`` (or empty) tries ``nixl`` first on a GPU worker where NIXL is installed, then
``mapped``, ``shm`` and ``grpc``, and remembers a peer that answered it has no NIXL; a CPU worker
reads over NIXL when ``nixl`` is named.

"Share a host" means the same ``/dev/shm`` (``shared_memory.host_id``): each FetchBlocks says the
asker's id, each answer the holder's, and the taker remembers each peer's. A peer known to be
elsewhere gets gRPC at once; one not known yet is asked ``mapped`` first, which makes no file
and which a holder elsewhere answers with its id alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Coroutine
from typing import Any

import grpc

from kvswitch.security import PLAINTEXT, FleetSecurity
from kvswitch.serving import KEEPALIVE_CHANNEL_OPTIONS
from kvswitch.v1 import worker_pb2, worker_pb2_grpc
from kvswitch.worker.engine_client import EngineClient
from kvswitch.worker.kv_layout import CACHE_PREFIX, SHM_DIR, KVLayout
from kvswitch.worker.nixl_kv import MAX_READ_S, nixl_installed
from kvswitch.worker.shared_memory import ShmFiles, ShmRefused, sweep
from kvswitch.worker.shared_memory import host_id as this_host_id

logger = logging.getLogger(__name__)

# FetchBlocks: chunks of whole blocks, this large unless asked otherwise, and never larger than
# what a peer's channel takes in one message.
DEFAULT_CHUNK_BYTES = 1 << 20
# Through shared memory a chunk costs its engine core one copy and no message: larger ones pay.
SHM_CHUNK_BYTES = 16 << 20
MAX_CHUNK_BYTES = 32 << 20
TRANSPORTS = ("", "auto", "nixl", "mapped", "shm", "grpc")
# How long a mapped fetch's blocks stay held if the asker never says it copied them; a NIXL
# read is over, or cancelled, before then (nixl_kv.MAX_READ_S).
MAPPED_HOLD_S = 10.0
assert MAPPED_HOLD_S > MAX_READ_S
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + (1 << 20)),
    *KEEPALIVE_CHANNEL_OPTIONS,
]
_RELEASE_TIMEOUT_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class PullResult:
    num_cached_blocks: int  # leading blocks of the chain cached here once the pull was done
    num_blocks: int  # blocks that came from the peer
    num_bytes: int
    transport: str  # "nixl", "mapped", "shm" or "grpc"; "" when nothing moved


class BlockTransfers:
    """This worker's side of every block transfer: what it sends and what it pulls.

    ``host_id``: whose shared memory this worker sees (default ``shared_memory.host_id()``; ""
    for none: every pull goes over gRPC). ``shm_max_bytes``: the most its transfer files take in
    ``/dev/shm`` (``ShmFiles``). Starting one sweeps the files of workers that died."""

    def __init__(
        self,
        engine: EngineClient,
        security: FleetSecurity = PLAINTEXT,
        *,
        host_id: str | None = None,
        shm_max_bytes: int | None = None,
    ) -> None:
        self._engine = engine
        self._peers = PeerChannels(security)
        self.host_id = this_host_id() if host_id is None else host_id
        self._peer_hosts: dict[str, str] = {}  # each peer's host id, as it last said
        # Whether "auto" tries NIXL first: on a GPU worker where it is installed. NOTE: not on
        # a CPU worker: a NIXL agent's progress thread spins a core from its first transfer on
        # (NIXL's Python API fixes its delay at 0), which a CPU engine computes with.
        self.nixl = engine.facts.device.startswith("cuda") and nixl_installed()
        self._peers_without_nixl: set[str] = set()  # peers that answered they have no NIXL
        self._nixl_info: bytes | None = None  # this worker's, once asked for
        self.shm_files = ShmFiles(shm_max_bytes)  # where same-host peers write blocks
        sweep(CACHE_PREFIX)
        self._tasks: set[asyncio.Task] = set()  # releases sent, not waited for

    async def close(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._peers.close()
        self.shm_files.close()

    # -- the holder's side ---------------------------------------------------------------------

    async def send(
        self, request: worker_pb2.FetchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Serve FetchBlocks: the leading cached blocks of the chain, a chunk at a time.
        ValueError: the blocks cannot go where they were asked to (an shm file not here)."""
        fast = request.mapped or request.shm_path
        if fast and request.host_id and request.host_id != self.host_id:
            # NOTE: not this worker's shared memory: no file opened, no lease touched (the
            # asker's gRPC try takes it), only this worker's id, for the asker to remember.
            await context.write(worker_pb2.KVBlockChunk(host_id=self.host_id))
            return
        if request.mapped or request.nixl:
            await self._send_held(request, context)
            return
        layout = self._engine.facts.kv_layout
        default = SHM_CHUNK_BYTES if request.shm_path else DEFAULT_CHUNK_BYTES
        chunk_bytes = min(request.max_chunk_bytes or default, MAX_CHUNK_BYTES)
        per_chunk = max(chunk_bytes // layout.bytes_per_block, 1)
        layout_proto = worker_pb2.KVLayout(**dataclasses.asdict(layout))
        hashes = list(request.block_hashes)
        lease_id = request.transfer_id or None
        keep_lease = False
        try:
            # NOTE: one chunk read at a time, each between two of the core's steps: a long
            # chain delays no step by more than one chunk's copy.
            for start in range(0, len(hashes), per_chunk):
                wanted = hashes[start : start + per_chunk]
                # Same host: the core writes the blocks into the asker's shared memory itself.
                offset = start * layout.bytes_per_block
                into = (request.shm_path, offset) if request.shm_path else None
                try:
                    num_found, data = await asyncio.wrap_future(
                        self._engine.read_blocks(wanted, into=into, lease_id=lease_id)
                    )
                except ValueError:
                    # NOTE: kept for the asker's next try (over gRPC, when shm was refused).
                    keep_lease = True
                    raise
                if num_found:
                    await context.write(
                        worker_pb2.KVBlockChunk(
                            layout=layout_proto,
                            first_block=start,
                            num_blocks=num_found,
                            data=bytes(data),  # protobuf takes bytes only: the one copy here
                            host_id=self.host_id,
                        )
                    )
                if num_found < len(wanted):
                    return  # the chain's cached part ends here
        finally:
            # Done, or the asker went away: either way it wants the blocks no more.
            if lease_id is not None and not keep_lease:
                self._engine.release(lease_id)

    async def _send_held(
        self, request: worker_pb2.FetchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """A ``mapped`` or ``nixl`` fetch: the blocks held under a lease, their ids in one chunk
        with what the asker reaches them by (this worker's cache file, or its NIXL agent)."""
        facts = self._engine.facts
        if request.nixl:
            if self._nixl_info is None:
                self._nixl_info = await asyncio.wrap_future(self._engine.nixl_info())
            reach: dict[str, Any] = {"nixl_peer_info": self._nixl_info}
        elif facts.kv_cache_file:
            reach = {"cache_file": facts.kv_cache_file, "cache_num_blocks": facts.num_blocks}
        else:
            raise ValueError("this worker's KV cache is not in shared memory (--kv-cache-shm)")
        lease_id = request.transfer_id or f"fetch-{uuid.uuid4().hex}"
        try:
            block_ids = await asyncio.wrap_future(
                self._engine.hold_blocks(list(request.block_hashes), lease_id, MAPPED_HOLD_S)
            )
            await context.write(
                worker_pb2.KVBlockChunk(
                    layout=worker_pb2.KVLayout(**dataclasses.asdict(facts.kv_layout)),
                    num_blocks=len(block_ids),
                    block_ids=block_ids,
                    lease_id=lease_id,
                    host_id=self.host_id,
                    **reach,
                )
            )
        except BaseException:
            # NOTE: the asker went away before it had the ids (or they could not be sent):
            # nobody will release the hold. Sent after it, on the same pipe, this runs after it.
            self._engine.release(lease_id)
            raise

    # -- the taker's side ----------------------------------------------------------------------

    async def pull(
        self,
        peer_address: str,
        hashes: list[bytes],
        *,
        transport: str = "",
        request_id: str = "",
        transfer_id: str = "",
        timeout_s: float | None = None,
    ) -> PullResult:
        """Take the leading blocks of ``hashes`` that this worker does not hold from the peer
        into the prefix cache. ``transport``: "nixl", "mapped", "shm", "grpc", or "auto" / ""
        for the first of those the peer can serve (NIXL first on a GPU worker, where both have
        it; gRPC at once for a peer on another host without it). ``transfer_id``: the peer's
        lease on the blocks, released once they are here (or wanted no more).

        Raises ``grpc.aio.AioRpcError`` (the peer failed), ``ShmRefused`` or ``NixlRefused``
        (the transport asked for cannot be had), ValueError (the peer's blocks do not fit this
        worker, a NIXL read failed), ``EngineStopped``; blocks written before the failure stay
        cached."""
        if transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be auto, nixl, mapped, shm, grpc or empty, got {transport!r}"
            )
        transport = "" if transport == "auto" else transport
        num_held = await self.num_cached(hashes)
        wanted = hashes[num_held:]  # what is held here already does not move
        if not wanted:
            if transfer_id:
                await self.release(peer_address, transfer_id)
            return PullResult(num_held, 0, 0, "")
        fetch = _Fetch(request_id, transfer_id, wanted, timeout_s)
        try:
            chosen, num_blocks, num_written = await self._pull_by(peer_address, fetch, transport)
        except asyncio.CancelledError:
            if transfer_id:
                # NOTE: the peer may hold the blocks for a fetch whose answer was still on its
                # way (the peer lets them go itself when it sees this worker leave first).
                self._background(self.release(peer_address, transfer_id))
            raise
        # NOTE: every wanted block newly cached, into room enough that none evicted another:
        # the whole chain is cached, no need to ask the engine core again.
        whole = num_written == len(wanted) <= self._engine.load.num_free_blocks
        num_cached = len(hashes) if whole else await self.num_cached(hashes)
        num_bytes = num_blocks * self._engine.facts.kv_layout.bytes_per_block
        return PullResult(num_cached, num_blocks, num_bytes, chosen)

    async def _pull_by(
        self, peer_address: str, fetch: _Fetch, transport: str
    ) -> tuple[str, int, int]:
        """The fetch by ``transport`` (or "" for the first that works): (the transport it went
        by, blocks moved, blocks newly cached)."""
        same_host = "mapped" if self._may_share(peer_address) else "grpc"
        chosen = transport or ("nixl" if self._may_nixl(peer_address) else same_host)
        if chosen == "nixl":
            try:
                num_blocks, num_written = await self._pull_nixl(peer_address, fetch)
            except NixlRefused:
                if transport == "nixl":
                    raise
                chosen = same_host
        if chosen in ("mapped", "shm") and not self._may_share(peer_address):
            raise ShmRefused(
                f"{peer_address} does not share this worker's {SHM_DIR} (its host id "
                f"{self._peer_hosts.get(peer_address)!r}, this worker's {self.host_id!r})"
            )
        if chosen == "mapped":
            try:
                num_blocks, num_written = await self._pull_mapped(peer_address, fetch)
            except ShmRefused:
                if transport == "mapped":
                    raise
                # The peer's cache is not in this host's shared memory, or the peer is elsewhere.
                chosen = "shm" if self._may_share(peer_address) else "grpc"
        if chosen == "shm":
            try:
                num_blocks, num_written = await self._pull_shm(peer_address, fetch)
            except ShmRefused:
                if transport == "shm":
                    raise
                chosen = "grpc"  # the peer cannot see this host's shared memory
        if chosen == "grpc":
            num_blocks, num_written = await self._fetch(peer_address, fetch, path="")
        return chosen, num_blocks, num_written

    def _may_nixl(self, peer_address: str) -> bool:
        """Whether to try NIXL with the peer: installed here, and the peer has not said it has
        none."""
        return self.nixl and peer_address not in self._peers_without_nixl

    def _may_share(self, peer_address: str) -> bool:
        """Whether this worker may move blocks through shared memory with the peer: it has
        some, and the peer is not known to be elsewhere (one not known yet answers its id)."""
        peer_host = self._peer_hosts.get(peer_address)
        return bool(self.host_id) and peer_host in (None, self.host_id)

    def _learn(self, peer_address: str, chunk: worker_pb2.KVBlockChunk) -> None:
        """Remember the peer's host id from its answer; ``ShmRefused`` if the answer is that id
        alone (no layout): the peer does not share this worker's shared memory."""
        if chunk.host_id or not chunk.HasField("layout"):
            self._peer_hosts[peer_address] = chunk.host_id or "-"  # "-": it has none
        if not chunk.HasField("layout"):
            raise ShmRefused(f"{peer_address} answered that it does not share {SHM_DIR}")

    async def release(self, peer_address: str, transfer_id: str) -> None:
        """Tell the peer its lease ``transfer_id`` is not wanted; a peer that cannot be reached
        lets it run out on its own."""
        try:
            await self._peers.stub(peer_address).ReleaseBlocks(
                worker_pb2.ReleaseBlocksRequest(transfer_id=transfer_id),
                timeout=_RELEASE_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as e:
            logger.info("%s: release of %s failed (%s)", peer_address, transfer_id, e.code().name)

    async def num_cached(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of the chain this worker holds cached."""
        num_found, _ = await asyncio.wrap_future(
            self._engine.read_blocks(block_hashes, with_data=False)
        )
        return num_found

    async def _pull_nixl(self, peer_address: str, fetch: _Fetch) -> tuple[int, int]:
        """Read the blocks over NIXL straight out of the peer's KV cache; (blocks moved, blocks
        newly cached). ``NixlRefused`` if the peer has no NIXL (remembered)."""
        try:
            chunk = await self._fetch_held(peer_address, fetch, nixl=True)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._peers_without_nixl.add(peer_address)
                raise NixlRefused(f"{peer_address}: {e.details()}") from None
            raise
        if chunk is grpc.aio.EOF or not chunk.nixl_peer_info:
            raise ValueError("the peer answered a NIXL fetch without its agent's info")
        try:
            self._engine.facts.kv_layout.check_same(_layout_from_proto(chunk.layout))
            num_written = await asyncio.wrap_future(
                self._engine.write_blocks_nixl(
                    fetch.wanted[: chunk.num_blocks],
                    chunk.nixl_peer_info,
                    list(chunk.block_ids),
                    fetch.timeout_s,
                )
            )
        finally:
            self._background(self.release(peer_address, chunk.lease_id))
        return chunk.num_blocks, num_written

    async def _pull_mapped(self, peer_address: str, fetch: _Fetch) -> tuple[int, int]:
        """Copy the blocks straight out of the peer's KV cache file; (blocks moved, blocks
        newly cached). ``ShmRefused`` if its cache is not in this host's shared memory."""
        ours = self._engine.facts.kv_layout
        try:
            chunk = await self._fetch_held(peer_address, fetch, mapped=True)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise ShmRefused(e.details()) from None
            raise
        if chunk is grpc.aio.EOF:
            raise ValueError("the peer answered a mapped fetch without its cache file")
        self._learn(peer_address, chunk)
        if not chunk.cache_file:
            raise ValueError("the peer answered a mapped fetch without its cache file")
        try:
            ours.check_same(_layout_from_proto(chunk.layout))
            written = fetch.wanted[: chunk.num_blocks]
            try:
                num_written = await asyncio.wrap_future(
                    self._engine.write_blocks_mapped(
                        written, chunk.cache_file, chunk.cache_num_blocks, list(chunk.block_ids)
                    )
                )
            except ValueError as e:
                if "cannot open" in str(e):
                    raise ShmRefused(str(e)) from None  # the peer is on another host
                raise
        finally:
            # NOTE: not waited for: the blocks are here, and if the peer never hears, its lease
            # runs out.
            self._background(self.release(peer_address, chunk.lease_id))
        return chunk.num_blocks, num_written

    async def _fetch_held(
        self, peer_address: str, fetch: _Fetch, **how: bool
    ) -> worker_pb2.KVBlockChunk | Any:
        """The one chunk a ``mapped`` or ``nixl`` fetch (``how``) is answered with: block ids
        held under a lease, no data; ``grpc.aio.EOF`` if none came."""
        stream = self._peers.stub(peer_address).FetchBlocks(
            worker_pb2.FetchBlocksRequest(
                request_id=fetch.request_id,
                block_hashes=fetch.wanted,
                transfer_id=fetch.transfer_id,
                host_id=self.host_id,
                **how,
            ),
            timeout=fetch.timeout_s,
        )
        return await stream.read()

    def _background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # a reference, so that the task is not collected unfinished
        task.add_done_callback(self._tasks.discard)

    async def _pull_shm(self, peer_address: str, fetch: _Fetch) -> tuple[int, int]:
        size = len(fetch.wanted) * self._engine.facts.kv_layout.bytes_per_block
        with self.shm_files.take(size) as path:
            return await self._fetch(peer_address, fetch, path)

    async def _fetch(self, peer_address: str, fetch: _Fetch, path: str) -> tuple[int, int]:
        """Fetch the blocks and write each chunk into the cache as it arrives; (blocks moved,
        blocks newly cached). ``path``: the shared-memory file the peer writes into, or "" to
        stream."""
        ours = self._engine.facts.kv_layout
        size = ours.bytes_per_block
        wanted = fetch.wanted
        num_blocks = num_written = 0
        try:
            stream = self._peers.stub(peer_address).FetchBlocks(
                worker_pb2.FetchBlocksRequest(
                    request_id=fetch.request_id,
                    block_hashes=wanted,
                    shm_path=path,
                    transfer_id=fetch.transfer_id,
                    host_id=self.host_id,
                ),
                timeout=fetch.timeout_s,
            )
            async for chunk in stream:
                self._learn(peer_address, chunk)
                ours.check_same(_layout_from_proto(chunk.layout))
                if chunk.first_block != num_blocks:
                    raise ValueError(
                        f"the peer sent block {chunk.first_block} after {num_blocks} blocks"
                    )
                written = wanted[num_blocks : num_blocks + chunk.num_blocks]
                if path:
                    source = (path, num_blocks * size)
                    future = self._engine.write_blocks_from(written, source)
                else:
                    future = self._engine.write_blocks(written, chunk.data)
                num_written += await asyncio.wrap_future(future)
                num_blocks += chunk.num_blocks
        except grpc.aio.AioRpcError as e:
            if path and e.code() == grpc.StatusCode.FAILED_PRECONDITION and not num_blocks:
                raise ShmRefused(e.details()) from None
            raise
        return num_blocks, num_written


class NixlRefused(Exception):
    """A NIXL transfer cannot be had: the peer has no NIXL (not installed there)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Fetch:
    request_id: str
    transfer_id: str
    wanted: list[bytes]
    timeout_s: float | None


class PeerChannels:
    """One channel to each peer worker, opened on first use and kept: a connection is set up
    once per peer, not once per transfer."""

    def __init__(self, security: FleetSecurity = PLAINTEXT) -> None:
        self._security = security
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._security.channel(address, _CHANNEL_OPTIONS)
        return worker_pb2_grpc.WorkerStub(channel)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()


def _layout_from_proto(message: worker_pb2.KVLayout) -> KVLayout:
    m = message
    return KVLayout(m.num_layers, m.block_size, m.num_kv_heads, m.head_dim, m.dtype)
