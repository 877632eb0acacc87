"""A step's outputs travel as columns and read back as one RequestOutput per token."""

from __future__ import annotations

from kvswitch.worker import core_protocol as wire
from kvswitch.worker.request import FinishReason, FirstToken, RequestOutput, StepOutputs


def two_steps() -> StepOutputs:
    """Step 1: "a" produces its first token, "b" decodes; step 2: "a" decodes and finishes."""
    outputs = StepOutputs(["a", "b"], [7, 8], first={"a": FirstToken(100, 64, 0.25)})
    outputs.extend(StepOutputs(["a"], [9], finished={"a": FinishReason.STOP}))
    return outputs


def test_iterating_gives_figures_with_the_first_token_and_the_finish_with_the_last() -> None:
    assert list(two_steps()) == [
        RequestOutput("a", [7], False, None, 100, 64, 0.25),
        RequestOutput("b", [8], False),
        RequestOutput("a", [9], True, FinishReason.STOP),
    ]


def test_outputs_cross_the_core_pipe_unchanged() -> None:
    outputs = two_steps()
    back = wire.outputs_from_wire(wire.unpack(wire.pack(wire.outputs_to_wire(outputs))))
    assert back == outputs
    assert len(back) == 3
