"""LoRA adapters served by the engine: in the model's projections, several in one step, in the
block hash, and in slots that the scheduler never oversubscribes (``worker/lora.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.lora import (
    MODULES,
    LoraFormatError,
    LoraManager,
    LoraSlots,
    load_lora_adapter,
    module_shapes,
)
from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.model_runner import ModelRunner, ScheduledSeq
from kvswitch.worker.request import SamplingParams
from kvswitch.worker.weights import load_model

CONFIG = ModelConfig.tiny()
BLOCK_SIZE = 4


def save_adapter(
    folder: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = MODULES,
    config: ModelConfig = CONFIG,
) -> Path:
    """A random adapter for ``config``'s model as PEFT saves one (B not zero, unlike PEFT's
    initial one: the adapter must change the output)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    shapes = module_shapes(config)
    for layer in range(config.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator)
            weights[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(
                fan_out, rank, generator=generator
            )
    folder.mkdir(parents=True)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none"}
    settings["target_modules"] = list(targets)
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    save_file(weights, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, Path]:
    return {
        "sql": save_adapter(tmp_path / "sql", seed=1),
        "chat": save_adapter(tmp_path / "chat", seed=2, rank=4, targets=("q_proj", "down_proj")),
        "math": save_adapter(tmp_path / "math", seed=3, rank=2, targets=("v_proj", "up_proj")),
    }


def _merged(adapter_path: Path) -> torch.nn.Module:
    """The base model with the adapter merged into its weights: W + scaling * B @ A."""
    model = load_model(None)
    adapter = load_lora_adapter("merged", adapter_path)
    with torch.no_grad():
        for (layer, module), (a, b) in adapter.weights.items():
            decoder = model.model.layers[layer]
            part = decoder.mlp if module in ("gate_proj", "up_proj", "down_proj") else decoder
            part = decoder.self_attn if part is decoder else part
            getattr(part, module).weight.add_(adapter.scaling * (b @ a))
    return model


def test_an_adapter_in_a_slot_gives_the_logits_of_its_weights_merged(
    adapters: dict[str, Path],
) -> None:
    """Every module targeted, rank below the slots': the step's tokens of slot 1 get the
    logits of the base model with that adapter merged, prefill and a cached-context step."""
    runner = ModelRunner(load_model(None), 32, BLOCK_SIZE)
    slots = LoraSlots(CONFIG, max_loras=3, max_rank=16, device="cpu", dtype=torch.float32)
    slots.load(1, load_lora_adapter("sql", adapters["sql"]))
    runner.attach_loras(slots)
    merged = ModelRunner(_merged(adapters["sql"]), 32, BLOCK_SIZE)
    base = ModelRunner(load_model(None), 32, BLOCK_SIZE)
    prompt = list(range(3, 40))
    steps = [ScheduledSeq(prompt[:30], 0, range(1, 9)), ScheduledSeq(prompt[30:], 30, range(1, 11))]
    for step in steps:
        want = merged.execute([step], every_token=True)
        batch = _batch(runner, step, slot=1)
        got = runner.execute_batch(batch, every_token=True)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        plain = base.execute([step], every_token=True)
        assert (got - plain).abs().max() > 1e-2  # the adapter changes the output
    assert slots.slot_of_token is None  # set for the step only


def test_the_model_through_the_kernels_matches_the_references(
    adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapters' CUDA path on CPU tensors (kernels.lora through Triton's interpreter, into
    the fused projections' slices) gives the logits of the torch reference's path."""
    slots = LoraSlots(CONFIG, max_loras=2, max_rank=8, device="cpu", dtype=torch.float32)
    slots.load(0, load_lora_adapter("chat", adapters["chat"]))
    slots.load(1, load_lora_adapter("sql", adapters["sql"]))
    step = ScheduledSeq(list(range(3, 9)), 0, range(1, 3))
    logits = {}
    for path in ("reference", "kernel"):
        if path == "kernel":
            monkeypatch.setattr("kvswitch.worker.lora.use_triton", lambda device: True)
        runner = ModelRunner(load_model(None), 8, BLOCK_SIZE)
        runner.attach_loras(slots)
        batch = _batch(runner, step, slot=0)
        batch.lora_slots = np.array([0, 0, -1, 1, 1, 0])
        logits[path] = runner.execute_batch(batch, every_token=True)
    torch.testing.assert_close(logits["kernel"], logits["reference"], atol=1e-4, rtol=1e-4)


def _batch(runner: ModelRunner, seq: ScheduledSeq, slot: int):
    from kvswitch.worker.model_runner import StepBatch

    table = np.zeros((1, len(seq.block_ids)), np.int32)
    table[0] = list(seq.block_ids)
    return StepBatch(
        input_ids=np.array(seq.token_ids, np.int64),
        start_pos=np.array([seq.start_pos]),
        num_new=np.array([len(seq.token_ids)]),
        block_tables=table,
        lora_slots=np.full(len(seq.token_ids), slot, np.int64),
    )


def _engine(adapters: dict[str, Path], **options) -> LLMEngine:
    loras = tuple(f"{name}={path}" for name, path in adapters.items())
    return LLMEngine(
        EngineConfig(block_size=BLOCK_SIZE, kv_cache_bytes=8 << 20, lora=loras, **options)
    )


def _generate(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]) -> dict:
    """Greedy outputs of ``requests`` (id -> (prompt, adapter)), all queued at once."""
    outputs: dict[str, list[int]] = {request_id: [] for request_id in requests}
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=8), lora=lora)
    while engine.has_unfinished():
        produced = engine.step()
        for request_id, token in zip(produced.request_ids, produced.token_ids, strict=True):
            outputs[request_id].append(token)
    return outputs


def test_a_step_mixing_adapters_and_the_base_gives_each_its_output_alone(
    adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Four adapters and the base in one batch: each request's tokens are those it gets alone."""
    adapters = {**adapters, "code": save_adapter(tmp_path / "code", seed=4, rank=16)}
    rng = np.random.default_rng(0)
    requests = {
        f"r{i}": (rng.integers(0, 257, int(rng.integers(5, 30))).tolist(), lora)
        for i, lora in enumerate(["sql", None, "chat", "math", "code", None, "sql", "code"])
    }
    together = _generate(_engine(adapters), requests)
    for request_id, request in requests.items():
        alone = _generate(_engine(adapters), {request_id: request})
        assert alone[request_id] == together[request_id], request_id
    # The adapters matter: the same prompt under each gives different outputs.
    prompt = requests["r0"][0]
    outputs = {
        lora: _generate(_engine(adapters), {"x": (prompt, lora)})["x"]
        for lora in ["sql", "chat", "math", "code", None]
    }
    assert len({tuple(o) for o in outputs.values()}) == 5


def test_two_adapters_never_share_a_cached_block(adapters: dict[str, Path]) -> None:
    """The same prompt under the base, then adapters: no hit across them, a hit within one
    (its first 7 of 8 blocks: the last token is always computed)."""
    engine = _engine(adapters)
    prompt = list(range(10, 42))
    cached = []
    for i, lora in enumerate([None, "sql", "chat", "sql", None, "chat"]):
        request = engine.make_request(f"r{i}", prompt, SamplingParams(max_tokens=1), lora=lora)
        engine.add(request)
        while engine.has_unfinished():
            engine.step()
        cached.append(request.num_cached_tokens)
    assert cached == [0, 0, 0, 28, 28, 28]


def test_unknown_adapters_are_refused_naming_the_served_ones(adapters: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="unknown adapter 'law'; this worker serves these: chat"):
        _engine(adapters).add_request("r", [1, 2, 3], SamplingParams(), lora="law")
    with pytest.raises(ValueError, match="unknown adapter 'sql'; this worker serves none"):
        LLMEngine(EngineConfig()).add_request("r", [1, 2, 3], SamplingParams(), lora="sql")
    for bad in (("sql",), ("=x",), ("sql=",), ("a=x", "a=y")):
        with pytest.raises(ValueError, match=r"lora takes NAME=PATH|lora names a twice"):
            EngineConfig(lora=bad)


def test_steps_use_at_most_max_loras_adapters_and_reload_evicted_ones(
    adapters: dict[str, Path],
) -> None:
    """Two slots, three adapters, requests of all three and the base queued at once: no step
    uses more than two adapters, every request finishes with its output alone, and an adapter
    evicted from its slot comes back from host memory, not disk."""
    engine = _engine(adapters, max_loras=2)
    rng = np.random.default_rng(1)
    loras = ["sql", "chat", "math", None, "math", "sql", "chat", None]
    requests = {f"r{i}": (rng.integers(0, 257, 12).tolist(), lora) for i, lora in enumerate(loras)}
    per_step = []
    original = engine.runner.execute_batch

    def execute(batch, **options):
        if batch.lora_slots is not None:
            names = {engine.loras.slots.names[s] for s in batch.lora_slots.tolist() if s >= 0}
            per_step.append(names)
        return original(batch, **options)

    engine.runner.execute_batch = execute
    outputs = _generate(engine, requests)
    assert all(len(o) == 8 for o in outputs.values())
    assert per_step and max(len(names) for names in per_step) <= 2
    assert set().union(*per_step) == {"sql", "chat", "math"}
    manager = engine.loras
    assert manager.num_slot_loads >= 3 and manager.num_disk_loads == 0
    for request_id in ["r2", "r6"]:
        assert _generate(_engine(adapters), {request_id: requests[request_id]}) == {
            request_id: outputs[request_id]
        }


def test_the_manager_keeps_slots_and_host_copies_least_recently_used_first(
    adapters: dict[str, Path],
) -> None:
    slots = LoraSlots(CONFIG, max_loras=2, max_rank=8, device="cpu", dtype=torch.float32)
    paths = {name: str(path) for name, path in adapters.items()}
    manager = LoraManager(slots, paths, max_cpu_loras=2)
    assert manager.names == ["chat", "math", "sql"]
    assert manager.in_host_memory == ["chat", "math"]  # sql, read first, dropped
    assert manager.slots_for({"chat"}) == {"chat": 0}
    assert manager.slots_for({"math"}) == {"math": 1}
    assert manager.num_disk_loads == 0  # both from host memory
    # sql from its folder, into chat's slot (the least recently used); chat leaves host memory.
    assert manager.slots_for({"sql"}) == {"sql": 0}
    assert manager.num_disk_loads == 1 and manager.in_host_memory == ["math", "sql"]
    assert manager.slots_for({"chat", "math"}) == {"chat": 0, "math": 1}
    assert manager.num_disk_loads == 2 and slots.names == ["chat", "math"]
    assert manager.num_slot_loads == 4
    with pytest.raises(ValueError, match="a step uses 3 adapters; --max-loras is 2"):
        manager.slots_for({"sql", "chat", "math"})
    with pytest.raises(ValueError, match="already loaded"):
        manager.register("sql", paths["sql"])
    manager.unregister("chat")
    assert slots.names == [None, "math"] and not manager.knows("chat")
    with pytest.raises(ValueError, match="must be at least max_loras"):
        LoraManager(slots, {}, max_cpu_loras=1)
    # An adapter above the slots' rank, or shaped for another model, is refused on loading.
    with pytest.raises(LoraFormatError, match="rank 8 is above --max-lora-rank 4"):
        LoraManager(
            LoraSlots(CONFIG, max_loras=1, max_rank=4, device="cpu", dtype=torch.float32),
            {"sql": paths["sql"]},
        )
    other = ModelConfig.random_preset("tiny-long")
    wide = save_adapter(Path(paths["sql"]).parent / "wide", seed=4, config=_wider(other))
    with pytest.raises(LoraFormatError, match="does not fit this model"):
        manager.register("wide", str(wide))


def _wider(config: ModelConfig) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, intermediate_size=config.intermediate_size * 2)
