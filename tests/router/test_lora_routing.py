"""A router in front of workers serving different LoRA adapters: a request naming an adapter
goes only where it is served, and among those where it is loaded already; one naming an
adapter nobody serves is refused by name, over gRPC (NOT_FOUND) and over the OpenAI API (404
``model_not_found``, the adapter named by ``model``), whose ``/v1/models`` lists the adapters
with the model they adapt as ``parent``."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path

import grpc
import httpx2
import numpy as np
import openai
import pytest

from kvswitch.client import Client, KvswitchError
from kvswitch.router.server import RouterServer
from kvswitch.router.workers import WorkerHandle
from kvswitch.v1 import worker_pb2, worker_pb2_grpc
from tests.router.harness import (
    ROUTER_CONFIG,
    WORKER_CONFIG,
    BackgroundCluster,
    paused_core,
    wait_until,
)
from tests.worker.test_lora_serving import save_adapter

WORKER = dataclasses.replace(WORKER_CONFIG, engine_in_process=True, max_loras=1)


def prompts(num: int, seed: int) -> list[list[int]]:
    """``num`` prompts of the built-in model's byte tokens that share no block."""
    rng = np.random.default_rng(seed)
    return [[256, *rng.integers(0, 256, 40).tolist()] for _ in range(num)]


def handle(router: RouterServer, worker_id: str) -> WorkerHandle:
    return next(h for h in router.router.directory.handles() if h.worker_id == worker_id)


def reports_loaded(router: RouterServer, worker_id: str, lora: str) -> None:
    """Until the router has a load report of ``worker_id`` with ``lora`` in a slot."""
    worker = handle(router, worker_id)
    wait_until(
        lambda: worker.load is not None and lora in worker.load.loaded_loras,
        f"{worker_id} reports {lora} loaded",
    )


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: f"{name}={save_adapter(folder / name, seed=i)}" for i, name in enumerate("abc")}


def test_a_request_goes_where_its_adapter_is_served(adapters: dict[str, str]) -> None:
    router = dataclasses.replace(ROUTER_CONFIG, http_port=0)
    with BackgroundCluster(0, router, WORKER) as cluster:
        cluster.add_worker("w0", lora=(adapters["a"],))
        cluster.add_worker("w1", lora=(adapters["b"], adapters["c"]))
        with Client(cluster.address) as client:
            went = {
                lora: {
                    client.generate(prompt_token_ids=p, max_tokens=2, lora=lora).stats.worker_id
                    for p in prompts(4, seed=i)
                }
                for i, lora in enumerate(["a", "b", "c"])
            }
            with pytest.raises(KvswitchError) as unknown:
                client.generate(prompt_token_ids=prompts(1, seed=9)[0], max_tokens=2, lora="law")
        assert went == {"a": {"w0"}, "b": {"w1"}, "c": {"w1"}}
        assert unknown.value.code is grpc.StatusCode.NOT_FOUND
        assert "no live worker serves the adapter 'law'; adapters served: a, b, c" in str(
            unknown.value
        )
        # What the workers report: the adapters served, in a slot, in host memory, free slots.
        with grpc.insecure_channel(cluster.worker("w1").address) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())
        assert (list(load.loras), len(load.loaded_loras), load.num_free_lora_slots) == (
            ["b", "c"],
            1,
            0,
        )
        assert list(load.cpu_loras) == ["b", "c"]

        front = cluster.router.http_front
        assert front is not None
        with openai.OpenAI(base_url=front.url, api_key="-", max_retries=0) as api:
            cards = {card.id: getattr(card, "parent", None) for card in api.models.list().data}
            assert cards == {
                "kvswitch-tiny": None,
                "a": "kvswitch-tiny",
                "b": "kvswitch-tiny",
                "c": "kvswitch-tiny",
            }
            completion = api.completions.create(
                model="b",
                prompt=prompts(1, 3)[0],
                max_tokens=4,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            with pytest.raises(openai.NotFoundError) as not_found:
                api.completions.create(model="law", prompt="Hello", max_tokens=2)
            with pytest.raises(openai.BadRequestError) as both:
                api.completions.create(
                    model="b", prompt="Hello", max_tokens=2, extra_body={"lora": "c"}
                )
        # The adapter the model names ran: the same tokens as the SDK's request naming it.
        with Client(cluster.address) as client:
            named = client.generate(prompt_token_ids=prompts(1, 3)[0], max_tokens=4, lora="b")
            base = client.generate(prompt_token_ids=prompts(1, 3)[0], max_tokens=4)
        assert completion.choices[0].token_ids == named.token_ids != base.token_ids  # type: ignore[attr-defined]
        assert not_found.value.body["code"] == "model_not_found"  # type: ignore[index]
        assert both.value.body["param"] == "lora"  # type: ignore[index]


def test_a_request_goes_where_its_adapter_is_loaded(adapters: dict[str, str]) -> None:
    """Two workers serve two adapters with one device slot each: the router keeps each adapter
    on the worker that loaded it first, so no slot is loaded twice; without the affinity
    (``lora_load_tokens`` 0) requests alternate and the slots thrash."""
    lora = (adapters["a"], adapters["b"])
    slot_loads = {}
    for lora_load_tokens in (256.0, 0.0):
        router = dataclasses.replace(ROUTER_CONFIG, lora_load_tokens=lora_load_tokens)
        with BackgroundCluster(0, router, dataclasses.replace(WORKER, lora=lora)) as cluster:
            cluster.add_worker("w0")
            cluster.add_worker("w1")
            with Client(cluster.address) as client:
                for i, name in enumerate("aabbaabb"):
                    result = client.generate(
                        prompt_token_ids=prompts(1, seed=i)[0], max_tokens=2, lora=name
                    )
                    # NOTE: the next request is routed on the load report that says the adapter
                    # is in the slot now.
                    reports_loaded(cluster.router, result.stats.worker_id, name)
            slot_loads[lora_load_tokens] = sum(
                w.engine.counters.num_lora_slot_loads for w in cluster.workers
            )
    assert slot_loads[256.0] == 2
    assert slot_loads[0.0] > 2


def test_adapters_load_and_unload_at_run_time(adapters: dict[str, str], tmp_path: Path) -> None:
    """``--lora-updates``: POST /v1/load_lora_adapter puts an adapter on every worker (started
    with --enable-lora and none), whose requests then run under it; a folder that holds no
    adapter is refused by name; an unload waits for nothing: while a request of the adapter is
    in the engine, it is refused (409) and the adapter still serves, then it goes."""
    router = dataclasses.replace(ROUTER_CONFIG, http_port=0, lora_updates=True)
    # NOTE: the engine core in a process of its own, so that a test can hold it still.
    worker = dataclasses.replace(WORKER_CONFIG, enable_lora=True)
    name, _, path = adapters["a"].partition("=")
    with BackgroundCluster(2, router, worker) as cluster:
        front = cluster.router.http_front
        assert front is not None
        with httpx2.Client(base_url=front.url, timeout=60) as http:

            def post(endpoint: str, **body: str) -> httpx2.Response:
                return http.post(f"/{endpoint}_lora_adapter", json=body)

            models = http.get("/models")
            assert [c["id"] for c in models.json()["data"]] == ["kvswitch-tiny"], models.text
            loaded = post("load", lora_name=name, lora_path=path)
            assert loaded.status_code == 200, loaded.text
            assert sorted(loaded.json()["workers"]) == ["w0", "w1"]
            cards = http.get("/models").json()["data"]
            assert {c["id"]: c.get("parent") for c in cards} == {
                "kvswitch-tiny": None,
                name: "kvswitch-tiny",
            }
            (tmp_path / "empty").mkdir()
            bad = post("load", lora_name="b", lora_path=str(tmp_path / "empty"))
            assert bad.status_code == 400
            assert "holds no adapter_config.json" in bad.json()["error"]["message"]

            with Client(cluster.address) as client:
                prompt = prompts(1, seed=5)[0]
                adapted = client.generate(prompt_token_ids=prompt, max_tokens=4, lora=name)
                base = client.generate(prompt_token_ids=prompt, max_tokens=4)
                assert adapted.token_ids != base.token_ids
                holder = cluster.worker(adapted.stats.worker_id)
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    with paused_core(holder):
                        running = pool.submit(
                            client.generate, prompt_token_ids=prompt, max_tokens=4, lora=name
                        )
                        wait_until(
                            lambda: holder.engine.num_requests == 1 or running.done(),
                            "the adapter's request submitted",
                        )
                        # Answered once the core takes the unload, after the request.
                        unloading = pool.submit(post, "unload", lora_name=name)
                        wait_until(
                            lambda: holder.engine.num_calls == 1 or unloading.done(),
                            "the unload sent to the engine core",
                        )
                    refused = unloading.result(timeout=60)
                    assert running.result(timeout=60).token_ids == adapted.token_ids
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert (error["code"], error["param"]) == ("adapter_in_use", "lora_name")
            assert "has 1 request(s) running or waiting" in error["message"]
            # The worker that refused still serves it; a second unload takes it.
            assert name in [c["id"] for c in http.get("/models").json()["data"]]
            unloaded = post("unload", lora_name=name)
            assert unloaded.status_code == 200, unloaded.text
            assert [c["id"] for c in http.get("/models").json()["data"]] == ["kvswitch-tiny"]
            gone = post("unload", lora_name=name)
            assert (gone.status_code, gone.json()["error"]["code"]) == (404, "model_not_found")
        with Client(cluster.address) as client, pytest.raises(KvswitchError) as unknown:
            client.generate(prompt_token_ids=prompt, max_tokens=4, lora=name)
        assert unknown.value.code is grpc.StatusCode.NOT_FOUND


def test_runtime_adapter_loading_is_off_unless_asked() -> None:
    with BackgroundCluster(1, dataclasses.replace(ROUTER_CONFIG, http_port=0), WORKER) as cluster:
        front = cluster.router.http_front
        assert front is not None
        answer = httpx2.post(
            f"{front.url}/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}
        )
    assert answer.status_code == 403
    assert "--lora-updates" in answer.json()["error"]["message"]
