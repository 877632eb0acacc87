"""Shared memory between workers of one host: who shares it (host ids, seen from another mount
namespace), files of owners that died swept at start, the cap on a worker's transfer files, and a
dead peer's mapped cache let go. Owners are real processes, killed with SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvswitch.worker.kv_layout import CACHE_PREFIX, SHM_DIR, SHM_PREFIX, KVLayout
from kvswitch.worker.kv_transfer import PeerCaches
from kvswitch.worker.shared_memory import BOOT_ID_PATH, ShmFiles, ShmRefused, host_id, sweep

REPO = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(2, 16, 2, 64, "float32")
CACHE_BYTES = 4 * LAYOUT.bytes_per_block
# Makes a file as a worker does, says its path, and keeps it until its stdin closes.
OWNER = """
import os, sys
from kvswitch.worker.shared_memory import create_owned, new_name
path = new_name(sys.argv[1])
os.ftruncate(create_owned(path), int(sys.argv[2]))
print(path, flush=True)
sys.stdin.read()
"""


class Owner:
    def __init__(self, prefix: str, size: int = 4096) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", OWNER, prefix, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self.process.stdout is not None
        self.path = self.process.stdout.readline().strip()
        assert os.path.basename(self.path).startswith(f"{prefix}{self.process.pid}-")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        self.kill()
        if os.path.lexists(self.path):
            os.unlink(self.path)


@pytest.fixture
def owners() -> Iterator[list[Owner]]:
    made: list[Owner] = []
    yield made
    for owner in made:
        owner.close()


def in_namespace(setup: str) -> str:
    """This host's id as a process in a mount namespace of its own sees it, after ``setup``."""
    code = "from kvswitch.worker.shared_memory import host_id; print(host_id())"
    script = f'{setup} exec "$0" -c "$1"'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    return subprocess.run(
        [*command, sys.executable, code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_host_id_names_the_kernel_and_the_shared_memory_seen() -> None:
    ours = host_id()
    with open(BOOT_ID_PATH) as file:
        boot_id = file.read().strip()
    assert ours.startswith(f"{boot_id}/")
    assert in_namespace("") == ours  # another mount namespace, the same /dev/shm
    own_tmpfs = in_namespace(f"mount -t tmpfs tmpfs {SHM_DIR} &&")  # a pod's own /dev/shm
    assert own_tmpfs.startswith(f"{boot_id}/") and own_tmpfs != ours


def test_files_of_dead_owners_are_swept_at_start_and_no_others(owners, tmp_path) -> None:
    live, dead = Owner(SHM_PREFIX), Owner(SHM_PREFIX)
    dead_cache = Owner(CACHE_PREFIX)
    owners += [live, dead, dead_cache]
    dead.kill()
    dead_cache.kill()  # SIGKILL: neither removed its file
    assert os.path.exists(dead.path) and os.path.exists(dead_cache.path)
    target = tmp_path / "target"
    target.write_bytes(b"x")
    link = f"{SHM_DIR}/{SHM_PREFIX}{dead.process.pid}-0123abcd"
    os.symlink(target, link)  # named as ours, but a link: never followed, never removed
    other = f"{SHM_DIR}/{SHM_PREFIX}x{dead.process.pid}"  # not a name a worker makes
    Path(other).write_bytes(b"")
    try:
        files = ShmFiles()
        assert dead.path in files.swept
        assert not os.path.exists(dead.path)
        assert os.path.exists(live.path) and os.path.lexists(link) and os.path.exists(other)
        assert target.read_bytes() == b"x"
        with files.take(4096) as path:
            assert os.path.basename(path).startswith(f"{SHM_PREFIX}{os.getpid()}-")
            assert path not in ShmFiles().swept  # a live worker's file in use is not swept
        assert os.path.exists(path)  # kept for the next pull, still this worker's
        assert path not in ShmFiles().swept
        files.close()
        assert not os.path.exists(path)
        assert os.path.exists(dead_cache.path)  # a cache file: swept by its own kind's sweep
        assert dead_cache.path in sweep(CACHE_PREFIX)
        assert not os.path.exists(dead_cache.path)
    finally:
        os.unlink(link)
        os.unlink(other)


def test_transfer_files_are_capped_and_unused_ones_give_way() -> None:
    files = ShmFiles(max_bytes=3 * 4096)
    try:
        refused = pytest.raises(ShmRefused, match="keeps at most 12,288 bytes")
        with files.take(2 * 4096), refused, files.take(2 * 4096):
            pass
        assert files.num_bytes == 2 * 4096  # the first, kept; the refused one never made
        with files.take(3 * 4096) as path:  # the kept file grows to fit
            assert os.path.getsize(path) == 3 * 4096
        with files.take(4096), pytest.raises(ShmRefused, match="no room for"), files.take(4096):
            pass
    finally:
        files.close()
    assert files.num_bytes == 0


def test_a_dead_or_restarted_peers_mapped_cache_is_let_go(owners) -> None:
    first = Owner(CACHE_PREFIX, CACHE_BYTES)
    owners.append(first)
    caches = PeerCaches()
    try:
        mapped = caches.get(first.path, LAYOUT, 4)
        assert caches.get(first.path, LAYOUT, 4) is mapped  # mapped once, kept while it lives
        assert not mapped.stale
        first.kill()  # its file stays behind: nobody swept it yet
        assert os.path.exists(first.path) and mapped.stale
        restarted = Owner(CACHE_PREFIX, CACHE_BYTES)
        owners.append(restarted)
        caches.get(restarted.path, LAYOUT, 4)
        assert caches.paths == [restarted.path]  # the dead one's mapping is gone
        assert mapped.tensors is None
        os.unlink(restarted.path)  # removed (a clean stop): let go at the next use too
        with pytest.raises(ValueError, match="cannot open"):
            caches.get(restarted.path, LAYOUT, 4)
        assert caches.paths == []
    finally:
        caches.close()
