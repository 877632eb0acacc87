"""Cached KV blocks as bytes: read out of one engine's paged cache, written into another's.

A block travels as raw bytes, no per-element encoding: for each layer, its key block then its
value block, each ``[block_size, num_kv_heads, head_dim]`` in C order, in the cache's dtype::

    block 0: | layer 0 key | layer 0 value | layer 1 key | ... | layer L-1 value |
    block 1: | ...

``KVLayout`` (``kv_layout``) names that shape; two engines exchange blocks only when their
layouts are equal (same model, block size and dtype), which the receiver checks before it writes
anything.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import stat
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import numpy as np
import torch

from kvswitch.worker.kv_layout import CACHE_PREFIX, SHM_DIR, SHM_PREFIX, KVLayout
from kvswitch.worker.shared_memory import create_owned, new_name, owner_alive, sweep

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: key, value [blocks, ...]


def layout_of(kv_caches: KVCaches) -> KVLayout:
    key = kv_caches[0][0]
    _, block_size, num_kv_heads, head_dim = key.shape
    dtype = str(key.dtype).removeprefix("torch.")
    return KVLayout(len(kv_caches), block_size, num_kv_heads, head_dim, dtype)


def read_blocks(
    kv_caches: KVCaches, block_ids: Sequence[int], out: memoryview | None = None
) -> bytes:
    """The KV of ``block_ids``, in that order, as bytes (layout above); with ``out`` (a
    writable buffer of exactly that size, e.g. shared memory), written there instead, and b""
    returned."""
    key = kv_caches[0][0]
    shape = (len(block_ids), len(kv_caches), 2, *key.shape[1:])
    if out is not None and len(out) != len(block_ids) * layout_of(kv_caches).bytes_per_block:
        raise ValueError(f"a buffer of {len(out):,} bytes for {len(block_ids)} blocks")
    if not block_ids:
        return b""
    if key.device.type == "cpu":
        # NOTE: numpy, on the raw bits: torch's CPU indexing runs on its thread pool, which on a
        # busy machine took 8 ms where a plain gather of the same rows takes 0.03 ms.
        ids = np.asarray(block_ids)
        if out is None:
            blocks = np.empty(shape, _bits(key))
        else:
            blocks = np.ndarray(shape, _bits(key), buffer=out)
        for layer, (key_cache, value_cache) in enumerate(kv_caches):
            # NOTE: mode="clip" gathers straight into the strided rows; the default buffers.
            np.take(_raw(key_cache), ids, axis=0, out=blocks[:, layer, 0], mode="clip")
            np.take(_raw(value_cache), ids, axis=0, out=blocks[:, layer, 1], mode="clip")
        return blocks.tobytes() if out is None else b""
    index = torch.tensor(block_ids, device=key.device)
    # [blocks, layers, 2, block_size, heads, dim], gathered on the device, then one copy out.
    on_device = torch.stack([torch.stack((k[index], v[index]), dim=1) for k, v in kv_caches], dim=1)
    host = on_device.cpu().view(torch.uint8).numpy()
    if out is None:
        return host.tobytes()
    np.frombuffer(out, np.uint8)[:] = host.reshape(-1)
    return b""


def write_blocks(kv_caches: KVCaches, block_ids: Sequence[int], data: bytes) -> None:
    """Write bytes from ``read_blocks`` (of the same layout) into ``block_ids``."""
    layout = layout_of(kv_caches)
    if len(data) != len(block_ids) * layout.bytes_per_block:
        raise ValueError(
            f"{len(data):,} bytes for {len(block_ids)} blocks of {layout.bytes_per_block:,} bytes"
        )
    if not block_ids:
        return
    key = kv_caches[0][0]
    shape = (len(block_ids), layout.num_layers, 2, *key.shape[1:])
    if key.device.type == "cpu":
        ids = np.asarray(block_ids)
        blocks = np.frombuffer(data, _bits(key)).reshape(shape)
        for layer, (key_cache, value_cache) in enumerate(kv_caches):
            _raw(key_cache)[ids] = blocks[:, layer, 0]
            _raw(value_cache)[ids] = blocks[:, layer, 1]
        return
    # NOTE: bytearray, so that torch gets a writable buffer it may view without a copy.
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(key.dtype).view(shape)
    on_device = host.to(key.device)
    index = torch.tensor(block_ids, device=key.device)
    for layer, (key_cache, value_cache) in enumerate(kv_caches):
        key_cache.index_copy_(0, index, on_device[:, layer, 0])
        value_cache.index_copy_(0, index, on_device[:, layer, 1])


@contextlib.contextmanager
def shared_file(path: str, offset: int, size: int, *, writable: bool) -> Iterator[memoryview]:
    """``size`` bytes at ``offset`` of a file in this host's shared memory, mapped (no copy).
    ValueError if it cannot be opened (the file is on another host, say) or is too short."""
    # NOTE: only files made for block transfer: a peer must not get a worker to write over any
    # other shared memory of its host.
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(SHM_PREFIX):
        raise ValueError(f"{path!r} is not a block-transfer file ({SHM_DIR}/{SHM_PREFIX}*)")
    with _open_own(path, writable=writable) as file:
        file_size = os.fstat(file.fileno()).st_size
        if offset < 0 or size <= 0 or offset + size > file_size:
            raise ValueError(f"{path} holds {file_size:,} bytes, not {offset + size:,}")
        # NOTE: only the chunk's pages, all mapped at once (MAP_POPULATE): faulting them in one
        # by one cost more than the copy itself.
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(
            file.fileno(), offset + size - start, flags=flags, prot=protection, offset=start
        ) as mapped:
            view = memoryview(mapped)[offset - start :]
            try:
                yield view
            finally:
                view.release()


def _open_own(path: str, *, writable: bool) -> BinaryIO:
    """``path`` opened, if it is a plain file of this process's user; ValueError ("cannot open
    ...") if it is not, or cannot be opened.

    NOTE: /dev/shm is writable by every user of the host. The name is checked by the callers,
    but anyone may create a file of that name: a link to another file of ours (O_NOFOLLOW), a
    FIFO that would block the open (O_NONBLOCK), or a file of their own, whose pages they could
    read our blocks from or write theirs into (the owner)."""
    flags = os.O_RDWR if writable else os.O_RDONLY
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot open {path}: {e.strerror}") from None
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid():
        os.close(descriptor)
        raise ValueError(
            f"cannot open {path}: not a plain file of this worker's user (uid {os.getuid()}); "
            f"it is owned by uid {status.st_uid}"
        )
    return os.fdopen(descriptor, "r+b" if writable else "rb")


def new_cache_file() -> str:
    """A fresh path for this process's KV cache in shared memory. Files of the same kind whose
    owner is gone (killed before it could remove its own) are removed first
    (``shared_memory.sweep``)."""
    sweep(CACHE_PREFIX)
    return new_name(CACHE_PREFIX)


# The lock each cache file made here is held under while its engine lives (``shared_memory``).
_CACHE_LOCKS: dict[str, int] = {}


def remove_cache_file(path: str) -> None:
    """Remove a cache file ``allocate_shared_caches`` made, and let go of its lock."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    descriptor = _CACHE_LOCKS.pop(path, None)
    if descriptor is not None:
        os.close(descriptor)


def allocate_shared_caches(
    path: str, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A KV cache (per layer: key, value, each ``shape``) in a new file of this host's shared
    memory, zeroed, laid out as ``[layer][key, value]`` tensors one after another, so that a
    peer can map it (``PeerCache``), held under its lock until ``remove_cache_file``. OSError
    when there is no room."""
    element_size = torch.empty((), dtype=dtype).element_size()
    numel = 2 * num_layers * math.prod(shape)
    descriptor = create_owned(path)
    try:
        # NOTE: allocated now: a full /dev/shm fails here, not as a SIGBUS mid-step.
        os.posix_fallocate(descriptor, 0, numel * element_size)
    except OSError:
        os.unlink(path)
        os.close(descriptor)
        raise
    _CACHE_LOCKS[path] = descriptor
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    # NOTE: every page faulted in now, as torch.zeros does for a private cache: faulting them
    # in one by one as blocks are first written cost 20 times the copy.
    flat.zero_()
    tensors = flat.view(2 * num_layers, *shape)
    return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(num_layers)]


class PeerCache:
    """A same-host peer's KV cache file (``allocate_shared_caches``), mapped read-only: blocks
    are copied straight out of it (``copy_peer_blocks``). ValueError if it cannot be."""

    def __init__(self, path: str, layout: KVLayout, num_blocks: int) -> None:
        name = os.path.basename(path)
        if os.path.dirname(path) != SHM_DIR or not name.startswith(CACHE_PREFIX):
            raise ValueError(f"{path!r} is not a KV cache file ({SHM_DIR}/{CACHE_PREFIX}*)")
        # NOTE: kept open, to ask the owner's lock whether the peer still lives (``stale``).
        self._file = _open_own(path, writable=False)
        element_size = layout.bytes_per_block // (
            2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim
        )
        size = num_blocks * layout.bytes_per_block
        status = os.fstat(self._file.fileno())
        if status.st_size != size:
            self._file.close()
            raise ValueError(f"{path} is not a cache of {num_blocks} blocks of this layout")
        # NOTE: all its pages mapped at once (MAP_POPULATE), once per peer, not page by page on
        # each first read.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mapped = mmap.mmap(self._file.fileno(), size, flags=flags, prot=mmap.PROT_READ)
        shape = (2 * layout.num_layers, num_blocks, layout.block_size)
        shape += (layout.num_kv_heads, layout.head_dim)
        self.tensors = np.ndarray(shape, _BITS[element_size], buffer=self._mapped)
        self.path = path
        self.num_blocks = num_blocks
        self._file_id = (status.st_dev, status.st_ino)

    @property
    def stale(self) -> bool:
        """Whether the peer that made the file is gone (it died or restarted: its lock is free,
        or its path was removed or names another file): its blocks are nobody's now."""
        try:
            status = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return True
        return (status.st_dev, status.st_ino) != self._file_id or not owner_alive(
            self._file.fileno()
        )

    def close(self) -> None:
        self.tensors = None  # type: ignore[assignment]
        self._mapped.close()
        self._file.close()


class PeerCaches:
    """The same-host peers' cache files this engine copies from, each mapped once and kept for
    the next pull. At each ``get`` every stale mapping (``PeerCache.stale``) is let go first:
    a mapping keeps its file's memory alive after the file is removed, so a peer that died or
    restarted would otherwise cost its whole cache for as long as this engine runs."""

    def __init__(self) -> None:
        self._by_path: dict[str, PeerCache] = {}

    def get(self, path: str, layout: KVLayout, num_blocks: int) -> PeerCache:
        """The mapping of ``path``, made now if it is not kept (ValueError, as ``PeerCache``)."""
        for stale in [p for p, peer in self._by_path.items() if peer.stale]:
            self._by_path.pop(stale).close()
        peer = self._by_path.get(path)
        if peer is not None and peer.num_blocks != num_blocks:
            self._by_path.pop(path).close()
            peer = None
        if peer is None:
            peer = self._by_path[path] = PeerCache(path, layout, num_blocks)
        return peer

    @property
    def paths(self) -> list[str]:
        return list(self._by_path)

    def close(self) -> None:
        for peer in self._by_path.values():
            peer.close()
        self._by_path.clear()


def copy_peer_blocks(
    kv_caches: KVCaches, block_ids: Sequence[int], peer: PeerCache, peer_block_ids: Sequence[int]
) -> None:
    """Copy a same-host peer's blocks ``peer_block_ids`` into ``block_ids``: one copy, no bytes
    in between."""
    ids, peer_ids = np.asarray(block_ids), np.asarray(peer_block_ids)
    for layer, (key_cache, value_cache) in enumerate(kv_caches):
        _raw(key_cache)[ids] = peer.tensors[2 * layer][peer_ids]
        _raw(value_cache)[ids] = peer.tensors[2 * layer + 1][peer_ids]


# The unsigned integer type of each element size: a cache's bits, whatever its float type
# (numpy has no bfloat16).
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(tensor: torch.Tensor) -> type[np.unsignedinteger]:
    return _BITS[tensor.element_size()]


_TORCH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as an array of same-size integers (shared, not copied)."""
    return tensor.view(_TORCH_INTS[tensor.element_size()]).numpy().view(_bits(tensor))
