"""Logprobs, echoed prompts and embeddings through the public APIs (the router's HTTP API and the
gRPC SDK) of a router and a worker whose engine core runs in its own process, against a cold
full forward of transformers on the same checkpoint; a prompt whose prefix is cached is scored
from the worker's hidden-state cache, and says so in its usage."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx2
import numpy as np
import pytest
import torch

from kvswitch.client import Client
from tests.router.harness import ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster
from tests.router.test_openai_http import CHAT_PROMPT, MESSAGES
from tests.worker.hf_reference import save_checkpoint
from tests.worker.test_logprobs import BLOCK, TOL, hf_logprobs, prompt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("llama")
    return save_checkpoint(path, "llama"), path


@pytest.fixture(scope="module")
def cluster(checkpoint) -> Iterator[BackgroundCluster]:
    _, path = checkpoint
    router = dataclasses.replace(ROUTER_CONFIG, http_port=0, model=str(path))
    worker = dataclasses.replace(
        WORKER_CONFIG, model=str(path), block_size=BLOCK, cache_hidden_states=True
    )
    with BackgroundCluster(1, router, worker) as running:
        yield running


def post(cluster: BackgroundCluster, path: str, body: dict) -> dict:
    front = cluster.router.http_front
    assert front is not None
    response = httpx2.post(f"{front.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def model_name(cluster: BackgroundCluster) -> str:
    front = cluster.router.http_front
    assert front is not None
    (card,) = httpx2.get(f"{front.url}/models", timeout=10).json()["data"]
    return card["id"]


def token_of(text: str) -> int:
    assert text.startswith("token_id:"), text  # the checkpoint has no tokenizer
    return int(text.removeprefix("token_id:"))


def assert_columns_score(hf, token_ids: list[int], logprobs: dict, num_top: int) -> None:
    """The completions API's columns for ``token_ids`` (its first token unscored) are the
    model's."""
    want = hf_logprobs(hf, token_ids)
    assert [token_of(t) for t in logprobs["tokens"]] == token_ids
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(token_ids)):
        row = want[position - 1]
        assert logprobs["token_logprobs"][position] == pytest.approx(
            row[token_ids[position]].item(), abs=TOL
        )
        top = logprobs["top_logprobs"][position]
        # The most likely tokens and the prompt's own.
        assert token_ids[position] in {token_of(t) for t in top}
        assert len(top) in (num_top, num_top + 1)
        assert sorted(top.values(), reverse=True)[:num_top] == pytest.approx(
            row.topk(num_top).values.tolist(), abs=TOL
        )
    # Offsets count the characters of the tokens before.
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()


def test_echo_scores_the_prompt_cold_and_from_the_cached_prefix(checkpoint, cluster) -> None:
    hf, _ = checkpoint
    model = model_name(cluster)
    shared = prompt(1, 3 * BLOCK)
    for tail_seed, num_cached in ((2, 0), (3, 3 * BLOCK)):
        tokens = shared + prompt(tail_seed, 11)
        body = post(
            cluster,
            "/completions",
            {"model": model, "prompt": tokens, "echo": True, "logprobs": 2, "max_tokens": 0},
        )
        (choice,) = body["choices"]
        assert body["usage"]["completion_tokens"] == 0
        assert body["usage"]["prompt_tokens"] == len(tokens)
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": num_cached}
        assert_columns_score(hf, tokens, choice["logprobs"], 2)


def test_sampled_tokens_logprobs_streamed_and_whole(checkpoint, cluster) -> None:
    hf, _ = checkpoint
    model = model_name(cluster)
    tokens = prompt(4, 29)
    request = {"model": model, "prompt": tokens, "logprobs": 3, "max_tokens": 6, "temperature": 0}
    whole = post(cluster, "/completions", request)["choices"][0]["logprobs"]
    output = [token_of(t) for t in whole["tokens"]]
    assert len(output) == 6
    want = hf_logprobs(hf, tokens + output)
    for step, token_id in enumerate(output):
        row = want[len(tokens) - 1 + step]
        assert token_id == row.argmax().item()  # greedy
        assert whole["token_logprobs"][step] == pytest.approx(row[token_id].item(), abs=TOL)
        assert len(whole["top_logprobs"][step]) == 3
    # Streamed: each chunk has its tokens' logprobs, offsets running on.
    front = cluster.router.http_front
    assert front is not None
    columns: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with httpx2.stream(
        "POST", f"{front.url}/completions", json={**request, "stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            logprobs = json.loads(line.removeprefix("data: "))["choices"][0]["logprobs"]
            if logprobs is not None:
                for key in columns:
                    columns[key] += logprobs[key]
    assert columns["tokens"] == whole["tokens"]
    assert columns["text_offset"] == whole["text_offset"]
    assert columns["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-6)


def test_embeddings_pool_the_models_hidden_states(checkpoint, cluster) -> None:
    hf, _ = checkpoint
    model = model_name(cluster)
    inputs = [prompt(5, 2 * BLOCK + 3), prompt(6, 9)]
    with torch.no_grad():
        hidden = [
            hf(torch.tensor([x]), output_hidden_states=True).hidden_states[-1][0] for x in inputs
        ]
    for pooling in ("last", "mean"):
        body = post(cluster, "/embeddings", {"model": model, "input": inputs, "pooling": pooling})
        assert [d["index"] for d in body["data"]] == [0, 1]
        for got, states in zip(body["data"], hidden, strict=True):
            want = states[-1] if pooling == "last" else states.mean(dim=0)
            want = torch.nn.functional.normalize(want, dim=0)
            assert got["embedding"] == pytest.approx(want.tolist(), abs=TOL)
        assert body["usage"]["prompt_tokens"] == sum(map(len, inputs))
    # The second pass found the first input's two blocks cached, with their rows.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    packed = post(
        cluster,
        "/embeddings",
        {"model": model, "input": inputs[0], "encoding_format": "base64", "pooling": "mean"},
    )
    vector = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    assert vector.tolist() == pytest.approx(body["data"][0]["embedding"], abs=1e-6)


def test_the_sdk_gives_logprobs_prompt_logprobs_and_the_embedding(checkpoint, cluster) -> None:
    hf, _ = checkpoint
    tokens = prompt(7, 21)
    with Client(cluster.address) as client:
        result = client.generate(
            prompt_token_ids=tokens, max_tokens=3, logprobs=1, prompt_logprobs=0, pooling="last"
        )
    want = hf_logprobs(hf, tokens + result.token_ids)
    assert len(result.logprobs) == 3 and len(result.prompt_logprobs) == len(tokens) - 1
    for position, entry in enumerate(result.prompt_logprobs, start=1):
        assert entry.logprob == pytest.approx(want[position - 1, tokens[position]].item(), abs=TOL)
        assert entry.top_token_ids == ()
    for step, entry in enumerate(result.logprobs):
        assert entry.top_token_ids == (result.token_ids[step],)
        row = want[len(tokens) - 1 + step]
        assert entry.logprob == pytest.approx(row[result.token_ids[step]].item(), abs=TOL)
    with torch.no_grad():
        last = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert result.embedding == pytest.approx(
        torch.nn.functional.normalize(last, dim=0).tolist(), abs=TOL
    )


def test_bad_asks_are_refused_by_name(cluster) -> None:
    model = model_name(cluster)
    front = cluster.router.http_front
    assert front is not None
    cases = [
        ("/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ("/completions", {"prompt": [1, 2], "logprobs": 21}, "logprobs"),
        ("/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ("/embeddings", {"input": [], "pooling": "last"}, "input"),
        ("/embeddings", {"input": "x", "pooling": "cls"}, "pooling"),
        ("/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ]
    for path, body, param in cases:
        response = httpx2.post(f"{front.url}{path}", json={"model": model, **body}, timeout=10)
        assert response.status_code == 400, (path, body, response.text)
        assert param in response.json()["error"]["message"], response.text


def test_chat_logprobs_are_the_completions_of_the_rendered_conversation() -> None:
    """The built-in model (a byte tokenizer, a chat template): a chat answer's logprobs, in the
    chat shape, are those of a completion of the conversation as the template renders it."""
    router = dataclasses.replace(ROUTER_CONFIG, http_port=0)
    worker = dataclasses.replace(WORKER_CONFIG, engine_in_process=True)
    with BackgroundCluster(1, router, worker) as builtin:
        model = model_name(builtin)
        asked = {"model": model, "max_tokens": 5, "temperature": 0}
        chat = post(
            builtin,
            "/chat/completions",
            {**asked, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2},
        )["choices"][0]
        plain = post(builtin, "/completions", {**asked, "prompt": CHAT_PROMPT, "logprobs": 2})
    columns = plain["choices"][0]["logprobs"]
    content = chat["logprobs"]["content"]
    # A token's bytes may be part of a character: they, not the tokens' texts, make the answer.
    answer = b"".join(bytes(c["bytes"]) for c in content)
    assert answer.decode("utf-8", errors="replace") == chat["message"]["content"]
    for c in content:
        shown = bytes(c["bytes"]).decode("utf-8", errors="ignore") or "bytes:"
        assert c["token"].startswith(shown) or c["token"].startswith("bytes:\\x")
    assert [c["token"] for c in content] == columns["tokens"]
    assert [c["logprob"] for c in content] == pytest.approx(columns["token_logprobs"], abs=1e-5)
    for entry, top in zip(content, columns["top_logprobs"], strict=True):
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the most likely
        assert {t["token"]: t["logprob"] for t in entry["top_logprobs"]} == pytest.approx(
            {k: v for k, v in top.items() if k in {t["token"] for t in entry["top_logprobs"]}},
            abs=1e-5,
        )
