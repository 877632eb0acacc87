"""``ResultBuilder``: chunks in, one result out, and streams that break the protocol."""

from __future__ import annotations

import grpc
import pytest

from kvswitch.client import Chunk, FinishReason, KvswitchError
from kvswitch.client.result import ResultBuilder
from kvswitch.v1 import common_pb2, router_pb2
from tests.client.scripted_router import CHUNKS, FINAL


def _chunk(token_ids: list[int], text: str) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(chunk=common_pb2.TokenChunk(token_ids=token_ids, text=text))


def test_chunks_then_final_make_the_result() -> None:
    builder = ResultBuilder("r")
    assert builder.add(_chunk([1, 2], "ab")) == Chunk([1, 2], "ab")
    assert builder.add(_chunk([3], "")) == Chunk([3], "")  # an incomplete character
    assert builder.add(_chunk([4], "cd")) == Chunk([4], "cd")
    assert builder.result is None
    assert builder.add(router_pb2.GenerateResponse(final=FINAL)) is None
    result = builder.finish()
    assert (result.token_ids, result.text, result.request_id) == ([1, 2, 3, 4], "abcd", "r")
    assert builder.num_messages == 4


def test_no_chunks_is_an_empty_result() -> None:
    final = router_pb2.GenerateFinal(finish_reason=common_pb2.FINISH_REASON_STOP)
    builder = ResultBuilder("r")
    builder.add(router_pb2.GenerateResponse(final=final))
    result = builder.finish()
    assert (result.token_ids, result.text, result.finish_reason) == ([], "", FinishReason.STOP)
    assert result.stats.worker_id == "" and result.route.num_matched_blocks == 0


@pytest.mark.parametrize(
    ("responses", "message"),
    [
        ([_chunk([1], "a")], "the stream ended without a final message"),
        (
            [
                router_pb2.GenerateResponse(final=FINAL),
                router_pb2.GenerateResponse(chunk=CHUNKS[0]),
            ],
            "the router sent a message after the final one",
        ),
        ([router_pb2.GenerateResponse()], "the router sent a message with neither chunk nor final"),
        (
            [router_pb2.GenerateResponse(final=router_pb2.GenerateFinal())],
            "the router sent finish reason 0, which is none of stop, length, abort and error",
        ),
    ],
    ids=["no-final", "after-final", "empty", "unspecified"],
)
def test_broken_streams_are_internal_errors(
    responses: list[router_pb2.GenerateResponse], message: str
) -> None:
    builder = ResultBuilder("r")
    with pytest.raises(KvswitchError) as error:
        for response in responses:
            builder.add(response)
        builder.finish()
    assert (error.value.code, error.value.details) == (grpc.StatusCode.INTERNAL, message)


def test_stats_short_names_are_the_counts() -> None:
    from kvswitch.client.result import Stats

    stats = Stats("w0", 10, 8, 0.5, 3, route_reason="lowest cost")
    assert (stats.prompt_tokens, stats.cached_tokens, stats.output_tokens) == (10, 8, 3)
    assert stats.route_reason == "lowest cost"
