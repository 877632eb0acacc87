"""The router's OpenAI-compatible HTTP API, spoken to by the ``openai`` package: a real router
with ``http_port`` and a real worker of the built-in model, compared token for token with what
the gRPC SDK gets for the same prompt (greedy sampling is deterministic)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from kvswitch.client import Client
from kvswitch.router.server import start_router
from tests.router.harness import ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster

TOKEN = "http-secret"
# NOTE: the engine on a thread of the worker's process: the same engine, started in a fraction
# of the time a process of its own takes.
WORKER = dataclasses.replace(WORKER_CONFIG, engine_in_process=True)
ROUTER = dataclasses.replace(ROUTER_CONFIG, http_port=0)
PROMPT = "The router sends each request to the worker that holds its prompt."
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello?"}]
# The built-in model's chat template, written out (router/chat_template.py).
CHAT_PROMPT = "system: Be terse.\nuser: Hello?\nassistant:"


def openai_client(
    cluster: BackgroundCluster, api_key: str = TOKEN, **options: object
) -> openai.OpenAI:
    front = cluster.router.http_front
    assert front is not None
    return openai.OpenAI(base_url=front.url, api_key=api_key, max_retries=0, **options)


def bytes_prompt(text: str) -> list[int]:
    return [256, *text.encode()]  # the built-in model's byte tokens, BOS first


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    with BackgroundCluster(1, dataclasses.replace(ROUTER, token=TOKEN), WORKER) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: BackgroundCluster) -> Iterator[openai.OpenAI]:
    with openai_client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (card,) = client.models.list().data
    return card.id


@pytest.fixture(scope="module")
def grpc_client(cluster: BackgroundCluster) -> Iterator[Client]:
    with Client(cluster.address, token=TOKEN) as grpc_client:
        yield grpc_client


def test_models_lists_the_model_the_workers_serve(client: openai.OpenAI, model: str) -> None:
    assert model == "kvswitch-tiny"
    assert client.models.retrieve(model).owned_by == "kvswitch"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_a_completion_is_what_the_grpc_path_gives(
    client: openai.OpenAI, model: str, grpc_client: Client
) -> None:
    expected = grpc_client.generate(PROMPT, max_tokens=12, temperature=0.0)
    raw = client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0
    )
    completion = raw.parse()
    (choice,) = completion.choices
    assert (choice.text, choice.finish_reason) == (expected.text, "length")
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    usage = completion.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT) + 1, 12)
    assert usage.total_tokens == len(PROMPT) + 13
    assert raw.headers["x-kvswitch-worker"] == "w0"
    assert raw.headers["x-kvswitch-route-reason"]
    # The same prompt as token ids.
    by_ids = client.completions.create(
        model=model, prompt=bytes_prompt(PROMPT), max_tokens=12, temperature=0
    )
    assert by_ids.choices[0].text == expected.text


def test_chat_applies_the_template_and_is_what_the_grpc_path_gives(
    client: openai.OpenAI, model: str, grpc_client: Client
) -> None:
    expected = grpc_client.generate(
        prompt_token_ids=bytes_prompt(CHAT_PROMPT), max_tokens=10, temperature=0.0
    )
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=10, temperature=0
    )
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    assert (choice.message.content, choice.finish_reason) == (expected.text, "length")
    assert chat.usage is not None and chat.usage.prompt_tokens == len(CHAT_PROMPT) + 1
    # Text parts of a message are its content, joined.
    parts = [{"type": "text", "text": "Hello?"}]
    same = client.chat.completions.create(
        model=model,
        messages=[MESSAGES[0], {"role": "user", "content": parts}],
        max_tokens=10,
        temperature=0,
    )
    assert same.choices[0].message.content == expected.text


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_stream_adds_up_to_the_whole_answer(client: openai.OpenAI, model: str, kind: str) -> None:
    def create(**options: object):
        if kind == "chat":
            return client.chat.completions.with_raw_response.create(
                model=model, messages=MESSAGES, max_tokens=20, temperature=0, **options
            )
        return client.completions.with_raw_response.create(
            model=model, prompt=PROMPT, max_tokens=20, temperature=0, **options
        )

    whole = create().parse()
    raw = create(stream=True, stream_options={"include_usage": True})
    assert raw.headers["x-kvswitch-worker"] == "w0"
    chunks = list(raw.parse())
    *with_text, last, usage_chunk = chunks
    if kind == "chat":
        assert with_text[0].choices[0].delta.role == "assistant"
        pieces = [c.choices[0].delta.content or "" for c in with_text]
        assert "".join(pieces) == whole.choices[0].message.content
    else:
        assert "".join(c.choices[0].text for c in with_text) == whole.choices[0].text
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in with_text)
    assert last.choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_a_repeated_long_prompt_is_served_from_the_cache(client: openai.OpenAI, model: str) -> None:
    prompt = "A long shared document about prefix caching. " * 4  # 184 bytes: 11 full blocks
    cached = []
    for _ in range(2):
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0
        )
        assert completion.usage is not None and completion.usage.prompt_tokens_details
        cached.append(completion.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0
    assert cached[1] >= 160


def test_a_whole_answer_comes_in_few_chunks_and_a_stream_in_many(
    cluster: BackgroundCluster, client: openai.OpenAI, model: str, grpc_client: Client
) -> None:
    """A non-streamed completion, and the SDK's generate, ask the worker for chunks of 64
    tokens (GenerateRequest.stream_interval): 40 tokens come as the first and then the rest,
    one chunk after the first (the router counts each in its inter-token histogram); a
    stream's come one a chunk (several where the worker had several ready). The same text."""
    registry = cluster.router.metrics.registry

    def chunks_after_the_first() -> float:
        name = "kvswitch_router_inter_token_latency_seconds_count"
        return registry.get_sample_value(name) or 0.0

    before = chunks_after_the_first()
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    assert chunks_after_the_first() - before == 1
    before = chunks_after_the_first()
    result = grpc_client.generate(PROMPT, max_tokens=40, temperature=0.0)
    assert chunks_after_the_first() - before == 1
    before = chunks_after_the_first()
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=40, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream)
    assert chunks_after_the_first() - before > 2
    assert streamed == whole.choices[0].text == result.text


def test_stop_strings_cut_the_text(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 :][:2]
    expected = text[: text.index(stop)]
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "never"]
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    assert cut.usage is not None and cut.usage.prompt_tokens == len(PROMPT) + 1
    # The router's accounting never came (cancelled at the stop): the first chunk said it.
    assert cut.usage.prompt_tokens_details is not None
    assert cut.usage.prompt_tokens_details.cached_tokens == (len(PROMPT) + 1) // 16 * 16
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 40000}, "max_tokens"),  # the router's own limit, from its refusal
        ({"n": 2}, "n"),
        ({"logprobs": 21}, "logprobs"),  # more alternatives than 20
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"temperature": -1}, "temperature"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": ["x", 5]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": "x" * 20000}, "prompt"),  # longer than the model's context
        ({"extra_body": {"top_k": 5}}, "top_k"),
        ({"extra_body": {"routing": {"policy": "fastest"}}}, "routing"),
    ],
)
def test_a_bad_or_unsupported_parameter_is_refused_by_name(
    client: openai.OpenAI, model: str, options: dict, param: str
) -> None:
    arguments = {"model": model, "prompt": PROMPT, "max_tokens": 4, **options}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**arguments)
    assert refused.value.param == param
    assert refused.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "Hello?"}]}, "messages[0].role"),
        ({"messages": [MESSAGES[0], {"role": "tool", "content": "42"}]}, "messages[1].role"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_a_bad_chat_request_is_refused_by_name(
    client: openai.OpenAI, model: str, options: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{"model": model, "messages": MESSAGES, **options})
    assert refused.value.param == param
    assert refused.value.type == "invalid_request_error"


def test_an_unknown_model_or_a_wrong_token_is_refused(
    cluster: BackgroundCluster, client: openai.OpenAI, model: str
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert (missing.value.param, missing.value.code) == ("model", "model_not_found")
    with openai_client(cluster, api_key="wrong") as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model=model, messages=MESSAGES, stream=True)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()


def test_a_request_before_any_worker_waits_for_one_then_checks_its_model() -> None:
    """With no worker live, a request waits for one as the router would; the model that comes
    must be the one asked for (not served by whatever comes), and none coming is a 503."""
    router = dataclasses.replace(ROUTER, wait_for_worker_s=30)
    with (
        BackgroundCluster(0, router, WORKER) as cluster,
        openai_client(cluster) as client,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        create = client.completions.create
        wrong = pool.submit(create, model="gpt-4", prompt=PROMPT, max_tokens=2)
        right = pool.submit(create, model="kvswitch-tiny", prompt=PROMPT, max_tokens=2)
        time.sleep(0.5)
        assert not wrong.done() and not right.done()
        cluster.add_worker("w0")
        with pytest.raises(openai.NotFoundError) as missing:
            wrong.result(timeout=30)
        assert "served here: 'kvswitch-tiny'" in str(missing.value)
        completion = right.result(timeout=30)
        assert completion.usage is not None and completion.usage.completion_tokens == 2
    with BackgroundCluster(0, ROUTER, WORKER) as cluster, openai_client(cluster) as client:
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as unavailable:
            client.completions.create(model="kvswitch-tiny", prompt=PROMPT, max_tokens=2)
        assert unavailable.value.status_code == 503
        assert "no worker is live: none has registered in 0.3 s" in str(unavailable.value)
        assert time.monotonic() - start < 10


def test_the_body_must_be_json_and_errors_keep_openais_shape(cluster: BackgroundCluster) -> None:
    front = cluster.router.http_front
    assert front is not None
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    with httpx2.Client(base_url=front.url, headers=headers) as http:
        for body, status in [(b"{not json", 400), (b"[1, 2]", 400), (b'{"prompt": "x"}', 400)]:
            response = http.post("/completions", content=body)
            assert response.status_code == status
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
        assert response.json()["error"]["param"] == "model"  # the last: no model
        assert http.get("/nowhere").json()["error"]["message"] == "Not Found"
        too_large = http.post("/completions", content=b" " * (17 << 20))
        assert too_large.status_code == 413


def test_a_body_not_declared_json_is_415_and_a_wrong_method_is_a_request_error(
    cluster: BackgroundCluster, model: str
) -> None:
    front = cluster.router.http_front
    assert front is not None
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2}).encode()
    with httpx2.Client(base_url=front.url, headers={"authorization": f"Bearer {TOKEN}"}) as http:
        for content_type in ["text/plain", "application/x-www-form-urlencoded"]:
            response = http.post(
                "/completions", content=body, headers={"content-type": content_type}
            )
            assert response.status_code == 415
            error = response.json()["error"]
            assert (error["type"], error["code"]) == (
                "invalid_request_error",
                "unsupported_media_type",
            )
            assert content_type in error["message"]
        # JSON, with a charset or as a +json type, or a body that declares no type, is read.
        for content_type in ["application/json; charset=utf-8", "application/vnd.api+json", None]:
            headers = {"content-type": content_type} if content_type else {}
            response = http.post("/completions", content=body, headers=headers)
            assert response.status_code == 200, response.text
        wrong_method = http.get("/completions")
        assert wrong_method.status_code == 405
        assert wrong_method.headers["allow"] == "POST"
        error = wrong_method.json()["error"]
        assert (error["type"], error["message"]) == ("invalid_request_error", "Method Not Allowed")


# -- the built-in model's answers without max_tokens -------------------------------------------


def test_a_chat_without_max_tokens_on_random_weights_gets_a_default_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvswitch.router.openai_http")
    with BackgroundCluster(1, ROUTER, WORKER) as cluster, openai_client(cluster) as client:
        create = client.chat.completions.with_raw_response.create
        for stream in (False, True):
            raw = create(model="kvswitch-tiny", messages=MESSAGES, stream=stream)
            assert raw.headers["x-kvswitch-default-max-tokens"] == "64"
            if stream:
                *_, last = raw.parse()
                assert last.choices[0].finish_reason == "length"
            else:
                chat = raw.parse()
                assert chat.usage is not None and chat.usage.completion_tokens == 64
                assert chat.choices[0].finish_reason == "length"
        asked = create(model="kvswitch-tiny", messages=MESSAGES, max_tokens=70)
        assert "x-kvswitch-default-max-tokens" not in asked.headers
        usage = asked.parse().usage
        assert usage is not None and usage.completion_tokens == 70
    said = [r.getMessage() for r in caplog.records if "random weights" in r.getMessage()]
    assert said == [
        "the model has random weights and seldom ends an answer: chat requests without "
        "max_tokens get 64 tokens (header x-kvswitch-default-max-tokens)"
    ]


# -- a checkpoint's chat template ---------------------------------------------------------------

CHECKPOINT_LIMIT = 80  # the checkpoint router's --max-output-tokens
WORDS = ["<s>", "</s>", "[UNK]", "[system]", "[user]", "[assistant]", "Be", "terse.", "Hello?"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def write_checkpoint(model_dir: Path, template: str | None) -> None:
    """A word-level tokenizer whose ids the built-in model takes (all below 257)."""
    model_dir.mkdir()
    tokenizer = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundCluster]:
    model_dir = tmp_path_factory.mktemp("checkpoint") / "model"
    write_checkpoint(model_dir, TEMPLATE)
    # NOTE: the router's limit bounds a chat without max_tokens: the workers' random weights
    # would fill the context.
    router = dataclasses.replace(ROUTER, model=str(model_dir), max_output_tokens=CHECKPOINT_LIMIT)
    with BackgroundCluster(1, router, WORKER) as cluster:
        yield cluster


def test_chat_uses_the_checkpoints_template(checkpoint: BackgroundCluster, tmp_path: Path) -> None:
    with openai_client(checkpoint) as client:
        (card,) = client.models.list().data
        chat = client.chat.completions.create(
            model=card.id, messages=MESSAGES, max_tokens=8, temperature=0
        )
    # "<s>[system] Be terse. </s> [user] Hello? </s> [assistant]", one id a word, BOS once.
    expected_ids = [0, 3, 6, 7, 1, 4, 8, 1, 5]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(expected_ids)
    with Client(checkpoint.address) as grpc_client:
        expected = grpc_client.generate(
            prompt_token_ids=expected_ids, max_tokens=8, temperature=0.0
        )
    assert chat.choices[0].message.content == expected.text
    # A checkpoint's answer without max_tokens runs as long as the router allows, not a default.
    with openai_client(checkpoint) as client:
        raw = client.chat.completions.with_raw_response.create(model=card.id, messages=MESSAGES)
    assert "x-kvswitch-default-max-tokens" not in raw.headers
    usage = raw.parse().usage
    assert usage is not None and usage.completion_tokens == CHECKPOINT_LIMIT
    # A router whose checkpoint has no template says why it cannot chat.
    bare_dir = tmp_path / "bare"
    write_checkpoint(bare_dir, None)
    config = dataclasses.replace(ROUTER, model=str(bare_dir), index=f"grpc://{checkpoint.address}")
    bare = checkpoint.run(start_router(config))
    try:
        front = bare.http_front
        assert front is not None
        with (
            openai.OpenAI(base_url=front.url, api_key="x", max_retries=0) as bare_client,
            pytest.raises(openai.BadRequestError, match="no chat template") as refused,
        ):
            bare_client.chat.completions.create(model=card.id, messages=MESSAGES)
        assert refused.value.param == "messages"
    finally:
        checkpoint.run(bare.stop(0))


def test_a_wait_ends_when_its_http_client_goes_away_and_only_then() -> None:
    """``until_disconnected``: the work is cancelled, and 499 raised, when the client's
    disconnect comes first; work that ends first is its answer, and the task is not cancelled
    after (by a disconnect that comes right then); a cancel from elsewhere stays a cancel."""
    import asyncio

    from starlette.requests import Request

    from kvswitch.router.openai_protocol import OpenAIError
    from kvswitch.router.openai_stream import until_disconnected

    def request(disconnected: asyncio.Event) -> Request:
        async def receive() -> dict:
            await disconnected.wait()
            return {"type": "http.disconnect"}

        return Request({"type": "http", "method": "POST", "headers": []}, receive)

    async def main() -> None:
        gone, cancelled = asyncio.Event(), asyncio.Event()

        async def work() -> int:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return 0

        asyncio.get_running_loop().call_soon(gone.set)
        with pytest.raises(OpenAIError) as left:
            await until_disconnected(request(gone), work())
        assert left.value.status == 499 and cancelled.is_set()
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

        # The work ends as the client goes: the answer stands, and nothing cancels this task.
        gone = asyncio.Event()

        async def quick() -> int:
            gone.set()
            await asyncio.sleep(0)  # NOTE: the watcher ends first, its callback runs after this
            return 7

        assert await until_disconnected(request(gone), quick()) == 7
        await asyncio.sleep(0.05)  # where a stray cancel would land

        # Cancelled from outside: a CancelledError, not the client's 499.
        task = asyncio.ensure_future(until_disconnected(request(asyncio.Event()), work()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
