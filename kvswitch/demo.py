"""``kvswitch demo``: prefix caching on one worker's KV cache, request by request.

Questions about long documents (markdown tables of people) and a multi-turn chat go through the
worker's KV cache manager with byte-level tokens. Each request's answer is "decoded" token by token,
so its blocks are cached the moment they fill, and the next chat turn finds them. The same requests
then run on a cache too small for all documents: least recently used blocks are evicted before
they are asked for again, which is what cache-aware routing across workers avoids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cache_index.events import BlockRemoved, BlockStored
from cache_index.hashing import BlockHasher
from worker.kv_cache_manager import KVCacheManager
from worker.request import Request

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena"]
SURNAMES = ["Stone", "Reyes", "Okafor", "Novak", "Berg", "Costa", "Ito", "Moreau", "Singh", "Walsh"]
JOBS = ["Engineer", "Doctor", "Teacher", "Chef", "Artist", "Lawyer", "Pilot", "Scientist"]


@dataclass(frozen=True)
class DemoConfig:
    num_blocks: int = 160
    block_size: int = 16
    num_documents: int = 3
    rows_per_document: int = 20
    questions_per_document: int = 3
    chat_turns: int = 3
    seed: int = 7


def make_document(
    rng: random.Random, title: str, num_rows: int
) -> tuple[str, list[tuple[str, int]]]:
    """A markdown table of people, and (name, age) for each row."""
    lines = [f"# {title}", "", "| ID | Name | Age | Occupation |", "|---|---|---|---|"]
    people = []
    for row_id in range(1, num_rows + 1):
        name = f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"
        age = rng.randint(21, 64)
        lines.append(f"| {row_id} | {name} | {age} | {rng.choice(JOBS)} |")
        people.append((name, age))
    return "\n".join(lines) + "\n", people


class Worker:
    """A worker's KV cache, driven like an engine would: prefill, then one token per step."""

    def __init__(self, config: DemoConfig, num_blocks: int) -> None:
        self.manager = KVCacheManager(num_blocks, config.block_size)
        self.hasher = BlockHasher("demo-model", config.block_size)
        self.num_requests = 0

    def run(self, prompt: str, answer: str) -> dict[str, int]:
        self.num_requests += 1
        request = Request(f"req-{self.num_requests}", list(prompt.encode()), self.hasher)
        hit, num_cached = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, request.num_tokens - num_cached, hit) is None:
            raise RuntimeError("the demo cache is too small for one request")
        request.num_computed_tokens = request.num_tokens
        for token in answer.encode():
            request.append_token_ids([token])
            if self.manager.allocate_slots(request, 1) is None:
                raise RuntimeError("the demo cache is too small for one request")
            request.num_computed_tokens = request.num_tokens
        self.manager.free(request)
        events = self.manager.take_events()
        return {
            "prompt_tokens": request.num_prompt_tokens,
            "cached_tokens": num_cached,
            "stored_blocks": sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)),
            "evicted_blocks": sum(
                len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)
            ),
        }


def make_jobs(config: DemoConfig) -> list[tuple[str, str, str]]:
    """(label, prompt, answer) for every request of the demo, in arrival order."""
    rng = random.Random(config.seed)
    documents = [
        make_document(rng, f"Staff list {i + 1}", config.rows_per_document)
        for i in range(config.num_documents)
    ]
    # Questions about several documents, interleaved: each document is prefilled once and its
    # blocks are reused by every later question about it, for as long as they stay cached.
    jobs = []
    for q in range(config.questions_per_document):
        for d, (text, people) in enumerate(documents):
            name, age = people[(q * 7 + d) % len(people)]
            jobs.append(
                (
                    f"doc {d + 1} q{q + 1}",
                    f"{text}\nQuestion: how old is {name}?\n",
                    f"{name} is {age}.",
                )
            )
    # A multi-turn chat: each turn's prompt is the whole conversation so far, answers included.
    history = "System: you answer questions about the staff lists.\n"
    for turn in range(config.chat_turns):
        name, age = documents[0][1][turn % len(documents[0][1])]
        history += f"User: how old is {name}?\n"
        answer = f"Assistant: {name} is {age} years old.\n"
        jobs.append((f"chat turn {turn + 1}", history, answer))
        history += answer
    return jobs


def serve(
    config: DemoConfig, num_blocks: int, jobs: list[tuple[str, str, str]], *, verbose: bool
) -> float:
    """Run the jobs on one worker with ``num_blocks`` blocks; returns the prompt-token hit rate."""
    worker = Worker(config, num_blocks)
    if verbose:
        header = f"{'request':<14}{'prompt':>8}{'cached':>8}{'hit':>7}{'stored':>8}{'evicted':>9}"
        print(header)
        print("-" * len(header))
    for label, prompt, answer in jobs:
        row = worker.run(prompt, answer)
        if verbose:
            hit = row["cached_tokens"] / row["prompt_tokens"]
            print(
                f"{label:<14}{row['prompt_tokens']:>8}{row['cached_tokens']:>8}{hit:>7.0%}"
                f"{row['stored_blocks']:>8}{row['evicted_blocks']:>9}"
            )
    worker.manager.check_integrity()
    return worker.manager.stats.hit_rate


def run(config: DemoConfig) -> dict[str, float]:
    jobs = make_jobs(config)
    print(
        f"One worker, {config.num_blocks} KV blocks of {config.block_size} tokens "
        f"({config.num_blocks * config.block_size:,} tokens), byte-level tokens.\n"
    )
    hit_rate = serve(config, config.num_blocks, jobs, verbose=True)
    print(
        "\n'cached': prompt tokens whose KV was reused; 'stored': blocks newly cached (prompt "
        "and answer);\n'evicted': cached blocks taken back for new ones.\n"
    )
    small = max(config.num_blocks // 2, 1)
    small_hit_rate = serve(config, small, jobs, verbose=False)
    print(
        f"Prompt tokens served from cache: {hit_rate:.0%} with {config.num_blocks} blocks, "
        f"{small_hit_rate:.0%} with {small} blocks."
    )
    print(
        "A cache too small for its working set evicts documents before their next question; "
        "kvswitch\nspreads documents over workers and sends each question where its document "
        "is cached."
    )
    return {"hit_rate": hit_rate, "small_cache_hit_rate": small_hit_rate}
