"""``kvswitch bench transfer``: how fast cached KV blocks move between worker processes.

Four ``kvswitch worker`` processes run on this machine (built-in model, 16-token blocks of 32 KiB
in fp32, KV caches in shared memory: ``--kv-cache-shm``). The holder computes ``num_prompts``
distinct prompts of ``prompt_tokens`` tokens; then three takers pull every prompt's chain from it
(``Worker.PullBlocks``, which a worker serves only with ``--allow-pull-blocks``, a switch for
benchmarks: its caller names the peer), one over each transport:

- ``grpc``: the holder streams the blocks over gRPC on loopback in chunks of 1 MiB, each read out
  between two of its engine steps; the taker writes each chunk into its prefix cache as it
  arrives.
- ``shm``: the taker makes a file in this host's shared memory; the holder's engine core writes
  the blocks straight into it, chunk by chunk, and the taker's engine core reads them from there;
  gRPC carries only the chunks' counts.
- ``mapped``: the holder holds the blocks under a lease and answers their ids in its cache file;
  the taker's engine core copies them straight out of it (one copy) and releases the lease.

Every pull is timed from the call to its answer. Figures:

- ``grpc_gbps``, ``shm_gbps``, ``mapped_gbps``: bytes moved over all pulls of that transport /
  their summed time, in GB/s (10^9 bytes); ``blocks_per_s``: blocks moved over gRPC / the same
  time, and ``shm_blocks_per_s``, ``mapped_blocks_per_s`` the other two.
- ``copy_gbps``: this machine's memory-copy bandwidth (one numpy copy of 256 MiB, best of 5),
  the ceiling any transfer on it is measured against.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvswitch.benchmarks.timing import machine_info
from kvswitch.serving import start_server_process


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
    args = ["worker", "--port", "0", "--kv-cache-bytes", str(kv_cache_bytes)]
    args += ["--block-size", str(BLOCK_SIZE), "--model", "random:tiny-long", "--kv-cache-shm"]
    args += ["--allow-pull-blocks"]
    workers = [start_server_process(args) for _ in range(4)]
    try:
        holder_address = workers[0][1]
        holder, *takers = (
            worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address)) for _, address in workers
        )
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
        chains = [hash_prompt_blocks(p.tolist(), BLOCK_SIZE, namespace) for p in prompts]
        moved = {
            transport: _pull_all(taker, holder_address, chains, transport)
            for taker, transport in zip(takers, ("grpc", "shm", "mapped"), strict=True)
        }
    finally:
        for popen, _ in workers:
            popen.terminate()
        for popen, _ in workers:
            popen.wait(timeout=30)
    (grpc_blocks, grpc_bytes, grpc_s), (shm_blocks, shm_bytes, shm_s) = moved["grpc"], moved["shm"]
    mapped_blocks, mapped_bytes, mapped_s = moved["mapped"]
    result = {
        "machine": machine_info(),
        "num_prompts": config.num_prompts,
        "prompt_tokens": config.prompt_tokens,
        "num_blocks": grpc_blocks,
        "num_bytes": grpc_bytes,
        "grpc_gbps": grpc_bytes / grpc_s / 1e9,
        "blocks_per_s": grpc_blocks / grpc_s,
        "shm_gbps": shm_bytes / shm_s / 1e9,
        "shm_blocks_per_s": shm_blocks / shm_s,
        "mapped_gbps": mapped_bytes / mapped_s / 1e9,
        "mapped_blocks_per_s": mapped_blocks / mapped_s,
        "copy_gbps": _copy_gbps(),
    }
    print(
        f"  {grpc_blocks:,} blocks ({grpc_bytes / 1e6:,.0f} MB) each way: "
        f"{result['grpc_gbps']:.2f} GB/s over gRPC, {result['shm_gbps']:.2f} GB/s through "
        f"shared memory, {result['mapped_gbps']:.2f} GB/s out of the holder's cache; memory "
        f"copy {result['copy_gbps']:.1f} GB/s",
        file=sys.stderr,
    )
    return result


def _pull_all(
    taker: Any, holder_address: str, chains: list[list[bytes]], transport: str
) -> tuple[int, int, float]:
    """Pull every chain into ``taker`` over ``transport``: (blocks, bytes, seconds)."""
    from kvswitch.v1 import worker_pb2

    seconds = 0.0
    num_blocks = num_bytes = 0
    for i, hashes in enumerate(chains):
        start = time.perf_counter()
        reply = taker.PullBlocks(
            worker_pb2.PullBlocksRequest(
                request_id=f"bench-{transport}-{i}",
                peer_address=holder_address,
                block_hashes=hashes,
                transport=transport,
            ),
            timeout=600,
        )
        seconds += time.perf_counter() - start
        if reply.num_transferred_blocks != len(hashes) or reply.transport != transport:
            raise RuntimeError(
                f"pulled {reply.num_transferred_blocks} of {len(hashes)} blocks over "
                f"{reply.transport!r}, not {transport}"
            )
        num_blocks += reply.num_transferred_blocks
        num_bytes += reply.num_transferred_bytes
    return num_blocks, num_bytes, seconds


def _copy_gbps() -> float:
    source = np.ones(256 << 20, np.uint8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return source.nbytes / best / 1e9
