"""Reading, writing and generating traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvswitch.loadtest.trace import (
    TraceError,
    TraceRequest,
    TraceShape,
    block_hashes,
    generate_trace,
    read_trace,
    write_trace,
)

GOOD = [
    {"timestamp": 2000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1024, "output_length": 1, "hash_ids": [0, 3]},
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_trace_is_read_in_arrival_order(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD[0]), "", json.dumps(GOOD[1])])
    assert read_trace(path) == [
        TraceRequest(0.5, 1024, 1, (0, 3)),
        TraceRequest(2.0, 1100, 7, (0, 1, 2)),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 1, "input_length": ', "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "missing hash_ids"),
        (
            '{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}',
            "timestamp must be a number of milliseconds >= 0",
        ),
        (
            '{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "input_length must be an integer >= 1, got 0",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": true, "hash_ids": [0]}',
            "output_length must be an integer >= 1, got True",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [-4]}',
            "hash_ids must be a list of integers in [0, 2**32)",
        ),
        (
            '{"timestamp": 1, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}',
            "2 hash ids for 1025 input tokens; 3 expected at 512 tokens per block",
        ),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD[0]), line])
    with pytest.raises(TraceError) as error:
        read_trace(path)
    assert str(error.value).startswith(f"{path}:2: {message}")


def test_an_empty_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write_lines(tmp_path / "t.jsonl", ["", "  "]))


def test_a_written_trace_reads_back_unchanged(tmp_path: Path) -> None:
    requests = generate_trace(TraceShape(num_requests=50, seed=3))
    write_trace(tmp_path / "t.jsonl", requests)
    assert read_trace(tmp_path / "t.jsonl") == requests


def test_the_generator_repeats_itself_and_follows_its_seed() -> None:
    shape = TraceShape(num_requests=300, seed=1)
    trace = generate_trace(shape)
    assert trace == generate_trace(shape)
    assert trace != generate_trace(TraceShape(num_requests=300, seed=2))
    assert len(trace) == 300
    assert trace[0].arrival_s == 0.0
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)


def test_generated_ids_are_chained() -> None:
    """An id at position i stands for the whole prefix up to that block: wherever it appears,
    the ids before it are the same, and blocks are full except perhaps the last."""
    shape = TraceShape(num_requests=400, num_prefixes=3, turns_per_conversation=5, seed=4)
    prefix_of: dict[int, tuple[int, ...]] = {}
    for request in generate_trace(shape):
        assert len(request.hash_ids) == -(-request.num_prompt_tokens // shape.block_tokens)
        for i, hash_id in enumerate(request.hash_ids[: request.num_full_blocks(512)]):
            assert prefix_of.setdefault(hash_id, request.hash_ids[:i]) == request.hash_ids[:i]


def test_later_turns_extend_the_conversation_and_prefixes_are_shared() -> None:
    shape = TraceShape(num_requests=200, num_prefixes=2, prefix_tokens=2048, seed=5)
    trace = generate_trace(shape)
    firsts = {r.hash_ids[:4] for r in trace}
    assert len(firsts) == 2  # every prompt opens on one of the two 4-block prefixes
    # Some prompt holds all the full blocks of an earlier one and more.
    earlier = {r.hash_ids[: r.num_full_blocks(512)] for r in trace}
    assert any(r.hash_ids[:k] in earlier for r in trace for k in range(5, len(r.hash_ids)))


def test_block_hashes_chain_the_full_blocks() -> None:
    a = TraceRequest(0.0, 3 * 512 + 7, 1, (5, 6, 7, 8))
    b = TraceRequest(0.0, 3 * 512, 1, (5, 6, 9))
    c = TraceRequest(0.0, 2 * 512, 1, (6, 6))
    ha, hb, hc = (block_hashes(r, 512) for r in (a, b, c))
    assert (len(ha), len(hb)) == (3, 3)  # a's partial fourth block is not hashed
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert hc[1] != ha[0]  # id 6 after id 6 is another prefix than id 6 after id 5
    assert all(len(h) == 16 for h in ha)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_requests", 0, "num_requests must be >= 1, got 0"),
        ("message_tokens", 1, "message_tokens must be >= 2, got 1"),
        ("requests_per_s", 0.0, "requests_per_s must be a positive number, got 0.0"),
    ],
)
def test_a_bad_shape_says_what_is_wrong(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TraceShape(**{field: value})
