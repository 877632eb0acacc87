"""``kvswitch demo``: cache-aware routing on a local cluster of two CPU workers, end to end.

The demo starts a router and two workers (the built-in tiny model, as processes on this machine)
and sends, through the client SDK, questions about several long documents (markdown tables of
people; the questions interleave across documents) and a few multi-turn chats. Each worker's KV
cache holds about half of the documents. The same requests run twice: with the ``cost`` policy,
which sends each question where its document is cached, and with ``round_robin``, which ignores
the caches, so every worker must hold every document and evicts them before they are asked about
again. A different cache salt per pass keeps the two passes from sharing cached blocks.

The built-in model is small and untrained: its answers are noise. What matters is where each
request goes and how much of its prompt is reused. The processes' logs are kept in a new
temporary folder, named at the start and at the end.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvswitch.client import Client, GenerateResult
from kvswitch.deploy.local import ClusterConfig, running
from kvswitch.tokenizer import ByteTokenizer

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena"]
SURNAMES = ["Stone", "Reyes", "Okafor", "Novak", "Berg", "Costa", "Ito", "Moreau", "Singh", "Walsh"]
JOBS = ["Engineer", "Doctor", "Teacher", "Chef", "Artist", "Lawyer", "Pilot", "Scientist"]
BLOCK_BYTES = 32 << 10  # one 16-token KV block of the built-in model in float32


@dataclass(frozen=True)
class DemoConfig:
    workers: int = 2
    num_documents: int = 3
    rows_per_document: int = 40
    questions_per_document: int = 4
    num_chats: int = 2
    chat_turns: int = 3
    kv_cache_blocks: int = 240  # per worker: about two documents and the chats
    max_tokens: int = 8
    seed: int = 7

    def __post_init__(self) -> None:
        for name in ("workers", "num_documents", "rows_per_document", "kv_cache_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("questions_per_document", "num_chats", "chat_turns"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.max_tokens <= 64:
            raise ValueError(f"max_tokens must be in [1, 64], got {self.max_tokens}")


def make_document(rng: random.Random, title: str, num_rows: int) -> tuple[str, list[str]]:
    """A markdown table of people, and the name on each row."""
    lines = [f"# {title}", "", "| ID | Name | Age | Occupation |", "|---|---|---|---|"]
    names = []
    for row_id in range(1, num_rows + 1):
        name = f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"
        lines.append(f"| {row_id} | {name} | {rng.randint(21, 64)} | {rng.choice(JOBS)} |")
        names.append(name)
    return "\n".join(lines) + "\n", names


def document_questions(config: DemoConfig) -> list[tuple[str, str]]:
    """(label, prompt) of every document question, interleaved across documents."""
    rng = random.Random(config.seed)
    documents = [
        make_document(rng, f"Staff list {d + 1}", config.rows_per_document)
        for d in range(config.num_documents)
    ]
    questions = []
    for q in range(config.questions_per_document):
        for d, (text, names) in enumerate(documents):
            name = names[(q * 7 + d) % len(names)]
            questions.append((f"doc {d + 1} q{q + 1}", f"{text}\nQuestion: how old is {name}?\n"))
    return questions


@dataclass
class Row:
    label: str
    result: GenerateResult


def run_pass(client: Client, config: DemoConfig, policy: str, *, verbose: bool) -> list[Row]:
    """Every request of the demo once, with ``policy`` and a cache salt of its own."""
    rows: list[Row] = []
    salt = f"demo-{policy}"

    def send(label: str, **prompt: object) -> GenerateResult:
        result = client.generate(
            **prompt, max_tokens=config.max_tokens, policy=policy, cache_salt=salt, seed=1
        )
        rows.append(Row(label, result))
        if verbose:
            _print_row(rows[-1])
        return result

    if verbose:
        _print_header(policy)
    for label, prompt in document_questions(config):
        send(label, prompt=prompt)
    # Multi-turn chats, in turns across chats: each turn's prompt is the conversation so far,
    # the model's answers included (as token ids, so the prefix is exactly what was cached).
    tokenizer = ByteTokenizer()
    histories = [
        tokenizer.encode(f"System: chat {c + 1}, about the staff lists.\n")
        for c in range(config.num_chats)
    ]
    for turn in range(config.chat_turns):
        for c, history in enumerate(histories):
            history += tokenizer.encode(f"User: question {turn + 1}?\nAssistant:", add_bos=False)
            result = send(f"chat {c + 1} t{turn + 1}", prompt_token_ids=list(history))
            history += result.token_ids
    return rows


def hit_rate(rows: list[Row]) -> float:
    prompt = sum(r.result.stats.num_prompt_tokens for r in rows)
    return sum(r.result.stats.num_cached_tokens for r in rows) / max(prompt, 1)


def _print_header(policy: str) -> None:
    print(f"\n== policy {policy} ==")
    print(f"{'request':<12}{'worker':<10}{'prompt':>7}{'cached':>8}{'ttft ms':>9}  route")


def _print_row(row: Row) -> None:
    stats, route = row.result.stats, row.result.route
    print(
        f"{row.label:<12}{stats.worker_id:<10}{stats.num_prompt_tokens:>7}"
        f"{stats.num_cached_tokens:>8}{stats.ttft_s * 1000:>9.1f}  {route.reason}"
    )


def run(config: DemoConfig) -> dict[str, float]:
    cluster_config = ClusterConfig(
        workers=config.workers, port=0, kv_cache_bytes=config.kv_cache_blocks * BLOCK_BYTES
    )
    print(
        f"Starting a router and {config.workers} CPU workers (built-in model, "
        f"{config.kv_cache_blocks} KV blocks of 16 tokens each) ...",
        file=sys.stderr,
        flush=True,
    )
    figures: dict[str, float] = {}
    # NOTE: a folder of the demo's own, kept: the cluster would remove one it made itself.
    log_dir = Path(tempfile.mkdtemp(prefix="kvswitch-demo-"))
    with running(cluster_config, log_dir=log_dir) as cluster:
        print(f"router at {cluster.address}; logs in {log_dir}", file=sys.stderr)
        with Client(cluster.address, timeout_s=60) as client:
            for policy in ("cost", "round_robin"):
                rows = run_pass(client, config, policy, verbose=True)
                figures[f"{policy}_hit_rate"] = hit_rate(rows)
                figures[f"{policy}_mean_ttft_ms"] = 1000 * statistics.fmean(
                    r.result.stats.ttft_s for r in rows
                )
    print("\nPrompt tokens served from cache, and mean time to first token:")
    for policy in ("cost", "round_robin"):
        print(
            f"  {policy:<12} {figures[f'{policy}_hit_rate']:>5.0%}   "
            f"{figures[f'{policy}_mean_ttft_ms']:6.1f} ms"
        )
    print(
        "cost sends each question to the worker that holds its document; round_robin makes "
        "every worker\nhold every document, more than its cache fits, so documents are evicted "
        "before their next question."
    )
    print(f"The router's and workers' logs are kept in {log_dir}", file=sys.stderr)
    return figures
