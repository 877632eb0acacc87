"""A step's outputs travel as columns and read back as one RequestOutput per request."""

from __future__ import annotations

import numpy as np

from kvswitch.worker import core_protocol as wire
from kvswitch.worker.request import (
    FinishReason,
    FirstToken,
    Logprobs,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    TokenLogprobs,
)


def one_step() -> StepOutputs:
    """ "a" produces its first token, "b" decodes, "c" produces its first and last token."""
    return StepOutputs(
        ["a", "b", "c"],
        [7, 8, 9],
        first={"a": FirstToken(100, 64, 0.25), "c": FirstToken(5, 0, 0.5)},
        finished={"c": FinishReason.STOP},
    )


def test_iterating_gives_each_request_its_figures_and_finish() -> None:
    assert list(one_step()) == [
        RequestOutput("a", [7], False, None, 100, 64, 0.25),
        RequestOutput("b", [8], False),
        RequestOutput("c", [9], True, FinishReason.STOP, 5, 0, 0.5),
    ]


def test_outputs_cross_the_core_pipe_unchanged() -> None:
    outputs = one_step()
    back = wire.outputs_from_wire(wire.unpack(wire.pack(wire.outputs_to_wire(outputs))))
    assert back == outputs
    assert len(back) == 3


def test_logprobs_and_embeddings_cross_the_core_pipe_and_reach_their_requests() -> None:
    outputs = one_step()
    sampled = Logprobs(
        np.array([-0.5], np.float32),
        np.array([[7, 3]]),
        np.array([[-0.5, -1.25]], np.float32),
    )
    bare = Logprobs(np.array([-2.0], np.float32), np.zeros((1, 0), int), np.zeros((1, 0)))
    prompt = Logprobs(
        np.full(99, -3.0, np.float32), np.ones((99, 1), int), np.full((99, 1), -0.1, np.float32)
    )
    outputs.logprobs = {"a": sampled, "b": bare}
    outputs.prompt_logprobs = {"a": prompt}
    outputs.embeddings = {"c": [0.6, 0.8]}
    back = wire.outputs_from_wire(wire.unpack(wire.pack(wire.outputs_to_wire(outputs))))
    assert back == outputs
    a, b, c = back
    assert a.logprobs.tokens() == [TokenLogprobs(-0.5, (7, 3), (-0.5, -1.25))]
    assert a.prompt_logprobs == prompt and len(a.prompt_logprobs) == 99 and a.embedding is None
    assert b.logprobs.tokens() == [TokenLogprobs(-2.0)] and b.prompt_logprobs is None
    assert c.logprobs is None and c.embedding == [0.6, 0.8]
    assert Logprobs.join([sampled, sampled]).tokens() == sampled.tokens() * 2


def test_an_older_peers_messages_read_with_the_defaults() -> None:
    # A STEP and params from before logprobs: the fields they lack read as not asked.
    old = wire.outputs_to_wire(one_step())[:4]
    assert wire.outputs_from_wire(old) == one_step()
    assert wire.params_from_wire([4, 0.0, 1.0, None, []]) == SamplingParams(max_tokens=4)
    params = SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=0)
    assert wire.params_from_wire(wire.params_to_wire(params)) == params
