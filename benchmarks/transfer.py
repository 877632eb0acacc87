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

``--transport nixl``: no workers; a holder process registers a KV cache with a NIXL agent
(``kvswitch.worker.nixl_kv``), every byte of it known (each 8-byte word its own index in its
tensor, the tensor's number in the top bits), and this process reads a prompt's blocks out of
it for each length of ``--nixl-prompt-tokens``, ``--num-prompts`` reads each, one-sided: each read
one NIXL READ into this process's own cache, every byte checked after it. The layout, by default
Llama 3.2 1B's KV (16 layers x 8 KV heads x 64 dims, bfloat16): 32 KiB a token, 512 KiB a block.
Each length is read twice over: its blocks in one run of consecutive ids on both sides (a
descriptor per tensor), then scattered (every other block of the holder's: a descriptor per
block and tensor). ``UCX_TLS`` as the environment sets it (unset: UCX's own choice).
``--across-hosts``: the holder runs on a host of its own, a network namespace wired to this
process's through a bridge (veth pairs, 1500-byte frames; root), and UCX is told to use TCP, as
it would between two machines without RDMA (run it as its own process: UCX keeps the routes it
saw at its first use in a process, and the namespace's link is made by the benchmark). Figures:

- ``nixl_gbps``, ``nixl_blocks_per_s``: bytes and blocks over all consecutive reads / their
  summed time (each read timed from the call to its return: descriptors, post, wait);
  ``scattered_gbps`` the same for the scattered reads; ``prompts``: each length's own figures.
- ``copy_gbps``: one numpy copy of as many bytes, in this process, timed as often: the copy a
  transfer of the same bytes is measured against.
- ``connect_ms``: the first read of one block, which connects to the holder.
- ``idle_cpu_per_s``: CPU-seconds this process spends per second doing nothing, its agent made
  and its reads done (NIXL's progress thread: about 1, a core, where it spins).
- ``link_bytes`` (``--across-hosts``): bytes the holder's host sent over its link meanwhile, at
  least every byte read (else the reads did not cross it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvswitch.benchmarks.timing import BenchmarkUnavailable, machine_info
from kvswitch.serving import start_server_process
from kvswitch.worker.kv_layout import KVLayout

if TYPE_CHECKING:
    from kvswitch.deploy.netns import NetnsHosts


@dataclass(frozen=True)
class TransferBenchConfig:
    num_prompts: int = 4
    prompt_tokens: int = 8192
    seed: int = 0
    transport: str = ""
    nixl_prompt_tokens: str = "1024,4096,16384"
    nixl_kv_layout: str = "16x8x64:bfloat16"
    across_hosts: bool = False

    def __post_init__(self) -> None:
        if self.num_prompts <= 0 or self.prompt_tokens < 16:
            raise ValueError("num_prompts must be positive and prompt_tokens at least 16")
        if self.transport not in ("", "nixl"):
            raise ValueError(
                f"transport must be nixl, or empty for the workers' grpc, shm and mapped "
                f"pulls, not {self.transport!r}"
            )
        self.nixl_lengths()  # NOTE: checked whatever the transport
        self.nixl_layout()
        defaults = TransferBenchConfig.__dataclass_fields__
        if self.transport == "nixl":
            if self.prompt_tokens != defaults["prompt_tokens"].default or self.seed != 0:
                raise ValueError(
                    "prompt_tokens and --seed are for the workers' pulls; with --transport "
                    "nixl, nixl_prompt_tokens"
                )
        elif (self.nixl_prompt_tokens, self.nixl_kv_layout, self.across_hosts) != (
            defaults["nixl_prompt_tokens"].default,
            defaults["nixl_kv_layout"].default,
            False,
        ):
            raise ValueError(
                "nixl_prompt_tokens, nixl_kv_layout and across_hosts are for --transport nixl"
            )

    def nixl_lengths(self) -> list[int]:
        try:
            lengths = [int(part) for part in self.nixl_prompt_tokens.split(",")]
        except ValueError:
            lengths = []
        if not lengths or any(n < BLOCK_SIZE or n % BLOCK_SIZE for n in lengths):
            raise ValueError(
                f"nixl_prompt_tokens must be comma-separated multiples of {BLOCK_SIZE}, not "
                f"{self.nixl_prompt_tokens!r}"
            )
        return lengths

    def nixl_layout(self) -> KVLayout:
        match = re.fullmatch(r"(\d+)x(\d+)x(\d+):(float32|float16|bfloat16)", self.nixl_kv_layout)
        sizes = [int(n) for n in match.groups()[:3]] if match else [0]
        if min(sizes) <= 0:
            raise ValueError(
                "nixl_kv_layout must read LAYERSxKV_HEADSxHEAD_DIM:DTYPE (float32, float16 or "
                f"bfloat16), e.g. 16x8x64:bfloat16, not {self.nixl_kv_layout!r}"
            )
        layers, heads, dims = sizes
        return KVLayout(layers, BLOCK_SIZE, heads, dims, match.group(4))


BLOCK_SIZE = 16
# --across-hosts: the holder's and this process's addresses, away from the multi-host tests'.
ACROSS_HOSTS_SUBNET = "10.201.0"


def run(config: TransferBenchConfig) -> dict[str, object]:
    if config.transport == "nixl":
        return _run_nixl(config)
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


# -- --transport nixl ----------------------------------------------------------------------------


def _idle_cpu_per_s(seconds: float = 2.0) -> float:
    """This process's CPU time over ``seconds`` of doing nothing, per second."""
    before, start = os.times(), time.perf_counter()
    time.sleep(seconds)
    after = os.times()
    used = (after.user - before.user) + (after.system - before.system)
    return used / (time.perf_counter() - start)


def _run_nixl(config: TransferBenchConfig) -> dict[str, object]:
    from kvswitch.worker.nixl_kv import NixlKVAgent, NixlPeerInfo, NixlUnavailable, load_nixl

    try:
        load_nixl()
    except NixlUnavailable as e:
        raise BenchmarkUnavailable(str(e)) from None
    layout = config.nixl_layout()
    lengths = config.nixl_lengths()
    max_blocks = max(lengths) // BLOCK_SIZE
    # Room for the longest prompt's blocks scattered over every other block.
    hold = [
        sys.executable,
        "-m",
        __name__,
        "--hold",
        json.dumps(asdict(layout)),
        str(2 * max_blocks),
    ]
    hosts, link_bytes = None, None
    with contextlib.ExitStack() as stack:
        if config.across_hosts:
            hosts = _hosts()
            stack.callback(hosts.close)
            # NOTE: on one machine UCX would read through CMA, network namespaces or not; and
            # each side names its link, or UCX connects from every interface it has (from an
            # address the other host has no route back to).
            hold = [*hosts.prefix_for("holder"), "env", "UCX_NET_DEVICES=eth0", *hold]
            stack.enter_context(_environ(UCX_TLS="tcp", UCX_NET_DEVICES=hosts.here_device))
        holder = subprocess.Popen(hold, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        stack.callback(_stop, holder)
        line = holder.stdout.readline()  # NOTE: it exits, closing its stdout, if it fails
        if not line.startswith(b"{"):
            raise RuntimeError(f"the holder process did not publish its NIXL agent: {line!r}")
        peer = NixlPeerInfo.from_bytes(line)
        caches = _caches(layout, max_blocks, fill=False)
        before, ucx_tls = _tx_bytes(hosts), os.environ.get("UCX_TLS", "")
        with NixlKVAgent(caches, name=f"bench-reader-{os.getpid()}") as reader:
            start = time.perf_counter()
            reader.read_blocks(peer, [0], [0], timeout_s=60)
            connect_ms = (time.perf_counter() - start) * 1e3
            rows = [
                _read_prompt(reader, peer, caches, num_tokens, config.num_prompts)
                for num_tokens in lengths
            ]
            idle_cpu_per_s = _idle_cpu_per_s()
        if hosts is not None:
            link_bytes = _tx_bytes(hosts) - before
    total = {key: sum(row[key] for row in rows) for key in rows[0] if key.startswith("_")}
    result = {
        "machine": machine_info(),
        "transport": "nixl",
        "ucx_tls": ucx_tls,
        "across_hosts": config.across_hosts,
        # Bytes the holder's host sent over its link during the reads (across hosts only): at
        # least every byte read, or the reads did not cross it.
        "link_bytes": link_bytes,
        "kv_layout": asdict(layout),
        "bytes_per_token": layout.bytes_per_block // BLOCK_SIZE,
        "num_reads": config.num_prompts,
        "connect_ms": connect_ms,
        "idle_cpu_per_s": idle_cpu_per_s,
        "nixl_gbps": total["_bytes"] / total["_nixl_s"] / 1e9,
        "nixl_blocks_per_s": total["_blocks"] / total["_nixl_s"],
        "scattered_gbps": total["_bytes"] / total["_scattered_s"] / 1e9,
        "copy_gbps": total["_bytes"] / total["_copy_s"] / 1e9,
        "prompts": [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows],
    }
    for row in result["prompts"]:
        print(
            f"  {row['prompt_tokens']:>6,} tokens, {row['num_bytes'] / 1e6:,.0f} MB: NIXL "
            f"{row['nixl_gbps']:.2f} GB/s ({row['num_descriptors']} descriptors), scattered "
            f"{row['scattered_gbps']:.2f} GB/s ({row['scattered_num_descriptors']:,}), memory "
            f"copy {row['copy_gbps']:.2f} GB/s",
            file=sys.stderr,
        )
    return result


def _read_prompt(
    reader: Any, peer: Any, caches: list, num_tokens: int, num_reads: int
) -> dict[str, Any]:
    """Read one prompt's blocks ``num_reads`` times consecutive, as often scattered, and copy
    as many bytes as often; each read checked."""
    num_blocks = num_tokens // BLOCK_SIZE
    block_ids = list(range(num_blocks))
    # The holder's ids: one run (the second half of its cache), or every other block.
    ways = {
        "nixl": list(range(num_blocks, 2 * num_blocks)),
        "scattered": list(range(0, 2 * num_blocks, 2)),
    }
    seconds = {"nixl": 0.0, "scattered": 0.0, "copy": 0.0}
    num_descriptors = {}
    num_bytes = num_blocks * reader.layout.bytes_per_block
    # NOTE: both written first: a copy into pages not yet faulted in measures the faults.
    source, target = np.ones(num_bytes, np.uint8), np.ones(num_bytes, np.uint8)
    for _ in range(num_reads):
        for way, peer_ids in ways.items():
            for key, value in caches:
                key[:num_blocks].zero_()
                value[:num_blocks].zero_()
            start = time.perf_counter()
            read = reader.read_blocks(peer, peer_ids, block_ids, timeout_s=60)
            seconds[way] += time.perf_counter() - start
            num_descriptors[way] = read.num_descriptors
            _check(caches, peer_ids, block_ids)
        start = time.perf_counter()
        np.copyto(target, source)
        seconds["copy"] += time.perf_counter() - start
    num_bytes *= num_reads
    return {
        "prompt_tokens": num_tokens,
        "num_blocks": num_blocks,
        "num_bytes": num_bytes // num_reads,
        "num_descriptors": num_descriptors["nixl"],
        "scattered_num_descriptors": num_descriptors["scattered"],
        "nixl_gbps": num_bytes / seconds["nixl"] / 1e9,
        "nixl_blocks_per_s": num_blocks * num_reads / seconds["nixl"],
        "read_ms": seconds["nixl"] / num_reads * 1e3,
        "scattered_gbps": num_bytes / seconds["scattered"] / 1e9,
        "copy_gbps": num_bytes / seconds["copy"] / 1e9,
        "_bytes": num_bytes,
        "_blocks": num_blocks * num_reads,
        "_nixl_s": seconds["nixl"],
        "_scattered_s": seconds["scattered"],
        "_copy_s": seconds["copy"],
    }


def _hosts() -> NetnsHosts:
    """A holder host in a network namespace of its own, and this process's namespace wired to
    the same switch."""
    from kvswitch.deploy.netns import NetnsHosts, NetnsUnavailable

    try:
        hosts = NetnsHosts(subnet=ACROSS_HOSTS_SUBNET)
    except NetnsUnavailable as e:
        raise BenchmarkUnavailable(f"--across-hosts needs network namespaces (root): {e}") from None
    try:
        hosts.add("holder", 2)
        hosts.attach_here(1)
    except Exception:
        hosts.close()
        raise
    return hosts


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """This process's environment (and its children's) with ``values`` set, for a while."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _tx_bytes(hosts: NetnsHosts | None) -> int:
    if hosts is None:
        return 0
    return int(hosts.run("holder", "cat", "/sys/class/net/eth0/statistics/tx_bytes").stdout)


def _stop(holder: subprocess.Popen) -> None:
    holder.stdin.close()  # the holder's cue to go
    try:
        holder.wait(timeout=30)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()


def _hold(layout_fields: dict[str, Any], num_blocks: int) -> None:
    """The holder process: a KV cache of known bytes behind a NIXL agent, its peer info printed
    (one line), held until its stdin closes."""
    from kvswitch.worker.nixl_kv import NixlKVAgent

    caches = _caches(KVLayout(**layout_fields), num_blocks, fill=True)
    with NixlKVAgent(caches, name=f"bench-holder-{os.getpid()}") as agent:
        sys.stdout.buffer.write(agent.peer_info().to_bytes() + b"\n")
        sys.stdout.flush()
        sys.stdin.buffer.read()


def _caches(layout: KVLayout, num_blocks: int, *, fill: bool) -> list:
    """A KV cache of ``layout``, zeroed, or with ``fill`` every 8-byte word set to
    ``_words``' value for it."""
    import torch

    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    tensors = [torch.zeros(shape, dtype=dtype) for _ in range(2 * layout.num_layers)]
    if fill:
        for number, tensor in enumerate(tensors):
            words = _raw_words(tensor)
            words[:] = _words(number, 0, len(words))
    return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(layout.num_layers)]


def _words(tensor_number: int, first: int, count: int) -> np.ndarray:
    """The known words ``first``.. of the holder's tensor ``tensor_number``: each its index,
    the tensor's number in the top 16 bits."""
    return np.arange(first, first + count, dtype=np.uint64) | np.uint64(tensor_number << 48)


def _raw_words(tensor: Any) -> np.ndarray:
    import torch

    return tensor.view(torch.int64).numpy().view(np.uint64).reshape(-1)


def _check(caches: list, peer_block_ids: list[int], block_ids: list[int]) -> None:
    """RuntimeError unless every block read holds the holder's words for its block."""
    tensors = [t for pair in caches for t in pair]
    words_per_block = tensors[0][0].numel() * tensors[0].element_size() // 8
    peer_ids = np.asarray(peer_block_ids, np.uint64)
    offsets = np.arange(words_per_block, dtype=np.uint64)
    for number, tensor in enumerate(tensors):
        got = _raw_words(tensor).reshape(-1, words_per_block)[block_ids]
        expected = (peer_ids[:, None] * np.uint64(words_per_block) + offsets[None, :]) | np.uint64(
            number << 48
        )
        if not np.array_equal(got, expected):
            raise RuntimeError(f"tensor {number}: the blocks read differ from the holder's")


if __name__ == "__main__":
    # The holder process: python -m kvswitch.benchmarks.transfer --hold LAYOUT_JSON NUM_BLOCKS
    if sys.argv[1:2] != ["--hold"] or len(sys.argv) != 4:
        sys.exit("usage: python -m kvswitch.benchmarks.transfer --hold LAYOUT_JSON NUM_BLOCKS")
    _hold(json.loads(sys.argv[2]), int(sys.argv[3]))
