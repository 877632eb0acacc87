"""What a load test sends: sessions of one or more turns, made from a few numbers and a seed.

A session is a conversation. Its first turn's prompt is ``messages[0]``; every later turn's
prompt is the whole conversation so far (earlier prompts and the answers the server gave) plus
``messages[k]``, so it can only be sent once the turn before it has been answered::

    turn 0  | messages[0] |
    turn 1  | messages[0] | answer 0 | messages[1] |
    turn 2  | messages[0] | answer 0 | messages[1] | answer 1 | messages[2] |

Single-turn workloads are sessions of one turn. Token ids are pseudo-random in
``[0, vocab_size)``; every workload is a pure function of its parameters, seed included, so two
runs (or two policies) send the same prompts.

The workloads (``WORKLOADS``; their parameters are the dataclass fields):

- ``shared_prefix``: ``groups`` system prompts of ``system_len`` tokens, ``users`` users each
  asking one ``question_len``-token question (the ``shared_prefix`` shape of llm-d's benchmarks).
- ``long_document_qa``: ``documents`` documents of ``document_len`` tokens, each asked
  ``questions`` questions, in shuffled order.
- ``multi_turn_chat``: ``conversations`` chats of ``turns`` turns of ``message_len`` tokens after
  one ``system_len``-token system prompt.
- ``no_sharing``: ``requests`` unrelated prompts of ``prompt_len`` tokens: the control.
- ``scoring``: ``contexts`` contexts of ``context_len`` tokens, each followed by ``choices``
  continuations of ``choice_len`` tokens whose prompt is scored (its logprobs, ``logprobs``
  alternatives each) and one token sampled: what a multiple-choice evaluation sends.
- ``trace``: a Mooncake trace replayed; each 512-token block id becomes ``block_len`` tokens
  seeded by the id, sent at the trace's arrival times.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvswitch.loadtest.params import with_params
from kvswitch.loadtest.trace import DEFAULT_BLOCK_TOKENS, TraceRequest, read_trace


@dataclass(frozen=True, slots=True)
class Session:
    messages: tuple[np.ndarray, ...]  # each turn's new tokens; the first is the whole prompt
    max_tokens: tuple[int, ...]  # each turn's output length
    arrival_s: float | None = None  # from the start (trace replay); None: the arrivals decide
    # Score each turn's prompt: its tokens' logprobs with this many alternatives (None: no).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.messages or len(self.messages) != len(self.max_tokens):
            raise ValueError("a session needs one max_tokens per message, and a message")

    @property
    def num_turns(self) -> int:
        return len(self.messages)


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, vocab_size, n, dtype=np.int64)


# -- the workloads: each a frozen dataclass of its parameters, ``sessions()`` builds it -----------


@dataclass(frozen=True)
class SharedPrefix:
    groups: int = 4
    users: int = 8
    system_len: int = 512
    question_len: int = 32
    output_len: int = 16

    def sessions(self, vocab_size: int, seed: int) -> list[Session]:
        rng = np.random.default_rng(seed)
        systems = [_tokens(rng, self.system_len, vocab_size) for _ in range(self.groups)]
        sessions = [
            Session(
                (np.concatenate([system, _tokens(rng, self.question_len, vocab_size)]),),
                (self.output_len,),
            )
            for system in systems
            for _ in range(self.users)
        ]
        random.Random(seed).shuffle(sessions)
        return sessions


@dataclass(frozen=True)
class LongDocumentQA:
    """The shared-prefix shape at document scale: a few long prefixes, each asked several
    questions."""

    documents: int = 4
    document_len: int = 2048
    questions: int = 4
    question_len: int = 32
    output_len: int = 16

    def sessions(self, vocab_size: int, seed: int) -> list[Session]:
        shape = SharedPrefix(
            self.documents, self.questions, self.document_len, self.question_len, self.output_len
        )
        return shape.sessions(vocab_size, seed)


@dataclass(frozen=True)
class Scoring:
    """Many continuations of one long context, each scored: a multiple-choice evaluation."""

    contexts: int = 4
    context_len: int = 2048
    choices: int = 8
    choice_len: int = 16
    logprobs: int = 1

    def sessions(self, vocab_size: int, seed: int) -> list[Session]:
        rng = np.random.default_rng(seed)
        sessions = [
            Session(
                (np.concatenate([context, _tokens(rng, self.choice_len, vocab_size)]),),
                (1,),
                prompt_logprobs=self.logprobs,
            )
            for context in [
                _tokens(rng, self.context_len, vocab_size) for _ in range(self.contexts)
            ]
            for _ in range(self.choices)
        ]
        random.Random(seed).shuffle(sessions)
        return sessions


@dataclass(frozen=True)
class MultiTurnChat:
    conversations: int = 8
    turns: int = 4
    system_len: int = 128
    message_len: int = 64
    output_len: int = 16

    def sessions(self, vocab_size: int, seed: int) -> list[Session]:
        rng = np.random.default_rng(seed)
        system = _tokens(rng, self.system_len, vocab_size)
        sessions = []
        for _ in range(self.conversations):
            first = np.concatenate([system, _tokens(rng, self.message_len, vocab_size)])
            later = [_tokens(rng, self.message_len, vocab_size) for _ in range(self.turns - 1)]
            sessions.append(Session((first, *later), (self.output_len,) * self.turns))
        return sessions


@dataclass(frozen=True)
class NoSharing:
    requests: int = 32
    prompt_len: int = 512
    output_len: int = 16

    def sessions(self, vocab_size: int, seed: int) -> list[Session]:
        rng = np.random.default_rng(seed)
        return [
            Session((_tokens(rng, self.prompt_len, vocab_size),), (self.output_len,))
            for _ in range(self.requests)
        ]


@dataclass(frozen=True)
class TraceReplay:
    """``block_len`` tokens stand for each of the trace's 512-token blocks, and lengths shrink by
    the same factor (at least one token each), so a trace fits a small worker; 512 keeps it."""

    path: str = ""
    block_len: int = 16
    time_scale: float = 1.0  # arrival times are multiplied by this (0.5: twice as fast)

    def sessions(self, vocab_size: int, seed: int) -> list[Session]:
        if not self.path:
            raise ValueError("the trace workload needs path=FILE (a Mooncake-format trace)")
        return trace_sessions(
            read_trace(Path(self.path)), self.block_len, vocab_size, self.time_scale
        )


def trace_sessions(
    requests: Sequence[TraceRequest], block_len: int, vocab_size: int, time_scale: float = 1.0
) -> list[Session]:
    """Each trace request as a single-turn session; equal block ids give equal tokens, so two
    requests share a cached prefix exactly where the trace says they do."""
    scale = block_len / DEFAULT_BLOCK_TOKENS
    blocks: dict[int, np.ndarray] = {}

    def block(hash_id: int) -> np.ndarray:
        tokens = blocks.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng(hash_id)
            tokens = blocks[hash_id] = _tokens(rng, block_len, vocab_size)
        return tokens

    sessions = []
    for request in requests:
        num_tokens = max(1, round(request.num_prompt_tokens * scale))
        prompt = np.concatenate([block(i) for i in request.hash_ids])[:num_tokens]
        max_tokens = max(1, round(request.num_output_tokens * scale))
        sessions.append(Session((prompt,), (max_tokens,), request.arrival_s * time_scale))
    return sessions


WORKLOADS: dict[str, type] = {
    "shared_prefix": SharedPrefix,
    "long_document_qa": LongDocumentQA,
    "multi_turn_chat": MultiTurnChat,
    "no_sharing": NoSharing,
    "scoring": Scoring,
    "trace": TraceReplay,
}


def make_workload(name: str, args: str = "") -> Any:
    """The workload ``name`` with ``args`` ("key=value,key=value") over its defaults; ValueError
    names an unknown workload or parameter, or a value of the wrong kind."""
    cls = WORKLOADS.get(name)
    if cls is None:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    workload = with_params(cls(), args, name)
    bad = [k for k, v in dataclasses.asdict(workload).items() if isinstance(v, int) and v < 1]
    if bad:
        raise ValueError(f"{name}: {', '.join(bad)} must be at least 1")
    return workload
