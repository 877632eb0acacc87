"""``GenerateParams``: the client's own checks, and the protobuf it sends."""

from __future__ import annotations

import grpc
import pytest

from kvswitch.client.errors import KvswitchError
from kvswitch.client.request import GenerateParams
from kvswitch.v1 import common_pb2, router_pb2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "pass exactly one of prompt (text) and prompt_token_ids"),
        (
            {"prompt": "a", "prompt_token_ids": [1]},
            "pass exactly one of prompt (text) and prompt_token_ids, not both",
        ),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": b"a"}, "prompt must be a str, got bytes"),
        ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids must hold ints in [0, 2**32), got -2"),
        ({"prompt_token_ids": [1.5]}, "prompt_token_ids must hold ints in [0, 2**32), got 1.5"),
    ],
)
def test_bad_prompts_are_value_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        GenerateParams(**kwargs)
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"stop_token_ids": [1 << 32]},
            "stop_token_ids must hold ints in [0, 2**32), got 4294967296",
        ),
        (
            {"max_tokens": -1},
            "max_tokens must be an int >= 0 (0 means the router's default), got -1",
        ),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"seed": -1}, "seed must be an int in [0, 2**64), got -1"),
        ({"weights": {"cache": float("inf")}}, "weights['cache'] must be a finite number, got inf"),
        ({"request_id": "r" * 257}, "request_id must be at most 256 characters, got 257"),
        ({"cache_salt": "s" * 300}, "cache_salt must be at most 256 characters, got 300"),
        ({"cache_salt": 7}, "cache_salt must be a str, got int"),
        ({"lora": "a\nb"}, "lora must be printable characters, got 'a\\nb'"),
        ({"request_id": ""}, "request_id is empty; pass None to have one generated"),
    ],
)
def test_bad_options_are_value_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        GenerateParams("a", **kwargs)
    assert str(error.value) == message


def test_a_prompt_with_a_lone_surrogate_is_named_before_it_is_sent() -> None:
    # What a bad decode (errors="surrogateescape") leaves: no UTF-8 form exists to send.
    with pytest.raises(ValueError) as error:
        GenerateParams("ok \udc80 no")
    assert str(error.value) == (
        "prompt is not valid Unicode: a lone surrogate '\\udc80' at character 3"
    )


def test_an_unknown_option_is_named_with_the_known_ones() -> None:
    with pytest.raises(TypeError) as error:
        GenerateParams.from_options("a", {"max_tokens": 4, "stop": ["\n"]})
    assert str(error.value).startswith("unknown option 'stop'; the options are cache_salt, ")
    assert "max_tokens" in str(error.value) and "prompt_token_ids" in str(error.value)
    assert GenerateParams.from_options("a", {"max_tokens": 4}).max_tokens == 4


def test_an_error_names_its_request_once() -> None:
    details = "request r1: token id 999 is outside the vocabulary [0, 257)"
    error = KvswitchError(grpc.StatusCode.INVALID_ARGUMENT, details, "r1")
    assert str(error) == (
        "request r1 failed with INVALID_ARGUMENT: token id 999 is outside the vocabulary [0, 257)"
    )
    assert error.details == details  # the server's own words, untouched


def test_limits_are_inclusive() -> None:
    GenerateParams("a", max_tokens=0, temperature=0.0, top_p=1.0, seed=(1 << 64) - 1)
    GenerateParams(prompt_token_ids=[0, (1 << 32) - 1])


def test_defaults_become_the_protocols_empty_values() -> None:
    request = GenerateParams(prompt_token_ids=[5, 6], request_id="r").to_request()
    assert request == router_pb2.GenerateRequest(
        request_id="r",
        # The ids as little-endian uint32 bytes, which the router hands on to the worker.
        token_ids=router_pb2.TokenIds(ids_u32le=b"\x05\x00\x00\x00\x06\x00\x00\x00"),
        sampling=common_pb2.SamplingParams(max_tokens=16, top_p=1.0),
        routing=router_pb2.RoutingOverrides(),
    )
    assert not request.sampling.HasField("seed")


def test_each_request_gets_a_fresh_id() -> None:
    params = GenerateParams("a")
    first, second = params.to_request().request_id, params.to_request().request_id
    assert first != second
    assert len(first) == 32 and int(first, 16) >= 0
