"""``kvswitch sim`` with nothing tuned: a generated trace, and a capacity derived from the trace."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvswitch.app.cli import main
from kvswitch.loadtest.sim import Capacity, derive_capacity, fleet_capacity
from kvswitch.loadtest.trace import (
    TRACE_SHAPES,
    TraceRequest,
    generated_shape,
    load_trace,
)
from tests.loadtest.helpers import B, config

SMALL_CHAT = "generated:chat,num_requests=120"


def test_sim_runs_a_generated_trace_with_a_capacity_derived_from_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["sim", "--trace", SMALL_CHAT, "--workers", "4"])
    captured = capsys.readouterr()
    figures = json.loads(captured.out)
    trace = load_trace(SMALL_CHAT, B)
    distinct = {i for r in trace for i in r.hash_ids[: r.num_prompt_tokens // B]}
    num_blocks = len(distinct) // 2 // 4  # half of them over the workers
    how = f"derived: 0.5 x {len(distinct)} distinct blocks in the trace / 4 workers"
    assert figures["capacity"] == {"blocks_per_worker": num_blocks, "how": how}
    assert f"  120 requests, 4 workers of {num_blocks} blocks ({how})\n" in captured.err
    assert figures["policies"]["cost"]["token_hit_rate"] > 0
    assert figures["global_cache"]["token_hit_rate"] <= figures["infinite_cache"]["token_hit_rate"]


def test_a_capacity_given_is_used_and_said_to_be_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["sim", "--trace", SMALL_CHAT, "--capacity-blocks", "30", "--policy", "round_robin"])
    captured = capsys.readouterr()
    assert json.loads(captured.out)["capacity"] == {"blocks_per_worker": 30, "how": "given"}
    assert "16 workers of 30 blocks (given)" in captured.err


def tiny_trace() -> list[TraceRequest]:
    """Ten one-block prompts, then one of 600 tokens: 11 full blocks, one partial."""
    requests = [TraceRequest(float(k), B, 1, (k,)) for k in range(10)]
    return [*requests, TraceRequest(10.0, 600, 1, (10, 11))]


@pytest.mark.parametrize(
    ("num_workers", "expected"),
    [
        (1, Capacity(5, "derived: 0.5 x 11 distinct blocks in the trace / 1 workers")),
        (2, Capacity(2, "derived: 0.5 x 11 distinct blocks in the trace / 2 workers")),
        (
            4,
            Capacity(
                2,
                "derived: the largest request's 2 blocks, more than 0.5 x 11 distinct blocks in "
                "the trace / 4 workers = 1",
            ),
        ),
        (
            8,
            Capacity(
                2,
                "derived: the largest request's 2 blocks, more than 0.5 x 11 distinct blocks in "
                "the trace / 8 workers = 0",
            ),
        ),
    ],
)
def test_the_derived_capacity_is_half_the_distinct_full_blocks_over_the_workers(
    num_workers: int, expected: Capacity
) -> None:
    assert derive_capacity(tiny_trace(), num_workers, B) == expected
    assert fleet_capacity(tiny_trace(), config(workers=num_workers, capacity_blocks=0)) == expected


def test_a_capacity_given_is_kept() -> None:
    assert fleet_capacity(tiny_trace(), config(capacity_blocks=3)) == Capacity(3, "given")


@pytest.mark.parametrize("capacity", ["0", "-5", "many"])
def test_a_capacity_of_no_blocks_is_a_usage_error(
    capacity: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "--trace", SMALL_CHAT, f"--capacity-blocks={capacity}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(
        "kvswitch sim: error: argument --capacity-blocks: must be a number of KV blocks >= 1, or "
        f"auto (derived from the trace), got {capacity!r}\n"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "generated:chats",
            "--trace generated:chats: unknown trace shape 'chats'; give "
            "generated:SHAPE,key=value,... with SHAPE one of chat, docs (e.g. "
            "generated:chat,num_requests=200)",
        ),
        (
            "generated:docs,requests=5",
            "--trace generated:docs,requests=5: bad parameter 'requests=5'; known (defaults): "
            "num_requests=1000, requests_per_s=10.0, num_prefixes=32, prefix_tokens=8192, ",
        ),
        (
            "generated:chat,num_requests=few",
            "--trace generated:chat,num_requests=few: num_requests must be a int, got 'few'",
        ),
        (
            "generated:chat,num_requests=0",
            "--trace generated:chat,num_requests=0: num_requests must be >= 1, got 0",
        ),
    ],
)
def test_a_bad_generated_trace_is_a_usage_error_saying_what_is_accepted(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "--trace", spec])
    assert exit_info.value.code == 2
    assert f"kvswitch sim: error: {message}" in capsys.readouterr().err


def test_a_generated_spec_is_a_preset_with_fields_over_it_at_the_sims_block_size() -> None:
    docs = generated_shape("generated:docs, num_requests=5, seed=2", 256)
    assert docs == replace(TRACE_SHAPES["docs"], num_requests=5, seed=2, block_tokens=256)
    assert generated_shape("generated:num_requests=5") == replace(
        TRACE_SHAPES["chat"], num_requests=5
    )
    assert generated_shape("generated:") == TRACE_SHAPES["chat"]
    trace = load_trace("generated:docs,num_requests=5", 256)
    assert len(trace) == 5 and all(r.num_prompt_tokens > 8192 for r in trace)
    assert all(len(r.hash_ids) == -(-r.num_prompt_tokens // 256) for r in trace)
    assert load_trace("generated:docs,num_requests=5", 256) == trace
