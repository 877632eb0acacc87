"""``kvswitch bench lookup``: the work a router does on its event loop per request, at scale.

Five figures, each a median over ``--repeats`` runs:

- ``pending_match_ms``: one lookup among ``--num-guesses`` live pending guesses, all on one
  ``--document-blocks``-block document (each guess: the document, then two blocks of its own);
- ``embedded_match_ms``: one lookup in the embedded index where ``--num-workers`` workers all hold
  one ``--prefix-blocks``-block prefix;
- ``candidate_states_us``: the states of ``--num-workers`` candidates, each with a load report,
  as a route builds them for its policy to score (every request, every candidate);
- ``engine_page_parse_us``: one engine's load read out of a ``/metrics`` page of a vLLM server's
  size (``benchmarks/vllm_metrics.py``), as a router following engines does at each poll;
- ``loop_stall_ms``: the longest the router's event loop stops while it takes one text prompt of
  about ``--prompt-tokens`` tokens (a byte-level BPE tokenizer trained here), measured by a task on
  the same loop that wakes every millisecond. The router has no worker and gives up at once: the
  figure is tokenizing and everything around it.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from kvswitch.benchmarks.timing import machine_info
from kvswitch.benchmarks.vllm_metrics import vllm_metrics_page
from kvswitch.cache_index.events import BlockStored
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.router.engine_load import parse_engine_load
from kvswitch.router.pending import PendingBlocks
from kvswitch.router.workers import WorkerHandle
from kvswitch.tokenizer import load_tokenizer
from kvswitch.v1 import worker_pb2

BLOCK_SIZE = 16
TIMES_A_RUN = 100  # of the microsecond figures, timed together
NAMESPACE = "bench-model"


@dataclass(frozen=True)
class LookupBenchConfig:
    num_guesses: int = 1000
    document_blocks: int = 250
    num_workers: int = 16
    prefix_blocks: int = 8192
    prompt_tokens: int = 47_000
    repeats: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_guesses", "document_blocks", "num_workers", "prefix_blocks", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prompt_tokens < 1000:
            raise ValueError(f"prompt_tokens must be at least 1000, got {self.prompt_tokens}")


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def pending_match_ms(config: LookupBenchConfig, rng: np.random.Generator) -> float:
    document = rng.integers(0, 32000, config.document_blocks * BLOCK_SIZE).tolist()

    def chain() -> list[bytes]:
        question = rng.integers(0, 32000, 2 * BLOCK_SIZE).tolist()
        return hash_prompt_blocks([*document, *question], BLOCK_SIZE, NAMESPACE)

    pending = PendingBlocks(ttl_s=3600.0)
    for i in range(config.num_guesses):
        pending.add(f"w{i % config.num_workers}", chain())
    lookup = chain()
    return _median_ms(lambda: pending.match(lookup, {}), config.repeats)


def embedded_match_ms(config: LookupBenchConfig, rng: np.random.Generator) -> float:
    tokens = rng.integers(0, 32000, config.prefix_blocks * BLOCK_SIZE).tolist()
    chain = hash_prompt_blocks(tokens, BLOCK_SIZE, NAMESPACE)
    index = MemoryIndex()

    async def fill() -> None:
        for i in range(config.num_workers):
            info = WorkerInfo(f"w{i}", f"127.0.0.1:{50000 + i}", NAMESPACE, BLOCK_SIZE, "both", 0)
            await index.register(info, ttl_s=3600.0)
            stored = BlockStored(tuple(chain))
            await index.apply(f"w{i}", 1, [stored])

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(fill())
        return _median_ms(lambda: loop.run_until_complete(index.match(NAMESPACE, chain)), 3)
    finally:
        loop.close()


def candidate_states_us(config: LookupBenchConfig) -> float:
    handles = [
        WorkerHandle(
            WorkerInfo(f"w{i}", f"127.0.0.1:{50000 + i}", NAMESPACE, BLOCK_SIZE), None, None
        )
        for i in range(config.num_workers)
    ]
    for i, handle in enumerate(handles):
        handle.load = worker_pb2.WorkerLoad(
            num_queued_prefill_tokens=100 * i, num_running_requests=i, num_free_blocks=1000
        )
        handle.num_in_flight = i % 3

    def states() -> None:
        for _ in range(TIMES_A_RUN):
            [h.state(i % 5, num_fetchable_blocks=i % 5) for i, h in enumerate(handles)]

    return _median_ms(states, config.repeats) * 1e3 / TIMES_A_RUN


def engine_page_parse_us(config: LookupBenchConfig) -> float:
    page = vllm_metrics_page(NAMESPACE, num_running=3, num_waiting=1, num_blocks=4096)

    def parse() -> None:
        for _ in range(TIMES_A_RUN):
            parse_engine_load(page)

    return _median_ms(parse, config.repeats) * 1e3 / TIMES_A_RUN


def _train_tokenizer(model_dir: Path, rng: np.random.Generator) -> str:
    """A byte-level BPE written to ``model_dir/tokenizer.json``; returns text to tokenize."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = [
        "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 9))) for _ in range(400)
    ]
    corpus = [" ".join(rng.choice(words, 50)) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return " ".join(rng.choice(words, 20_000))


async def _longest_pause_s(done: asyncio.Event) -> float:
    """The longest gap between wake-ups of a task asking to wake every millisecond."""
    worst = 0.0
    last = time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
    return worst


async def _loop_stall_ms(model_dir: Path, text: str, repeats: int) -> tuple[float, int]:
    from kvswitch.router.server import RouterConfig, start_router
    from kvswitch.v1 import router_pb2, router_pb2_grpc

    config = RouterConfig(port=0, model=str(model_dir), grace_s=0.0, wait_for_worker_s=0.0)
    router = await start_router(config)
    num_tokens = len(router.router.tokenizer.encode(text))
    stalls = []
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            request = router_pb2.GenerateRequest(text=text)
            for _ in range(repeats):
                done = asyncio.Event()
                watcher = asyncio.create_task(_longest_pause_s(done))
                await asyncio.sleep(0.01)
                try:
                    async for _ in stub.Generate(request, timeout=30):
                        pass
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e  # no worker: as planned
                done.set()
                stalls.append(await watcher)
    finally:
        await router.stop(0)
    return statistics.median(stalls) * 1e3, num_tokens


def run(config: LookupBenchConfig) -> dict[str, object]:
    rng = np.random.default_rng(config.seed)
    print("pending guesses ...", file=sys.stderr)
    pending_ms = pending_match_ms(config, rng)
    print("embedded index ...", file=sys.stderr)
    embedded_ms = embedded_match_ms(config, rng)
    print("candidates' states, an engine's page ...", file=sys.stderr)
    states_us = candidate_states_us(config)
    parse_us = engine_page_parse_us(config)
    print("a long text prompt through a router ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvswitch-bench-") as model_dir:
        text = _train_tokenizer(Path(model_dir), rng)
        num_tokens = len(load_tokenizer(model_dir).encode(text))
        repeats = -(-config.prompt_tokens // num_tokens)
        text = (text + " ") * repeats
        text = text[: len(text) * config.prompt_tokens // (num_tokens * repeats)]  # about that many
        stall_ms, num_tokens = asyncio.run(
            _loop_stall_ms(Path(model_dir), text, max(config.repeats // 4, 3))
        )
    return {
        "pending_match_ms": pending_ms,
        "embedded_match_ms": embedded_ms,
        "candidate_states_us": states_us,
        "engine_page_parse_us": parse_us,
        "loop_stall_ms": stall_ms,
        "num_prompt_tokens": num_tokens,
        "num_guesses": config.num_guesses,
        "document_blocks": config.document_blocks,
        "num_workers": config.num_workers,
        "prefix_blocks": config.prefix_blocks,
        "machine": machine_info(),
    }
