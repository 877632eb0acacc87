"""Text exact where a stream changes worker, with a real byte-level BPE tokenizer: its tokens end
inside characters, so a worker holds back the text of its last tokens, and the worker that goes
on with the stream (the decode side of a disaggregated prefill, a stream resumed after a failure)
must send it. Streamed text, whole text and the tokenizer's decode of the output ids agree, over
gRPC and over the OpenAI HTTP API.

The checkpoint (``tests/cjk_checkpoint.py``) answers every prompt ending in ``CUE`` with the same
tokens, so each handoff lands where the test wants it: inside 问 at the prefill worker's first
token, inside 什 or 🚀 where a worker fails."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from kvswitch.client import Client
from kvswitch.tokenizer import REPLACEMENT_CHAR
from kvswitch.worker.model_runner import ModelRunner
from tests.cjk_checkpoint import ANSWER, CUE, CjkCheckpoint, write_checkpoint
from tests.router.harness import ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster

# NOTE: engines on threads of this process: a test makes one fail at a token of its choosing.
WORKER = dataclasses.replace(WORKER_CONFIG, engine_in_process=True)
MAX_TOKENS = 32  # more than the answer: it ends at EOS


def prompt(i: int) -> str:
    # NOTE: each prompt its own, so none finds its blocks cached on the decode worker.
    return f"Question {i}: what is it?\nanswer{CUE}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CjkCheckpoint:
    return write_checkpoint(tmp_path_factory.mktemp("cjk") / "model")


def cluster_of(checkpoint: CjkCheckpoint, **router: object) -> BackgroundCluster:
    model = str(checkpoint.model_dir)
    config = dataclasses.replace(ROUTER_CONFIG, model=model, **router)
    return BackgroundCluster(0, config, dataclasses.replace(WORKER, model=model))


@pytest.fixture(scope="module")
def disaggregated(checkpoint: CjkCheckpoint) -> Iterator[BackgroundCluster]:
    """A prefill worker and a decode worker; every prompt is prefilled on the prefill worker."""
    with cluster_of(checkpoint, min_remote_prefill_tokens=0, http_port=0) as cluster:
        cluster.add_worker("p0", role="prefill")
        cluster.add_worker("d0", role="decode")
        yield cluster


def streamed(client: Client, text: str, **options: object) -> tuple[str, object]:
    """The text of a stream's chunks, joined, and the stream's result."""
    with client.stream(text, **options) as stream:
        pieces = [chunk.text for chunk in stream]
        return "".join(pieces), stream.result


def test_a_prefill_handoff_inside_a_character_loses_none_of_it(
    disaggregated: BackgroundCluster, checkpoint: CjkCheckpoint
) -> None:
    """The prefill worker's one token is half of 问: it holds the text back, and the decode
    worker, whose prompt ends with that token, sends 问 whole."""
    with Client(disaggregated.address, timeout_s=60) as client:
        text, result = streamed(client, prompt(1), max_tokens=MAX_TOKENS)
        whole = client.generate(prompt(2), max_tokens=MAX_TOKENS)
    for one in (result, whole):
        assert one.token_ids == [*checkpoint.answer_ids, checkpoint.eos_token_id]
        assert (one.stats.prefill_worker_id, one.stats.decode_worker_id) == ("p0", "d0")
    assert text == result.text == whole.text == checkpoint.tokenizer.decode(result.token_ids)
    assert text == ANSWER


def test_a_one_token_answer_from_the_prefill_worker_ends_its_text(
    disaggregated: BackgroundCluster, checkpoint: CjkCheckpoint
) -> None:
    """Nothing follows the prefill worker's half character: its text is U+FFFD, as the
    tokenizer decodes it, not nothing."""
    with Client(disaggregated.address, timeout_s=60) as client:
        text, result = streamed(client, prompt(3), max_tokens=1)
    assert result.token_ids == checkpoint.answer_ids[:1]
    assert result.stats.prefill_worker_id == "p0"
    assert text == result.text == checkpoint.tokenizer.decode(result.token_ids)
    assert text == REPLACEMENT_CHAR


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_http_api_streams_the_text_of_a_disaggregated_answer_whole(
    disaggregated: BackgroundCluster, checkpoint: CjkCheckpoint, kind: str
) -> None:
    front = disaggregated.router.http_front
    assert front is not None
    question = iter(range(100, 200))

    def create(**options: object):
        if kind == "chat":
            messages = [{"role": "user", "content": f"question {next(question)}"}]
            return client.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **options
            )
        return client.completions.with_raw_response.create(
            model=model,
            prompt=prompt(next(question)),
            max_tokens=MAX_TOKENS,
            temperature=0,
            **options,
        )

    with openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0) as client:
        (card,) = client.models.list().data
        model = card.id
        whole_raw = create()
        stream_raw = create(stream=True)
        # The stream names the worker of its first token, the whole answer its decode worker.
        workers = stream_raw.headers["x-kvswitch-worker"], whole_raw.headers["x-kvswitch-worker"]
        assert workers == ("p0", "d0")
        whole, chunks = whole_raw.parse(), list(stream_raw.parse())
    if kind == "chat":
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole_text = whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        whole_text = whole.choices[0].text
    expected = checkpoint.tokenizer.decode([*checkpoint.answer_ids, checkpoint.eos_token_id])
    assert text == whole_text == expected == ANSWER
    assert whole.usage is not None
    assert whole.usage.completion_tokens == len(checkpoint.answer_ids) + 1  # and EOS


class HeldAfter:
    """Holds the first engine step that computes ``token_id`` (the step after the one that
    sampled it) until the test has seen that token arrive (``seen``); then the step raises, as an
    engine whose device failed mid-stream does (``fail``), or waits for ``released``, so that the
    test can stop the worker's server with the token's text still held back there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, token_id: int, *, fail: bool) -> None:
        self.seen = threading.Event()
        self.released = threading.Event()
        self.held = threading.Event()
        execute_batch = ModelRunner.execute_batch

        def held(runner: ModelRunner, batch, *args, **kwargs):
            if not self.held.is_set() and token_id in np.asarray(batch.input_ids):
                self.held.set()
                # NOTE: bounds for a hang; the test sets each as soon as it can.
                if not self.seen.wait(timeout=60):
                    raise RuntimeError("injected: the test never saw the token")
                if fail:
                    raise RuntimeError(f"injected: the step after token {token_id} failed")
                self.released.wait(timeout=60)
            return execute_batch(runner, batch, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "execute_batch", held)


@pytest.mark.parametrize("how", ["its-engine-fails", "its-server-stops"])
@pytest.mark.parametrize(
    ("num_before", "what"),
    [(1, "inside 问"), (6, "after 是, inside 什"), (15, "inside 🚀")],
    ids=["first-character", "a-whole-character-held-too", "emoji"],
)
def test_a_stream_resumed_inside_a_character_loses_and_repeats_none_of_it(
    checkpoint: CjkCheckpoint,
    monkeypatch: pytest.MonkeyPatch,
    num_before: int,
    what: str,
    how: str,
) -> None:
    """A worker fails once the client has the answer's first ``num_before`` tokens, the last of
    them inside a character; the router resumes the stream on the other worker, which sends the
    text the failed one held back."""
    answer_ids = checkpoint.answer_ids
    decode = checkpoint.tokenizer.decode
    assert decode(answer_ids[:num_before]).endswith(REPLACEMENT_CHAR), what
    last_id = answer_ids[num_before - 1]
    fault = HeldAfter(monkeypatch, last_id, fail=how == "its-engine-fails")
    with cluster_of(checkpoint) as cluster:
        cluster.add_worker("w0")
        cluster.add_worker("w1")
        directory = cluster.router.router.directory
        with Client(cluster.address, timeout_s=60) as client:
            pieces, token_ids = [], []
            with client.stream(prompt(num_before), max_tokens=MAX_TOKENS) as stream:
                for chunk in stream:
                    pieces.append(chunk.text)
                    token_ids += chunk.token_ids
                    if last_id not in chunk.token_ids:
                        continue
                    if how == "its-server-stops":
                        (busy,) = [h.worker_id for h in directory.handles() if h.num_in_flight]
                        # NOTE: its streams cut, as when its process dies; its engine is let go
                        # after, and stopped with the cluster.
                        cluster.run(cluster.worker(busy).server.stop(0))
                    fault.seen.set()
                    fault.released.set()
                result = stream.result
    assert fault.held.is_set()
    assert result.route.reason.startswith("failover: ")
    assert token_ids == result.token_ids == [*answer_ids, checkpoint.eos_token_id]
    assert "".join(pieces) == result.text == decode(result.token_ids) == ANSWER
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
