"""Small traces for the simulator's tests."""

from __future__ import annotations

from dataclasses import replace

from kvswitch.loadtest.sim import SimConfig, SimRequest, prepare
from kvswitch.loadtest.trace import TraceRequest, TraceShape, generate_trace

B = 512


def sim_requests(*requests: TraceRequest, block_tokens: int = B) -> list[SimRequest]:
    return prepare(list(requests), block_tokens)


def config(**overrides) -> SimConfig:
    """A small fleet on the CPU profile."""
    fields = {"trace": "-", "workers": 4, "capacity_blocks": 200, "profile": "cpu"}
    return SimConfig(**(fields | overrides))


def chat_trace(num_requests: int = 300, **shape) -> list[TraceRequest]:
    """Conversations on a few shared prefixes: short prompts, so runs are quick."""
    fields = {
        "num_requests": num_requests,
        "requests_per_s": 8.0,
        "num_prefixes": 4,
        "prefix_tokens": 2048,
        "message_tokens": 600,
        "output_tokens": 64,
        "think_time_s": 5.0,
    }
    return generate_trace(TraceShape(**(fields | shape)))


def spaced(requests: list[TraceRequest], gap_s: float) -> list[TraceRequest]:
    """The same requests ``gap_s`` apart: each finishes before the next arrives."""
    return [replace(r, arrival_s=i * gap_s) for i, r in enumerate(requests)]
