"""The load test's workloads and arrivals: deterministic, shaped as their parameters say."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvswitch.loadtest.arrivals import open_loop_times
from kvswitch.loadtest.trace import TraceRequest
from kvswitch.loadtest.workloads import (
    LongDocumentQA,
    MultiTurnChat,
    NoSharing,
    Scoring,
    SharedPrefix,
    make_workload,
    trace_sessions,
)


def _prompts(sessions) -> list[np.ndarray]:
    return [s.messages[0] for s in sessions]


@pytest.mark.parametrize(
    "workload",
    [SharedPrefix(), LongDocumentQA(), MultiTurnChat(), NoSharing(), Scoring()],
    ids=repr,
)
def test_a_workload_is_a_function_of_its_seed(workload) -> None:
    a, b, other = (workload.sessions(256, seed) for seed in (3, 3, 4))
    assert len(a) == len(b) == len(other)
    for x, y in zip(a, b, strict=True):
        assert all(np.array_equal(m, n) for m, n in zip(x.messages, y.messages, strict=True))
        assert x.max_tokens == y.max_tokens
    assert not all(np.array_equal(x, y) for x, y in zip(_prompts(a), _prompts(other), strict=True))
    assert all(int(m.max()) < 256 and int(m.min()) >= 0 for s in a for m in s.messages)


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    workload = SharedPrefix(groups=3, users=5, system_len=40, question_len=8, output_len=2)
    prompts = _prompts(workload.sessions(1000, 0))
    assert len(prompts) == 15 and {len(p) for p in prompts} == {48}
    systems = {p[:40].tobytes() for p in prompts}
    assert len(systems) == 3
    for system in systems:
        group = [p for p in prompts if p[:40].tobytes() == system]
        assert len(group) == 5
        assert len({p[40:].tobytes() for p in group}) == 5  # each user's own question


def test_long_document_qa_asks_each_document_its_questions() -> None:
    workload = LongDocumentQA(documents=3, document_len=64, questions=4, question_len=8)
    prompts = _prompts(workload.sessions(1000, 0))
    documents = [p[:64].tobytes() for p in prompts]
    assert len(prompts) == 12 and sorted(documents.count(d) for d in set(documents)) == [4, 4, 4]
    assert len(set(documents[:4])) > 1  # shuffled, not one document's questions in a row


def test_scoring_scores_each_contexts_continuations() -> None:
    sessions = Scoring(contexts=3, context_len=64, choices=5, choice_len=4, logprobs=2).sessions(
        1000, 0
    )
    prompts = _prompts(sessions)
    contexts = [p[:64].tobytes() for p in prompts]
    assert len(prompts) == 15 and {len(p) for p in prompts} == {68}
    assert sorted(contexts.count(c) for c in set(contexts)) == [5, 5, 5]
    assert {(s.max_tokens, s.prompt_logprobs) for s in sessions} == {((1,), 2)}


def test_multi_turn_chat_sessions_have_their_turns() -> None:
    sessions = MultiTurnChat(conversations=2, turns=3, system_len=10, message_len=4).sessions(50, 0)
    assert [s.num_turns for s in sessions] == [3, 3]
    assert all(len(s.messages[0]) == 14 and len(s.messages[1]) == 4 for s in sessions)
    assert np.array_equal(sessions[0].messages[0][:10], sessions[1].messages[0][:10])


def test_trace_blocks_are_equal_exactly_where_the_ids_are() -> None:
    requests = [
        TraceRequest(0.0, 1500, 600, (1, 2, 3)),
        TraceRequest(2.5, 1100, 10, (1, 2, 9)),
        TraceRequest(4.0, 100, 1, (5,)),
    ]
    a, b, c = trace_sessions(requests, block_len=16, vocab_size=1000, time_scale=0.5)
    # 512-token blocks become 16 tokens: lengths shrink 32-fold, at least one token each.
    assert [len(s.messages[0]) for s in (a, b, c)] == [47, 34, 3]
    assert [s.max_tokens for s in (a, b, c)] == [(19,), (1,), (1,)]
    assert [s.arrival_s for s in (a, b, c)] == [0.0, 1.25, 2.0]
    assert np.array_equal(a.messages[0][:32], b.messages[0][:32])
    assert not np.array_equal(a.messages[0][32:34], b.messages[0][32:34])
    again = trace_sessions(requests[2:], block_len=16, vocab_size=1000)[0]
    assert np.array_equal(again.messages[0], c.messages[0])


def test_make_workload_reads_its_parameters_and_says_what_is_wrong() -> None:
    assert make_workload("shared_prefix", "groups=2, users=3") == SharedPrefix(groups=2, users=3)
    with pytest.raises(ValueError, match="unknown workload 'chat'; choose from shared_prefix"):
        make_workload("chat")
    with pytest.raises(ValueError, match=r"bad parameter 'group=2'; known \(defaults\): groups=4"):
        make_workload("shared_prefix", "group=2")
    with pytest.raises(ValueError, match="users must be a int, got 'many'"):
        make_workload("shared_prefix", "users=many")
    with pytest.raises(ValueError, match="groups must be at least 1"):
        make_workload("shared_prefix", "groups=0")
    with pytest.raises(ValueError, match="needs path=FILE"):
        make_workload("trace").sessions(256, 0)


def test_open_loop_arrivals_keep_their_rate_and_burstiness() -> None:
    assert open_loop_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert open_loop_times(0, 5.0) == []
    for burstiness in (1.0, 0.25):
        times = open_loop_times(20_000, rate=50.0, burstiness=burstiness, seed=1)
        gaps = np.diff(times)
        assert times[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
        # A gamma gap's coefficient of variation is 1 / sqrt(shape): 1 for Poisson, 2 here.
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert open_loop_times(5, 2.0, seed=7) == open_loop_times(5, 2.0, seed=7)
    with pytest.raises(ValueError, match="rate must be positive"):
        open_loop_times(3, 0.0)
