"""The files workers on one host share KV blocks through, in ``/dev/shm``, and who may use them.

Two workers share memory only when both see the same ``/dev/shm``: ``host_id`` names it (the
kernel's boot id and the device and inode of ``/dev/shm``), and each side tells the other its id
in FetchBlocks. Two containers of one host with their own ``/dev/shm`` (Kubernetes pods) differ;
containers that mount one volume there (``deploy/docker-compose*.yml``) are equal.

Every file a worker makes here is named ``<prefix><pid>-<random>`` and held under an exclusive
``flock`` for as long as its owner keeps it; the kernel lets the lock go when the owner dies,
however it dies. At start a worker sweeps the files of owners that are gone::

    <prefix><digits>-<hex>, a plain file (no link followed) of this user, lock free  ->  removed

The lock, not the pid, says whether the owner lives: containers that share ``/dev/shm`` each
have their own pids, so a pid says nothing about another container's process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Iterator

from kvswitch.worker.kv_layout import SHM_DIR, SHM_PREFIX

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# The most a worker keeps in transfer files, as a fraction of its /dev/shm's size: several
# workers share one, and a container's is small (64 MiB by default in Docker).
SHM_MAX_FRACTION = 0.25


class ShmRefused(Exception):
    """A shared-memory transfer cannot be had: the peer is on another host (or cannot open the
    file), or this host's shared memory has no room or is over this worker's cap."""


def host_id() -> str:
    """This worker's identity for shared memory: equal for two workers exactly when they see
    the same ``/dev/shm`` of the same running kernel; "" when there is none to share."""
    try:
        with open(BOOT_ID_PATH) as file:
            boot_id = file.read().strip()
        status = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot_id}/{status.st_dev}:{status.st_ino}"


def new_name(prefix: str) -> str:
    """A fresh path in ``/dev/shm`` for a file of this process: ``<prefix><pid>-<random>``."""
    return os.path.join(SHM_DIR, f"{prefix}{os.getpid()}-{secrets.token_hex(8)}")


def create_owned(path: str) -> int:
    """Create ``path`` (mode 0600, never through a link) and hold its lock; the descriptor,
    whose closing (or this process's death) lets the file be swept. OSError if it exists."""
    while True:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        descriptor = os.open(path, flags, 0o600)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        # NOTE: a sweep may have come between the create and the lock: then the name is gone
        # (or names another file), and the file is made again.
        with contextlib.suppress(FileNotFoundError):
            if _same_file(os.stat(path, follow_symlinks=False), os.fstat(descriptor)):
                return descriptor
        os.close(descriptor)


def owner_alive(descriptor: int) -> bool:
    """Whether the owner of the file open at ``descriptor`` (not this process's own lock)
    still holds it."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(descriptor, fcntl.LOCK_UN)
    return False


def sweep(prefix: str) -> list[str]:
    """Remove the files of ``prefix`` whose owners are gone (see above); their paths."""
    pattern = re.compile(re.escape(prefix) + r"\d+-[0-9a-f]+")
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not pattern.fullmatch(name):
            continue
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            descriptor = os.open(path, flags)
        except OSError:
            continue  # a link, gone already, or not ours to open
        try:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid():
                continue
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives
            with contextlib.suppress(FileNotFoundError):
                if _same_file(os.stat(path, follow_symlinks=False), status):
                    os.unlink(path)
                    removed.append(path)
        finally:
            os.close(descriptor)
    return removed


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class ShmFiles:
    """Files in this host's shared memory that peers write blocks into, kept between pulls: a
    new file's pages cost more to fault in than the blocks cost to copy. Each pull takes a file
    of its own (grown to the size it needs) and gives it back when it finished (one that failed
    is removed); ``close`` removes them all.

    At most ``max_bytes`` in all (default: ``SHM_MAX_FRACTION`` of ``/dev/shm``): files not in
    use are removed to make room, and a pull that still does not fit is refused
    (``ShmRefused``), before any file grows. Files of owners that died are swept on creation."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = _default_max_bytes() if max_bytes is None else max_bytes
        self.swept = sweep(SHM_PREFIX)
        self._free: list[str] = []
        self._locks: dict[str, int] = {}  # every file made here, with its lock's descriptor
        self.num_files_made = 0

    @property
    def num_bytes(self) -> int:
        """What the files made here take in shared memory."""
        return sum(os.fstat(descriptor).st_size for descriptor in self._locks.values())

    @contextlib.contextmanager
    def take(self, size: int) -> Iterator[str]:
        path = self._free.pop() if self._free else ""
        grow = size - (os.path.getsize(path) if path else 0)
        while self._free and self.num_bytes + max(grow, 0) > self.max_bytes:
            self._drop(self._free.pop())  # unused files give way to this pull
        if self.num_bytes + max(grow, 0) > self.max_bytes:
            if path:
                self._free.append(path)
            raise ShmRefused(
                f"no room for {size:,} bytes in {SHM_DIR}: this worker keeps at most "
                f"{self.max_bytes:,} bytes there ({self.num_bytes:,} in use)"
            )
        if not path:
            path = new_name(SHM_PREFIX)
            self._locks[path] = create_owned(path)
            self.num_files_made += 1
        try:
            if grow > 0:
                # NOTE: allocated now, not on first write: a full /dev/shm (a container's is 64
                # MiB) fails here, not as a SIGBUS in the peer's engine core mid-copy.
                os.posix_fallocate(self._locks[path], 0, size)
        except OSError as e:
            self._drop(path)
            raise ShmRefused(f"no room for {size:,} bytes in {SHM_DIR}: {e.strerror}") from None
        try:
            yield path
        except BaseException:
            # NOTE: a pull that did not finish may leave a peer still writing into the file:
            # it is never handed to another pull.
            self._drop(path)
            raise
        self._free.append(path)

    def _drop(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        descriptor = self._locks.pop(path, None)
        if descriptor is not None:
            os.close(descriptor)

    def close(self) -> None:
        for path in list(self._locks):
            self._drop(path)
        self._free.clear()


def _default_max_bytes() -> int:
    try:
        status = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return int(status.f_blocks * status.f_frsize * SHM_MAX_FRACTION)
