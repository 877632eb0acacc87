"""LoRA adapters in traces and in the simulator: a trace names each request's adapter, a
generated one spreads conversations over adapters by popularity, and simulated workers hold
``max_loras`` adapters in slots, each load costing its step ``lora_load_s``."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from kvswitch.loadtest.sim import prepare, simulate
from kvswitch.loadtest.trace import (
    TraceError,
    TraceRequest,
    block_hashes,
    distinct_blocks,
    read_trace,
    write_trace,
)
from tests.loadtest.helpers import B, chat_trace, config, sim_requests, spaced


def test_a_trace_names_adapters_and_an_adapters_blocks_are_its_own(tmp_path: Path) -> None:
    base = TraceRequest(0.0, 2 * B, 4, (7, 8))
    adapted = replace(base, arrival_s=1.0, lora="sql")
    write_trace(tmp_path / "t.jsonl", [base, adapted])
    assert read_trace(tmp_path / "t.jsonl") == [base, adapted]
    assert '"lora"' not in (tmp_path / "t.jsonl").read_text().splitlines()[0]
    assert not set(block_hashes(base, B)) & set(block_hashes(adapted, B))
    assert distinct_blocks([base, adapted], B) == 4
    (tmp_path / "bad.jsonl").write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "lora": 3}\n'
    )
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: lora must be an adapter's name or null"):
        read_trace(tmp_path / "bad.jsonl")


def test_a_generated_trace_spreads_conversations_over_adapters_by_popularity() -> None:
    trace = chat_trace(2000, num_loras=8, turns_per_conversation=1)
    counts = Counter(r.lora for r in trace)
    assert set(counts) == {f"lora{k}" for k in range(8)}
    assert counts["lora0"] > 2 * counts["lora3"] > 0  # weights 1, 1/2, 1/3, ...
    flat = Counter(r.lora for r in chat_trace(2000, num_loras=8, lora_skew=0.0))
    assert max(flat.values()) < 1.5 * min(flat.values())
    assert {r.lora for r in chat_trace(50)} == {None}


def test_a_worker_loads_an_adapter_per_slot_miss_and_pays_for_it() -> None:
    """One worker, two slots, requests spaced apart: adapters a, b, a, c, a, b: a and b load,
    a hits, c evicts b (the least recently used), a hits, b evicts c: four loads, each making
    its request's first step lora_load_s longer."""
    names = ["a", "b", "a", "c", "a", "b"]
    trace = spaced(
        [
            TraceRequest(0.0, 4 * B, 1, tuple(range(10 * i, 10 * i + 4)), n)
            for i, n in enumerate(names)
        ],
        gap_s=100.0,
    )
    plain = simulate(
        sim_requests(*trace), config(workers=1, max_loras=2, lora_load_s=0.0), "cost", 1.0
    )
    slow = simulate(
        sim_requests(*trace), config(workers=1, max_loras=2, lora_load_s=0.5), "cost", 1.0
    )
    assert plain.num_lora_loads == slow.num_lora_loads == 4
    extra = [b - a for a, b in zip(plain.ttfts_s, slow.ttfts_s, strict=True)]
    assert extra == pytest.approx([0.5, 0.5, 0, 0.5, 0, 0.5])


def test_no_step_runs_more_adapters_than_slots_and_the_books_balance() -> None:
    requests = prepare(chat_trace(300, requests_per_s=100.0, num_loras=6), B)
    run = simulate(requests, config(max_loras=2, capacity_blocks=40), "cost", 1.0, check=True)
    assert run.num_lora_loads > 0
    assert all(ttft > 0 for ttft in run.ttfts_s)


def test_adapter_affinity_loads_fewer_adapters() -> None:
    """Eight workers of four slots, 32 adapters: the cost policy's affinity keeps adapters where
    they are loaded; without it (lora_load_tokens 0) the fleet loads many more."""
    requests = prepare(chat_trace(1500, num_loras=32, requests_per_s=20.0), B)
    fleet = config(workers=8, max_loras=4)
    runs = {
        weights: simulate(requests, replace(fleet, cost_weights=weights), "cost", 1.0)
        for weights in ("", "lora_load_tokens=0")
    }
    with_affinity, without = runs[""], runs["lora_load_tokens=0"]
    assert with_affinity.num_lora_loads < 0.8 * without.num_lora_loads
    hit = with_affinity.num_cached_tokens / with_affinity.num_prompt_tokens
    assert hit >= without.num_cached_tokens / without.num_prompt_tokens - 0.02
