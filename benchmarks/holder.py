"""``kvswitch bench holder``: what serving pulls of its cached KV costs a worker's own decodes.

Two ``kvswitch worker`` processes run on this machine (built-in model, 16-token blocks of 32 KiB
in fp32). The holder computes ``--num-prompts`` prompts of ``--prompt-tokens`` tokens, which stay
cached there. Then, once per phase, ``--num-streams`` decode streams run on the holder for
``--duration-s`` (short random prompts, ``--output-tokens`` each, one after another per stream):

- ``none``: the streams alone;
- then one phase per transport of ``--transports`` (``grpc``, ``shm``, ``mapped``, ``nixl``):
  the other worker pulls the cached prompts from the holder meanwhile, one after another, round
  and round (``Worker.PullBlocks``; its cache holds one prompt, so each pull moves every block
  again). Over ``grpc`` and ``shm`` the holder's engine loop copies every block out between
  its steps; over ``mapped`` and ``nixl`` it only leases the blocks and answers their ids, and
  the reader copies them (``nixl``: one-sided, its kernel copying through CMA on one host; the
  holder's NIXL progress thread runs from its first answer on).

Figures per phase: the streams' inter-token latency (the gap between two chunks over the tokens
in the later one) mean / p50 / p99 and how many tokens they decoded a second; with pulls, their
count and GB/s (10^9 bytes a second, each pull timed from call to answer).
"""

from __future__ import annotations

import itertools
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvswitch.benchmarks.timing import machine_info, percentile
from kvswitch.serving import start_server_process

BLOCK_SIZE = 16
BLOCK_BYTES = 32 << 10  # the built-in model's, in fp32
TRANSPORTS = ("grpc", "shm", "mapped", "nixl")
SHORT_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class HolderBenchConfig:
    transports: str = "grpc,nixl"
    num_streams: int = 4
    output_tokens: int = 128
    num_prompts: int = 4
    prompt_tokens: int = 8192
    duration_s: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.transport_list()
        for name in ("num_streams", "output_tokens", "duration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.num_prompts < 2:
            raise ValueError("num_prompts must be at least 2: pulls go round them")
        if self.prompt_tokens < BLOCK_SIZE or self.prompt_tokens % BLOCK_SIZE:
            raise ValueError(f"prompt_tokens must be a multiple of {BLOCK_SIZE}")

    def transport_list(self) -> list[str]:
        names = [name for name in self.transports.split(",") if name]
        unknown = [name for name in names if name not in TRANSPORTS]
        if not names or unknown or len(set(names)) != len(names):
            raise ValueError(
                f"transports must be distinct names of {', '.join(TRANSPORTS)}, comma-separated, "
                f"not {self.transports!r}"
            )
        return names


def run(config: HolderBenchConfig) -> dict[str, Any]:
    import grpc

    from kvswitch.cache_index.hashing import hash_prompt_blocks, tokens_to_bytes
    from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    prompt_blocks = config.prompt_tokens // BLOCK_SIZE
    common = ["--port", "0", "--block-size", str(BLOCK_SIZE), "--model", "random:tiny-long"]
    # NOTE: mapped reads the holder's cache file (--kv-cache-shm); PullBlocks is for benchmarks.
    common += ["--kv-cache-shm", "--allow-pull-blocks"]
    holder_blocks = config.num_prompts * (prompt_blocks + 8) + 64 * config.num_streams + 256
    # NOTE: room for one prompt exactly: each pull evicts every block of the one before.
    taker_blocks = prompt_blocks
    workers = [
        start_server_process(["worker", *common, "--kv-cache-bytes", str(blocks * BLOCK_BYTES)])
        for blocks in (holder_blocks, taker_blocks)
    ]
    try:
        (_, holder_address), (_, taker_address) = workers
        holder = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(holder_address))
        rng = np.random.default_rng(config.seed)
        prompts = [
            rng.integers(0, 256, config.prompt_tokens, dtype=np.uint32)
            for _ in range(config.num_prompts)
        ]
        print(
            f"  the holder computes {config.num_prompts} prompts of {config.prompt_tokens:,} "
            "tokens ...",
            file=sys.stderr,
        )

        def hold_prompts(phase: str) -> None:
            """Compute the prompts (cached after the first time), their blocks held for the
            phase: else the streams' requests would evict them."""
            for i, prompt in enumerate(prompts):
                request = worker_pb2.WorkerGenerateRequest(
                    request_id=f"prompt-{i}-{phase}",
                    prompt_token_ids_u32le=tokens_to_bytes(prompt),
                    sampling=common_pb2.SamplingParams(max_tokens=1),
                    hold_blocks_ms=int((config.duration_s + 60) * 1000),
                )
                for _ in holder.Generate(request, timeout=600):
                    pass

        hold_prompts("first")
        namespace = next(iter(holder.Snapshot(worker_pb2.SnapshotRequest()))).model
        chains = [hash_prompt_blocks(p.tolist(), BLOCK_SIZE, namespace) for p in prompts]
        phases: dict[str, Any] = {}
        # NOTE: one order over every phase: the next prompt is never the one the taker holds.
        order = itertools.cycle(range(len(chains)))
        for phase in ["none", *config.transport_list()]:
            print(f"  {phase}: {config.duration_s:g} s of decode streams ...", file=sys.stderr)
            hold_prompts(phase)
            phases[phase] = _phase(
                config, holder, holder_address, taker_address, chains, order, phase
            )
            itl = phases[phase]["itl_ms"]
            pulls = phases[phase].get("pull_gbps")
            print(
                f"    ITL p50 {itl['p50']:.1f} ms, p99 {itl['p99']:.1f} ms"
                + (f"; pulls {pulls:.2f} GB/s" if pulls is not None else ""),
                file=sys.stderr,
            )
    finally:
        for popen, _ in workers:
            popen.terminate()
        for popen, _ in workers:
            popen.wait(timeout=30)
    return {
        "machine": machine_info(),
        "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
        "prompt_bytes": prompt_blocks * BLOCK_BYTES,
        "phases": phases,
    }


def _phase(
    config: HolderBenchConfig,
    holder: Any,
    holder_address: str,
    taker_address: str,
    chains: list[list[bytes]],
    order: Iterator[int],
    transport: str,
) -> dict[str, Any]:
    """One phase: the streams on the holder for ``duration_s``, with the taker pulling the
    chains in ``order`` over ``transport`` meanwhile (none for "none")."""
    import grpc

    from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    rng = random.Random(config.seed)
    lock = threading.Lock()
    streams: list[list[tuple[float, int]]] = []  # per request: (arrival, tokens in the chunk)
    pulls: list[tuple[int, float]] = []  # (bytes, seconds)
    failures: list[BaseException] = []
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            with lock:
                prompt = [rng.randrange(256) for _ in range(SHORT_PROMPT_TOKENS)]
            request = worker_pb2.WorkerGenerateRequest(
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=config.output_tokens),
            )
            chunks = []
            for response in holder.Generate(request, timeout=300):
                if response.HasField("chunk"):
                    chunks.append((time.monotonic(), len(response.chunk.token_ids)))
            streams.append(chunks)

    def pull() -> None:
        taker = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(taker_address))
        while not stop.is_set():
            i = next(order)
            start = time.perf_counter()
            reply = taker.PullBlocks(
                worker_pb2.PullBlocksRequest(
                    request_id=f"bench-{transport}-{len(pulls)}",
                    peer_address=holder_address,
                    block_hashes=chains[i],
                    transport=transport,
                ),
                timeout=300,
            )
            seconds = time.perf_counter() - start
            if reply.num_transferred_blocks != len(chains[i]) or reply.transport != transport:
                raise RuntimeError(
                    f"pull {len(pulls)} (prompt {i}): {reply.num_transferred_blocks} of "
                    f"{len(chains[i])} blocks over "
                    f"{reply.transport!r}, not {transport}"
                )
            pulls.append((reply.num_transferred_bytes, seconds))

    def guarded(target: Any) -> None:
        try:
            target()
        except BaseException as e:
            failures.append(e)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(stream,)) for _ in range(config.num_streams)]
    if transport != "none":
        threads.append(threading.Thread(target=guarded, args=(pull,)))
    start = time.monotonic()
    for thread in threads:
        thread.start()
    stop.wait(config.duration_s)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed_s = time.monotonic() - start
    if failures:
        raise RuntimeError(f"the {transport} phase failed: {failures[0]!r}") from failures[0]
    itls_ms = []
    for chunks in streams:
        for (before, _), (after, num_tokens) in itertools.pairwise(chunks):
            itls_ms += [(after - before) * 1e3 / num_tokens] * num_tokens
    figures: dict[str, Any] = {
        "itl_ms": {
            "mean": statistics.fmean(itls_ms),
            "p50": percentile(itls_ms, 0.5),
            "p99": percentile(itls_ms, 0.99),
        },
        "decode_tokens_per_s": sum(n for chunks in streams for _, n in chunks) / elapsed_s,
    }
    if transport != "none":
        num_bytes, seconds = sum(b for b, _ in pulls), sum(s for _, s in pulls)
        figures["num_pulls"] = len(pulls)
        figures["pull_gbps"] = num_bytes / seconds / 1e9 if seconds else 0.0
    return figures
