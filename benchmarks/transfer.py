"""``kvswitch bench transfer``: how fast cached KV blocks move between two worker processes.

Two ``kvswitch worker`` processes run on this machine (built-in model, 16-token blocks of 32 KiB
in fp32). The holder computes ``num_prompts`` distinct prompts of ``prompt_tokens`` tokens; then,
for each prompt, the taker is asked to pull the prompt's chain from the holder
(``Worker.PullBlocks``: the holder streams the blocks over gRPC on loopback in chunks of 4 MiB,
each read out between two of its engine steps; the taker writes each chunk into its own prefix
cache as it arrives). Every pull is timed from the call to its answer.

- ``grpc_gbps``: bytes moved over all pulls / their summed time, in GB/s (10^9 bytes).
- ``blocks_per_s``: blocks moved / the same time.
- ``copy_gbps``: this machine's memory-copy bandwidth (one numpy copy of 256 MiB, best of 5),
  the ceiling any transfer on it is measured against.

The same-host shared-memory path is not built yet, so there is no ``shm_gbps``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvswitch.benchmarks.timing import machine_info
from kvswitch.serving import READY_MARK


@dataclass(frozen=True)
class TransferBenchConfig:
    num_prompts: int = 4
    prompt_tokens: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts <= 0 or self.prompt_tokens < 16:
            raise ValueError("num_prompts must be positive and prompt_tokens at least 16")


BLOCK_SIZE = 16


def run(config: TransferBenchConfig) -> dict[str, object]:
    import grpc

    from kvswitch.cache_index.hashing import hash_prompt_blocks, tokens_to_bytes
    from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    # Room for every prompt on both workers, with some to spare.
    num_blocks = config.num_prompts * (config.prompt_tokens // BLOCK_SIZE + 8) + 64
    kv_cache_bytes = num_blocks * (32 << 10)
    workers = [_start_worker(kv_cache_bytes) for _ in range(2)]
    try:
        (_, holder_address), (_, taker_address) = workers
        holder = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(holder_address))
        taker = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(taker_address))
        rng = np.random.default_rng(config.seed)
        prompts = [
            rng.integers(0, 256, config.prompt_tokens, dtype=np.uint32)
            for _ in range(config.num_prompts)
        ]
        print(
            f"  the holder computes {config.num_prompts} prompts of "
            f"{config.prompt_tokens:,} tokens ...",
            file=sys.stderr,
        )
        for prompt in prompts:
            request = worker_pb2.WorkerGenerateRequest(
                prompt_token_ids_u32le=tokens_to_bytes(prompt),
                sampling=common_pb2.SamplingParams(max_tokens=1),
            )
            for _ in holder.Generate(request, timeout=600):
                pass
        namespace = next(iter(holder.Snapshot(worker_pb2.SnapshotRequest()))).model
        seconds = 0.0
        num_bytes = num_moved = 0
        for i, prompt in enumerate(prompts):
            hashes = hash_prompt_blocks(prompt.tolist(), BLOCK_SIZE, namespace)
            start = time.perf_counter()
            reply = taker.PullBlocks(
                worker_pb2.PullBlocksRequest(
                    request_id=f"bench-{i}", peer_address=holder_address, block_hashes=hashes
                ),
                timeout=600,
            )
            seconds += time.perf_counter() - start
            if reply.num_transferred_blocks != len(hashes):
                raise RuntimeError(f"pulled {reply.num_transferred_blocks} of {len(hashes)} blocks")
            num_bytes += reply.num_transferred_bytes
            num_moved += reply.num_transferred_blocks
    finally:
        for popen, _ in workers:
            popen.terminate()
        for popen, _ in workers:
            popen.wait(timeout=30)
    result = {
        "machine": machine_info(),
        "num_prompts": config.num_prompts,
        "prompt_tokens": config.prompt_tokens,
        "num_blocks": num_moved,
        "num_bytes": num_bytes,
        "grpc_gbps": num_bytes / seconds / 1e9,
        "blocks_per_s": num_moved / seconds,
        "copy_gbps": _copy_gbps(),
    }
    print(
        f"  {num_moved:,} blocks ({num_bytes / 1e6:,.0f} MB) in {seconds:.2f} s: "
        f"{result['grpc_gbps']:.2f} GB/s over gRPC; memory copy {result['copy_gbps']:.1f} GB/s",
        file=sys.stderr,
    )
    return result


def _start_worker(kv_cache_bytes: int) -> tuple[subprocess.Popen, str]:
    popen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvswitch.app.cli",
            "worker",
            "--port",
            "0",
            "--kv-cache-bytes",
            str(kv_cache_bytes),
            "--block-size",
            str(BLOCK_SIZE),
            "--model",
            "random:tiny-long",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert popen.stdout is not None
    for line in popen.stdout:
        if READY_MARK in line:
            return popen, line.split(READY_MARK, 1)[1].strip()
    raise RuntimeError("a worker did not start")


def _copy_gbps() -> float:
    source = np.ones(256 << 20, np.uint8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return source.nbytes / best / 1e9
