"""A worker process serving LoRA adapters (``kvswitch worker --lora NAME=PATH``): requests name
them over gRPC, across the engine core's process boundary, and get what the engine gives."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.request import SamplingParams
from tests.worker.test_lora_serving import save_adapter


def test_a_worker_process_serves_each_request_its_adapter(tmp_path: Path) -> None:
    """Requests of two adapters and of the base, side by side, each get the in-process
    engine's greedy tokens for that adapter; a repeated prompt hits only its own adapter's
    blocks; an adapter the worker does not serve is refused, naming the ones it does."""
    paths = {
        "sql": save_adapter(tmp_path / "sql", seed=1),
        "chat": save_adapter(tmp_path / "chat", seed=2, rank=4, targets=("q_proj", "down_proj")),
    }
    specs = [f"{name}={path}" for name, path in paths.items()]
    worker, address = start_server_process(
        ["worker", "--port", "0", "--block-size", "4", "--max-loras", "2"]
        + [arg for spec in specs for arg in ("--lora", spec)]
    )
    engine = LLMEngine(EngineConfig(block_size=4, lora=tuple(specs), max_loras=2))
    prompt = np.random.default_rng(0).integers(0, 257, 30).tolist()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)

            def generate(lora: str) -> tuple[list[int], int]:
                request = worker_pb2.WorkerGenerateRequest(
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(max_tokens=6),
                    lora=lora,
                )
                responses = list(stub.Generate(request, timeout=60))
                tokens = [t for r in responses[:-1] for t in r.chunk.token_ids]
                return tokens, responses[-1].final.stats.num_cached_tokens

            served = {lora: generate(lora) for lora in ["sql", "", "chat"]}
            again = {lora: generate(lora) for lora in ["chat", "sql"]}
            with pytest.raises(grpc.RpcError) as refused:
                generate("law")
    finally:
        worker.terminate()
        worker.wait(30)
    for lora, (_, cached) in served.items():
        engine.add_request(lora or "base", prompt, SamplingParams(max_tokens=6), lora=lora or None)
        assert cached == 0
    expected: dict[str, list[int]] = {"sql": [], "base": [], "chat": []}
    while engine.has_unfinished():
        produced = engine.step()
        for request_id, token in zip(produced.request_ids, produced.token_ids, strict=True):
            expected[request_id].append(token)
    assert served["sql"][0] == expected["sql"] and served[""][0] == expected["base"]
    assert served["chat"][0] == expected["chat"]
    assert len({tuple(tokens) for tokens, _ in served.values()}) == 3
    assert again == {"chat": (served["chat"][0], 28), "sql": (served["sql"][0], 28)}
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown adapter 'law'; this worker serves these: chat, sql" in refused.value.details()
