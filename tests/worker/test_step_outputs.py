"""A step's outputs travel as columns and read back as one RequestOutput per request."""

from __future__ import annotations

from kvswitch.worker import core_protocol as wire
from kvswitch.worker.request import FinishReason, FirstToken, RequestOutput, StepOutputs


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
