"""Bad input from anyone who reaches a port: raw protobuf bytes, not only what the SDK sends.

Every call must end with a status that says what was wrong (INVALID_ARGUMENT naming the field,
RESOURCE_EXHAUSTED for a message over the size limit), never UNKNOWN or INTERNAL, and afterwards
each worker's KV cache must be whole: its invariants checked each time its engine fell idle
(``check_integrity``), every block free again, and the index in agreement with the workers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvswitch.cache_index.audit import audit
from kvswitch.cache_index.hashing import tokens_to_bytes
from kvswitch.router.server import MESSAGE_READ_FACTOR
from kvswitch.serving import retry_after_ms
from kvswitch.v1 import common_pb2, router_pb2, worker_pb2
from tests.router.harness import BLOCK_BYTES, ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster

ROUTER_GENERATE = "/kvswitch.v1.Router/Generate"
WORKER_GENERATE = "/kvswitch.v1.Worker/Generate"
VOCAB_SIZE = 257  # the built-in model's
MAX_OUTPUT_TOKENS = 8
MAX_PROMPT_TOKENS = 200
MAX_STOP_TOKEN_IDS = 16
MAX_MESSAGE_BYTES = 64 << 10
ROUTER = dataclasses.replace(
    ROUTER_CONFIG,
    max_output_tokens=MAX_OUTPUT_TOKENS,
    max_prompt_tokens=MAX_PROMPT_TOKENS,
    max_stop_token_ids=MAX_STOP_TOKEN_IDS,
    max_message_bytes=MAX_MESSAGE_BYTES,
)
# Statuses that judge the request, each with a message: what any input may end with.
VERDICTS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,  # a LoRA adapter no worker serves
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI must not change its mind
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    # NOTE: a context of 512 tokens: fuzzed bytes may ask a worker for any max_tokens, and
    # none of them may run long enough to miss the call's deadline on a loaded machine.
    worker = dataclasses.replace(
        WORKER_CONFIG, check_integrity=True, kv_cache_bytes=32 * BLOCK_BYTES
    )
    with BackgroundCluster(2, ROUTER, worker) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def router_channel(cluster: BackgroundCluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def worker_channel(cluster: BackgroundCluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.workers[0].address) as channel:
        yield channel


@dataclasses.dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    num_messages: int
    trailing_metadata: tuple = ()


def call(channel: grpc.Channel, method: str, data: bytes, timeout_s: float = 60.0) -> Answer:
    """One streaming call with ``data`` as the request's bytes, read to its end.

    NOTE: a fuzzed max_tokens runs to the 512-token context's end: 510 tokens, which took a busy
    CI machine more than 20 s (424 messages read at the deadline); the bound is a guard against
    a call that never ends, not a speed."""
    stream = channel.unary_stream(method)  # no serializers: bytes in, bytes out
    num_messages = 0
    try:
        for _ in stream(data, timeout=timeout_s):
            num_messages += 1
    except grpc.RpcError as e:
        return Answer(e.code(), e.details() or "", num_messages, e.trailing_metadata() or ())
    return Answer(grpc.StatusCode.OK, "", num_messages)


def assert_workers_whole(cluster: BackgroundCluster) -> None:
    """Every worker serves, checked its cache when idle, holds no block; the index agrees."""
    for worker in cluster.workers:
        deadline = time.monotonic() + 10
        while (load := worker.engine.load).num_free_blocks != load.num_total_blocks:
            assert time.monotonic() < deadline, f"{worker.worker_id} holds blocks: {load}"
            time.sleep(0.02)
        assert worker.engine.counters.num_integrity_checks > 0
        assert not worker.engine_died.done()
    audits = cluster.run(audit(cluster.router.index))
    assert {a.worker_id for a in audits} == {w.worker_id for w in cluster.workers}
    assert all(a.num_stale == a.num_missing == 0 and not a.error for a in audits), audits


def router_request(**fields) -> router_pb2.GenerateRequest:
    """A good request (three tokens, two to generate) with ``fields`` set over it: a dict sets
    fields of a message field, a message replaces one."""
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=[256, 72, 105]),
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    set_fields(request, fields)
    return request


def set_fields(message, fields: dict) -> None:
    for name, value in fields.items():
        if isinstance(value, dict):
            set_fields(getattr(message, name), value)
        elif isinstance(value, str | bytes | int | float):
            setattr(message, name, value)
        else:
            getattr(message, name).CopyFrom(value)


def text_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field as it goes on the wire (payloads under 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


GOOD = router_request().SerializeToString()


# -- malformed messages ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (text_field(2, b"\xff\xfehi"), "text is not valid UTF-8"),
        (GOOD + text_field(5, b"\xc3"), "lora is not valid UTF-8"),
        (GOOD + text_field(7, text_field(1, b"\xed\xa0\x80")), "routing.policy is not valid UTF-8"),
        (GOOD[:-1], "sampling is cut short"),
        (b"\x00\x01", "has a field numbered 0"),
        (b"\x0f", "wire type 7"),
        (GOOD + b"\x92", "ends inside a field tag"),
    ],
    ids=["text-utf8", "lora-utf8", "nested-utf8", "truncated", "field-0", "wire-type", "tag"],
)
def test_a_malformed_router_request_is_invalid_argument_naming_the_field(
    router_channel: grpc.Channel, data: bytes, message: str
) -> None:
    answer = call(router_channel, ROUTER_GENERATE, data)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert answer.details.startswith("malformed kvswitch.v1.GenerateRequest: ")
    assert message in answer.details


def test_a_malformed_worker_request_is_invalid_argument_naming_the_field(
    worker_channel: grpc.Channel,
) -> None:
    source = text_field(1, b"\x80peer")  # KVSource.peer_address
    answer = call(worker_channel, WORKER_GENERATE, text_field(9, source))
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert answer.details == (
        "malformed kvswitch.v1.WorkerGenerateRequest: kv_source.peer_address is not valid UTF-8"
    )


def test_a_message_over_the_size_limit_says_its_size_the_limit_and_the_field(
    router_channel: grpc.Channel,
) -> None:
    large = router_request(text="a" * MAX_MESSAGE_BYTES).SerializeToString()
    answer = call(router_channel, ROUTER_GENERATE, large)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert answer.details == (
        f"kvswitch.v1.GenerateRequest is {len(large)} bytes; this server takes at most "
        f"{MAX_MESSAGE_BYTES} (--max-message-bytes); its field text is {MAX_MESSAGE_BYTES} "
        "bytes of it"
    )


def test_a_message_far_over_the_limit_is_cut_off_by_grpc(router_channel: grpc.Channel) -> None:
    # Past 4x the limit gRPC stops reading; a client must not retry it (no retry-after-ms).
    huge = router_request(text="a" * (MESSAGE_READ_FACTOR * MAX_MESSAGE_BYTES)).SerializeToString()
    answer = call(router_channel, ROUTER_GENERATE, huge)
    assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_after_ms(answer.trailing_metadata) == 0


# -- values out of bounds --------------------------------------------------------------------


def ids(*values: int) -> router_pb2.TokenIds:
    return router_pb2.TokenIds(ids=values)


NAN = math.nan


def test_an_adapter_no_worker_serves_is_not_found_by_name(router_channel: grpc.Channel) -> None:
    request = router_request(lora="sql-adapter")
    answer = call(router_channel, ROUTER_GENERATE, request.SerializeToString())
    assert answer.code == grpc.StatusCode.NOT_FOUND, answer
    assert "lora: no live worker serves the adapter 'sql-adapter'" in answer.details
    assert answer.num_messages == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"token_ids": ids(256, 300)}, "token id 300 is outside the vocabulary [0, 257)"),
        ({"token_ids": ids(2**32 - 1)}, f"token id {2**32 - 1} is outside the vocabulary"),
        ({"token_ids": router_pb2.TokenIds()}, "the prompt is empty"),
        ({"token_ids": router_pb2.TokenIds(ids_u32le=b"abc")}, "token_ids.ids_u32le: "),
        ({"token_ids": ids(*[65] * 201)}, "token_ids: the prompt has 201 tokens; this router"),
        ({"text": "x" * 250}, "text: the prompt has 251 tokens"),
        ({"sampling": {"max_tokens": 2**32 - 1}}, "sampling.max_tokens must be at most 8"),
        ({"sampling": {"temperature": -1.0}}, "sampling.temperature must be a finite number"),
        ({"sampling": {"temperature": NAN}}, "sampling.temperature must be a finite number"),
        ({"sampling": {"temperature": math.inf}}, "sampling.temperature must be a finite"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p must be in (0, 1]"),
        ({"sampling": {"top_p": -NAN}}, "sampling.top_p must be in (0, 1]"),
        ({"sampling": common_pb2.SamplingParams(stop_token_ids=range(17))}, "stop_token_ids"),
        ({"request_id": "a\nforged log line"}, "request_id must be printable characters"),
        ({"request_id": "r" * 300}, "request_id must be at most 256 characters, got 300"),
        ({"cache_salt": "s" * 257}, "cache_salt must be at most 256 characters"),
        ({"routing": {"policy": "fastest"}}, "routing.policy: unknown routing policy 'fastest'"),
        (
            {"routing": router_pb2.RoutingOverrides(weights={"decode_weight": NAN})},
            "routing.weights['decode_weight'] must be a finite number",
        ),
        (
            {"routing": router_pb2.RoutingOverrides(weights={"speed": 1.0})},
            "unknown cost weights ['speed']",
        ),
    ],
)
def test_an_out_of_bounds_router_request_is_invalid_argument_naming_the_field(
    router_channel: grpc.Channel, fields: dict, message: str
) -> None:
    request = router_request(**fields)
    answer = call(router_channel, ROUTER_GENERATE, request.SerializeToString())
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert message in answer.details, answer.details
    assert answer.num_messages == 0


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"num_resumed_tokens": 3}, "num_resumed_tokens must be in [0, 3)"),
        ({"hold_blocks_ms": 10**9}, "a lease lasts 0 to 600 s"),
        ({"prompt_token_ids_u32le": b"\x01\x00\x00\x00"}, "set one"),
        ({"kv_source": worker_pb2.KVSource()}, "kv_source names no peer_address"),
        (
            {"kv_source": worker_pb2.KVSource(peer_address="p:1", transport="pigeon")},
            "kv_source.transport must be auto, nixl, mapped, shm, grpc or empty",
        ),
        (
            {"kv_source": worker_pb2.KVSource(peer_address="p:1", on_failure="shrug")},
            "kv_source.on_failure must be recompute, fail or empty",
        ),
        ({"sampling": common_pb2.SamplingParams(top_p=2.0)}, "sampling.top_p must be in (0, 1]"),
    ],
    ids=["resumed", "hold", "both-prompts", "no-peer", "transport", "on-failure", "top_p"],
)
def test_an_out_of_bounds_worker_request_is_invalid_argument_naming_the_field(
    worker_channel: grpc.Channel, request_fields: dict, message: str
) -> None:
    request = worker_pb2.WorkerGenerateRequest(request_id="bad", prompt_token_ids=[256, 72, 105])
    set_fields(request, request_fields)
    answer = call(worker_channel, WORKER_GENERATE, request.SerializeToString())
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert message in answer.details, answer.details


def test_one_request_id_many_times_at_once_is_served_every_time(
    cluster: BackgroundCluster, router_channel: grpc.Channel
) -> None:
    """A client's request id is a label: the workers know each request by the router's own."""
    data = router_request(
        request_id="twin", token_ids=ids(256, *[65] * 150), sampling={"max_tokens": 8}
    ).SerializeToString()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: call(router_channel, ROUTER_GENERATE, data), range(8)))
    assert [a.code for a in answers] == [grpc.StatusCode.OK] * 8, answers
    assert all(a.num_messages >= 2 for a in answers)  # its tokens and a final message
    assert_workers_whole(cluster)


# -- fuzzing ---------------------------------------------------------------------------------


def check_verdict(answer: Answer) -> None:
    assert answer.code in VERDICTS, answer
    if answer.code != grpc.StatusCode.OK:
        assert answer.details, answer


def test_random_bytes_never_break_the_router(
    cluster: BackgroundCluster, router_channel: grpc.Channel
) -> None:
    @FUZZ
    @given(st.binary(max_size=300) | st.binary(max_size=60).map(lambda tail: GOOD + tail))
    def send(data: bytes) -> None:
        check_verdict(call(router_channel, ROUTER_GENERATE, data))

    send()
    assert_workers_whole(cluster)


token_id = st.integers(0, 2**32 - 1) | st.integers(0, VOCAB_SIZE - 1)
finite_or_not = st.floats(allow_nan=True, allow_infinity=True, width=32)
sampling = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.integers(0, 2**32 - 1) | st.integers(0, MAX_OUTPUT_TOKENS),
    temperature=finite_or_not | st.floats(0, 2, width=32),
    top_p=finite_or_not | st.floats(0, 1, width=32),
    seed=st.integers(0, 2**64 - 1),
    stop_token_ids=st.lists(token_id, max_size=24),
)
names = st.text(max_size=300) | st.sampled_from(["", "tenant-a", "a\x00b"])
prompts = st.one_of(
    st.lists(token_id, max_size=220).map(lambda values: {"token_ids": ids(*values)}),
    st.text(max_size=260).map(lambda text: {"text": text}),
    st.binary(max_size=40).map(lambda raw: {"token_ids": router_pb2.TokenIds(ids_u32le=raw)}),
)
routing = st.builds(
    router_pb2.RoutingOverrides,
    policy=st.sampled_from(["", "cost", "prefix", "round_robin", "best"]),
    weights=st.dictionaries(
        st.sampled_from(["decode_weight", "min_match", "temperature", "x"]), finite_or_not
    ),
)


@st.composite
def router_requests(draw: st.DrawFn) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(
        request_id=draw(names),
        sampling=draw(sampling),
        lora=draw(st.sampled_from(["", "", "sql-adapter"])),
        cache_salt=draw(names),
        routing=draw(routing),
    )
    set_fields(request, draw(prompts))
    return request


def test_absurd_router_requests_get_a_verdict(
    cluster: BackgroundCluster, router_channel: grpc.Channel
) -> None:
    @FUZZ
    @given(router_requests())
    def send(request: router_pb2.GenerateRequest) -> None:
        answer = call(router_channel, ROUTER_GENERATE, request.SerializeToString())
        check_verdict(answer)
        if answer.code == grpc.StatusCode.INVALID_ARGUMENT:
            # Out of bounds: refused before routing, or by the worker, naming what it refused.
            named = ("request_id", "lora", "cache_salt", "sampling.", "routing.", "token", "text")
            assert any(name in answer.details for name in named), answer.details

    send()
    assert_workers_whole(cluster)


@st.composite
def worker_requests(draw: st.DrawFn) -> worker_pb2.WorkerGenerateRequest:
    values = draw(st.lists(token_id, max_size=220))
    request = worker_pb2.WorkerGenerateRequest(
        request_id=draw(names),
        sampling=draw(sampling),
        lora=draw(st.sampled_from(["", "", "sql-adapter"])),
        cache_salt=draw(names),
        num_resumed_tokens=draw(st.integers(0, 2**32 - 1) | st.integers(0, 4)),
        hold_blocks_ms=draw(st.sampled_from([0, 0, 500, 10**9])),
    )
    if draw(st.booleans()):
        request.prompt_token_ids_u32le = draw(st.binary(max_size=12)) or tokens_to_bytes(values)
    else:
        request.prompt_token_ids[:] = values
    return request


def test_random_and_absurd_worker_requests_get_a_verdict(
    cluster: BackgroundCluster, worker_channel: grpc.Channel
) -> None:
    sent_ids: list[str] = []

    @FUZZ
    @given(st.binary(max_size=300) | worker_requests().map(lambda r: r.SerializeToString()))
    def send(data: bytes) -> None:
        try:
            request = worker_pb2.WorkerGenerateRequest.FromString(data)
        except Exception:
            request = None
        # NOTE: a parsed kv_source would send the worker to fetch from whatever address the
        # bytes spell; the tests above check kv_source's fields.
        assume(request is None or not request.HasField("kv_source"))
        if request is not None:
            sent_ids.append(request.request_id)
        answer = call(worker_channel, WORKER_GENERATE, data)
        assert answer.code in VERDICTS | {grpc.StatusCode.FAILED_PRECONDITION}, answer

    send()
    # What a fuzzed hold_blocks_ms kept for a peer that never comes: given back, as a router
    # would.
    stub = worker_channel.unary_unary(
        "/kvswitch.v1.Worker/ReleaseBlocks",
        request_serializer=worker_pb2.ReleaseBlocksRequest.SerializeToString,
        response_deserializer=worker_pb2.ReleaseBlocksResponse.FromString,
    )
    for request_id in set(sent_ids):
        stub(worker_pb2.ReleaseBlocksRequest(transfer_id=request_id), timeout=5)
    assert_workers_whole(cluster)
