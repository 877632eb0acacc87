"""Request traces: read them, write them, make them up.

A trace is JSON lines in the Mooncake format, one request a line::

    {"timestamp": 1200, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

An optional ``"lora"`` names the LoRA adapter the request runs under (absent or null: the base
model); its blocks are another chain than the same ids' under another adapter, as a worker's.

``timestamp`` is the arrival in milliseconds from the start; ``hash_ids`` name the prompt's blocks
of ``block_tokens`` tokens, one id per block, the last one possibly partial. Ids are chained:
two requests share id k at position i only if their prompts agree up to the end of that block::

    tokens    | 0 ... 511 | 512 ... 1023 | 1024 ... 1100 (partial)
    hash_ids  |     7     |      8       |      31
    cached as |    h7     |  h8 (h7's)   |  (a partial block is never cached)

``block_hashes`` turns the ids of the full blocks into the chained 16-byte hashes a worker's
block pool and the index use (one id standing for one block's tokens), so the simulator runs the
project's own cache code on a trace. The live load test reads traces with the same reader.

``load_trace`` also makes one up where a file would be named: ``generated:SHAPE,key=value,...``
is the preset ``SHAPE`` of ``TRACE_SHAPES`` (``chat`` when left out) with ``TraceShape`` fields
over it, e.g. ``generated:docs,num_requests=200,seed=1``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvswitch.cache_index.hashing import BlockHasher
from kvswitch.loadtest.params import with_params

DEFAULT_BLOCK_TOKENS = 512  # Mooncake's block of hash ids
TRACE_NAMESPACE = "trace"  # the model name a trace's block hashes are chained under
_MAX_HASH_ID = 2**32 - 1
_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
GENERATED = "generated:"  # a trace source made up on the spot, not read from a file


class TraceError(ValueError):
    """A trace line that is not a request; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # from the start of the trace
    num_prompt_tokens: int
    num_output_tokens: int
    hash_ids: tuple[int, ...]  # one per block of the prompt, the last one possibly partial
    lora: str | None = None  # the LoRA adapter it runs under; None: the base model

    def num_full_blocks(self, block_tokens: int) -> int:
        """Prompt blocks a cache can hold: the full ones."""
        return self.num_prompt_tokens // block_tokens


def block_hashes(request: TraceRequest, block_tokens: int) -> list[bytes]:
    """The chained hashes of the request's full prompt blocks."""
    ids = request.hash_ids[: request.num_full_blocks(block_tokens)]
    # NOTE: one id stands for one block's tokens: a chain of 1-token "blocks" over the ids is
    # the chain a worker would compute over the tokens the ids name.
    hasher = BlockHasher(TRACE_NAMESPACE, block_size=1, lora=request.lora)
    return hasher.hash_blocks(np.asarray(ids, dtype=np.uint32))


# -- reading and writing ---------------------------------------------------------------------


def read_trace(path: str | Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[TraceRequest]:
    """Every request of a JSON-lines trace, in arrival order (ties keep file order). Blank lines
    are skipped; anything else that is not a request raises TraceError naming its line."""
    path = Path(path)
    requests = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                requests.append(_parse(line, block_tokens, f"{path}:{line_no}"))
    if not requests:
        raise TraceError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def load_trace(source: str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[TraceRequest]:
    """The requests of ``source``: a JSON-lines trace file, or a trace ``generated:SPEC`` makes
    up (``generated_shape``)."""
    if source.startswith(GENERATED):
        return generate_trace(generated_shape(source, block_tokens))
    return read_trace(source, block_tokens)


def distinct_blocks(requests: Iterable[TraceRequest], block_tokens: int) -> int:
    """Full prompt blocks the trace names, each counted once: what a cache that never evicts
    would hold of it."""
    # NOTE: an id under two adapters names two blocks.
    return len(
        {(r.lora, i) for r in requests for i in r.hash_ids[: r.num_full_blocks(block_tokens)]}
    )


def _parse(line: str, block_tokens: int, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [key for key in _KEYS if key not in row]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    timestamp, hash_ids = row["timestamp"], row["hash_ids"]
    if not _is_number(timestamp) or not 0 <= timestamp < math.inf:
        raise TraceError(f"{where}: timestamp must be a number of milliseconds >= 0")
    for key in ("input_length", "output_length"):
        if not _is_int(row[key]) or row[key] < 1:
            raise TraceError(f"{where}: {key} must be an integer >= 1, got {row[key]!r}")
    if not isinstance(hash_ids, list) or not all(
        _is_int(i) and 0 <= i <= _MAX_HASH_ID for i in hash_ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers in [0, 2**32)")
    num_blocks = -(-row["input_length"] // block_tokens)
    if len(hash_ids) != num_blocks:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash ids for {row['input_length']} input tokens; "
            f"{num_blocks} expected at {block_tokens} tokens per block"
        )
    lora = row.get("lora")
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise TraceError(f"{where}: lora must be an adapter's name or null, got {lora!r}")
    return TraceRequest(
        timestamp / 1000, row["input_length"], row["output_length"], tuple(hash_ids), lora
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write ``requests`` as a JSON-lines trace; ``read_trace`` reads it back unchanged, arrival
    times to the microsecond."""
    with Path(path).open("w") as f:
        for r in requests:
            timestamp_ms = round(r.arrival_s * 1000, 3)
            row = {
                "timestamp": int(timestamp_ms) if timestamp_ms.is_integer() else timestamp_ms,
                "input_length": r.num_prompt_tokens,
                "output_length": r.num_output_tokens,
                "hash_ids": list(r.hash_ids),
            }
            if r.lora is not None:
                row["lora"] = r.lora
            f.write(json.dumps(row) + "\n")


# -- generating ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceShape:
    """A made-up workload: conversations, each opening on one of a few shared prefixes (system
    prompts, documents), each turn's prompt the whole conversation so far plus a new message."""

    num_requests: int = 1000
    requests_per_s: float = 10.0  # mean arrival rate over the whole trace
    num_prefixes: int = 8  # shared prefixes; prefix k is picked with weight 1 / (k + 1)
    prefix_tokens: int = 4096
    turns_per_conversation: int = 4
    message_tokens: int = 512  # mean new tokens a turn adds; uniform in [mean / 2, 3 mean / 2]
    output_tokens: int = 256  # mean generated tokens, drawn the same way
    think_time_s: float = 20.0  # mean gap between a conversation's turns (exponential)
    # LoRA adapters the conversations run under (0: the base model alone); a conversation picks
    # adapter k with weight 1 / (k + 1)^lora_skew, independently of its prefix.
    num_loras: int = 0
    lora_skew: float = 1.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_prefixes", "turns_per_conversation", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("message_tokens", "output_tokens"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
        if self.prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be >= 0, got {self.prefix_tokens}")
        if self.num_loras < 0 or not 0 <= self.lora_skew < math.inf:
            raise ValueError(
                f"num_loras and lora_skew must be >= 0, got {self.num_loras}, {self.lora_skew}"
            )
        for name in ("requests_per_s", "think_time_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}")


# The shapes ``generated:NAME`` names; each a workload a cache-aware router should win on.
TRACE_SHAPES = {
    # Conversations of 4 turns on 8 shared 4,096-token system prompts, 10 requests a second.
    "chat": TraceShape(),
    # 32 documents of 8,192 tokens, each request one short question about one of them.
    "docs": TraceShape(
        num_prefixes=32,
        prefix_tokens=8192,
        turns_per_conversation=1,
        message_tokens=64,
        output_tokens=128,
    ),
}


def generated_shape(source: str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> TraceShape:
    """The shape ``generated:NAME,key=value,...`` names: ``TRACE_SHAPES[NAME]`` (``chat`` when
    the first part is a key=value or nothing) with the ``TraceShape`` fields given over it, at
    ``block_tokens`` tokens a block. ValueError says what is accepted."""
    spec = source.removeprefix(GENERATED)
    name, _, params = spec.partition(",")
    if "=" in name:
        name, params = "", spec
    shape = TRACE_SHAPES.get(name.strip() or "chat")
    if shape is None:
        raise ValueError(
            f"{source}: unknown trace shape {name.strip()!r}; give generated:SHAPE,key=value,... "
            f"with SHAPE one of {', '.join(TRACE_SHAPES)} (e.g. generated:chat,num_requests=200)"
        )
    # NOTE: the trace's blocks are the simulator's blocks, so --block-tokens sets them.
    shape = dataclasses.replace(shape, block_tokens=block_tokens)
    return with_params(shape, params, source, exclude=("block_tokens",))


def generate_trace(shape: TraceShape) -> list[TraceRequest]:
    """``shape.num_requests`` requests in arrival order; the same shape gives the same trace."""
    rng = random.Random(shape.seed)
    ids = _IdCounter()
    prefixes = [
        ids.take(shape.prefix_tokens // shape.block_tokens) for _ in range(shape.num_prefixes)
    ]
    weights = [1 / (k + 1) for k in range(shape.num_prefixes)]
    loras = [f"lora{k}" for k in range(shape.num_loras)]
    lora_weights = [1 / (k + 1) ** shape.lora_skew for k in range(shape.num_loras)]
    conversation_rate = shape.requests_per_s / shape.turns_per_conversation
    # NOTE: a few conversations more than the requests need, so that the first num_requests
    # arrivals are not short of the late turns of early conversations.
    num_conversations = -(-shape.num_requests // shape.turns_per_conversation) + 2
    requests: list[TraceRequest] = []
    start_s = 0.0
    for _ in range(num_conversations):
        start_s += rng.expovariate(conversation_rate)
        prefix = rng.choices(prefixes, weights)[0]
        lora = rng.choices(loras, lora_weights)[0] if loras else None
        requests += _conversation(shape, rng, ids, start_s, prefix, lora)
    requests.sort(key=lambda r: r.arrival_s)
    first_s = requests[0].arrival_s
    # NOTE: whole milliseconds from the first arrival, as a Mooncake trace has them.
    return [
        TraceRequest(
            round((r.arrival_s - first_s) * 1000) / 1000,
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.hash_ids,
            r.lora,
        )
        for r in requests[: shape.num_requests]
    ]


def _conversation(
    shape: TraceShape,
    rng: random.Random,
    ids: _IdCounter,
    start_s: float,
    prefix: list[int],
    lora: str | None,
) -> list[TraceRequest]:
    block = shape.block_tokens
    arrival_s = start_s
    num_tokens = shape.prefix_tokens  # the conversation so far
    hash_ids: list[int] = prefix  # ids of its full blocks
    turns = []
    for _ in range(shape.turns_per_conversation):
        num_prompt = num_tokens + _around(rng, shape.message_tokens)
        # Blocks already full stay; the rest of the prompt is new to this conversation.
        kept = hash_ids[: num_tokens // block]
        prompt_ids = kept + ids.take(-(-num_prompt // block) - len(kept))
        num_output = _around(rng, shape.output_tokens)
        turns.append(TraceRequest(arrival_s, num_prompt, num_output, tuple(prompt_ids), lora))
        num_tokens = num_prompt + num_output
        hash_ids = prompt_ids[: num_prompt // block]
        arrival_s += rng.expovariate(1 / shape.think_time_s)
    return turns


def _around(rng: random.Random, mean: int) -> int:
    return rng.randint(mean // 2, mean + mean // 2)


class _IdCounter:
    def __init__(self) -> None:
        self._next = 0

    def take(self, n: int) -> list[int]:
        taken = list(range(self._next, self._next + n))
        self._next += n
        return taken
