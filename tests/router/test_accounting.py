"""What a routed request weighs on its worker in the router's eyes (in-flight load, the guess
that its blocks will be there) until it ends, and nothing once a worker refused it."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import grpc
import pytest

from kvswitch.client import Client, KvswitchError
from kvswitch.router.limits import MAX_UNKNOWN_OUTPUT_TOKENS, output_budget, output_charge
from tests.router.harness import WORKER_CONFIG, BackgroundCluster, paused_core, wait_until
from tests.router.test_disaggregation import guessed

DOCUMENT = [*b"A document long enough for a few blocks of its own. " * 2]  # 104 tokens


def assert_nothing_charged(cluster: BackgroundCluster) -> None:
    for handle in cluster.router.router.directory.handles():
        assert (handle.num_in_flight, handle.num_prefill_tokens, handle.num_output_tokens) == (
            0,
            0,
            0,
        ), handle.worker_id


def test_a_request_the_worker_refuses_as_invalid_leaves_no_guess() -> None:
    with BackgroundCluster(num_workers=1) as cluster:
        # NOTE: the router does not know the vocabulary; the worker refuses the last token.
        prompt = [256, 1, *DOCUMENT, 257]
        with (
            Client(cluster.address, max_retries=0) as client,
            pytest.raises(KvswitchError) as error,
        ):
            client.generate(prompt_token_ids=prompt, max_tokens=4, timeout_s=60)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "token id 257 is outside the vocabulary" in error.value.details
        assert guessed(cluster, prompt) == {}
        assert_nothing_charged(cluster)


def test_a_request_a_full_worker_refuses_leaves_no_guess() -> None:
    """The one worker takes one request at a time; a second one while it runs is refused
    (RESOURCE_EXHAUSTED): that one is not guessed to be there, the first one still is."""
    config = dataclasses.replace(WORKER_CONFIG, max_num_seqs=1, max_waiting_requests=0)
    with BackgroundCluster(num_workers=1, worker_config=config) as cluster:
        worker = cluster.workers[0]
        running_prompt, refused_prompt = [256, 1, *DOCUMENT], [256, 2, *DOCUMENT]
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            Client(cluster.address, max_retries=0) as client,
        ):
            with paused_core(worker):
                running = pool.submit(
                    client.generate, prompt_token_ids=running_prompt, max_tokens=4, timeout_s=120
                )
                wait_until(
                    lambda: worker.engine.num_requests == 1 or running.done(),
                    "the first request submitted",
                )
                with pytest.raises(KvswitchError) as error:
                    client.generate(prompt_token_ids=refused_prompt, max_tokens=4, timeout_s=60)
                assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert guessed(cluster, refused_prompt) == {}
                assert guessed(cluster, running_prompt) == {worker.worker_id: 6}
            assert len(running.result(timeout=120).token_ids) == 4
        assert_nothing_charged(cluster)


def test_a_worker_of_unknown_context_is_charged_a_bounded_output() -> None:
    """A worker that does not say its context (0) is charged at most
    ``MAX_UNKNOWN_OUTPUT_TOKENS``, not a client's max_tokens of up to 2^32 - 1; what the request
    may produce is not cut."""
    assert output_charge(2**32 - 1, 100, 0) == MAX_UNKNOWN_OUTPUT_TOKENS
    assert output_charge(8, 100, 0) == 8
    assert output_budget(2**32 - 1, 100, 0) == 2**32 - 1
    # A known context cuts both, as before.
    assert output_charge(2**32 - 1, 100, 4096) == output_budget(2**32 - 1, 100, 4096) == 3996
    assert output_charge(1000, 4095, 4096) == 1
