"""A worker server on its own event-loop thread, driven by blocking gRPC clients in tests."""

from __future__ import annotations

import asyncio
import glob
import os
import threading
import time
from pathlib import Path

import grpc

from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.kv_layout import CACHE_PREFIX, SHM_DIR, SHM_PREFIX
from kvswitch.worker.server import WorkerConfig, WorkerServer, start_worker


def shm_files(*workers: BackgroundWorker, prefixes: tuple[str, ...] = (SHM_PREFIX,)) -> set[str]:
    """The files of ``prefixes`` in /dev/shm made by this process or by the engine cores of
    ``workers`` (a file's name carries its maker's pid): tests running beside this one, in
    other processes, make theirs there too."""
    owners = {os.getpid(), *(w.server.engine.pid for w in workers)}
    found = set()
    for prefix in prefixes:
        for path in glob.glob(f"{SHM_DIR}/{prefix}*"):
            pid = os.path.basename(path).removeprefix(prefix).partition("-")[0]
            if pid.isdigit() and int(pid) in owners:
                found.add(path)
    return found


TRANSFER_AND_CACHE = (SHM_PREFIX, CACHE_PREFIX)


class BackgroundWorker:
    """A worker on its own event-loop thread, with a blocking client channel to it."""

    def __init__(self, config: WorkerConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server: WorkerServer = self._run(start_worker(config))
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    def close(self) -> None:
        self.channel.close()
        self._run(self.server.stop(grace_s=0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def generate(
        self, prompt: list[int], *, timeout: float = 30, **kwargs
    ) -> tuple[list[int], str, worker_pb2.WorkerGenerateFinal]:
        """(output tokens, their text, the final message) of one Generate call."""
        lora = kwargs.pop("lora", "")
        request = worker_pb2.WorkerGenerateRequest(
            request_id=kwargs.pop("request_id", ""),
            prompt_token_ids=prompt,
            hold_blocks_ms=kwargs.pop("hold_blocks_ms", 0),
            sampling=common_pb2.SamplingParams(**kwargs),
            lora=lora,
        )
        responses = list(self.stub.Generate(request, timeout=timeout))
        assert all(r.HasField("chunk") for r in responses[:-1])
        assert responses[-1].HasField("final")
        tokens = [t for r in responses[:-1] for t in r.chunk.token_ids]
        text = "".join(r.chunk.text for r in responses[:-1])
        return tokens, text, responses[-1].final

    def load(self) -> worker_pb2.WorkerLoad:
        return self.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)

    def wait_for_free_blocks(self, num_free: int, timeout_s: float = 5.0) -> int:
        """The free blocks once ``num_free`` are (or when ``timeout_s`` has passed): a load
        report follows the engine's step that changed it, not the RPC that asked for it."""
        deadline = time.monotonic() + timeout_s
        while (free := self.load().num_free_blocks) != num_free and time.monotonic() < deadline:
            time.sleep(0.01)
        return free

    def wait_until_idle(self, timeout_s: float = 5.0) -> worker_pb2.WorkerLoad:
        deadline = time.monotonic() + timeout_s
        while True:
            load = self.load()
            idle = load.num_running_requests == 0 and load.num_waiting_requests == 0
            if (idle and load.num_free_blocks == load.num_total_blocks) or (
                time.monotonic() > deadline
            ):
                return load
            time.sleep(0.02)


def engine_core_pids(parent_pid: int) -> list[int]:
    """The processes ``parent_pid`` started with multiprocessing's spawn."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids
