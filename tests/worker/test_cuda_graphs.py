"""Decode steps from static, padded inputs (the CUDA-graph path) and the one-copy input upload.

On a CPU the graphs' buffers and padding run the model eagerly: every step must give the logits
of the plain path and write the KV cache exactly where the plain path does. On a GPU (``-m gpu``)
the captured graphs must serve the same tokens as the engine without them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvswitch.worker.cuda_graphs import (
    DecodeGraphs,
    PrefillGraphs,
    SequenceGraphs,
    capture_sizes,
    graph_memory_bytes,
    prefill_capture_sizes,
)
from kvswitch.worker.engine import EngineConfig, LLMEngine, kv_cache_budget_bytes
from kvswitch.worker.model import CausalLM
from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.model_runner import ModelRunner, StepBatch
from kvswitch.worker.request import SamplingParams
from kvswitch.worker.step_inputs import InputStager
from tests.kernels.paged_case import gpu_test

BLOCK_SIZE = 4
NUM_BLOCKS = 160


def test_capture_sizes_pad_a_step_by_at_most_seven_rows() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = capture_sizes(256)
    for n in range(1, 257):
        assert 0 <= min(s for s in sizes if s >= n) - n <= 7
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_prefill_capture_sizes_double_up_to_the_step_limit() -> None:
    assert prefill_capture_sizes(2048) == [16, 32, 64, 128, 256, 512]
    assert prefill_capture_sizes(100) == [16, 32, 64, 100]
    assert prefill_capture_sizes(16) == [16]
    assert prefill_capture_sizes(5) == [5]
    with pytest.raises(ValueError, match="max_num_tokens"):
        prefill_capture_sizes(0)


def test_graph_memory_is_counted_once_and_set_aside_before_the_kv_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode graphs' fp32 logits are one buffer, not one per batch size (2 GiB at 256
    sequences and a 128K vocabulary), and the estimate comes off the free memory that the KV
    cache's fraction is taken of."""
    config = ModelConfig.random_preset("llama-1b")
    estimate = graph_memory_bytes(
        config,
        2,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=131072,
        block_size=16,
    )
    logits_once = 256 * config.vocab_size * 4
    # Per batch size they would be 4,231 rows' worth, 33 times one buffer.
    assert logits_once < estimate < 8 * logits_once
    more_seqs = graph_memory_bytes(
        config,
        2,
        max_num_seqs=512,
        max_num_batched_tokens=2048,
        max_model_len=131072,
        block_size=16,
    )
    assert more_seqs > estimate + logits_once
    free = 80 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, free))
    engine_config = EngineConfig(device="cuda", gpu_memory_fraction=0.5, cuda_graphs=True)
    assert kv_cache_budget_bytes(engine_config, estimate) == (free - estimate) // 2
    assert kv_cache_budget_bytes(engine_config) == free // 2


def test_staged_arrays_arrive_whole_in_one_buffer() -> None:
    """The CUDA path's packing, run on the CPU: dtypes, shapes, empty arrays and growth."""
    stager = InputStager(torch.device("cpu"), pack=True)
    rng = np.random.default_rng(0)
    for step in range(30):
        arrays = [
            rng.integers(-5, 1 << 40, rng.integers(0, 300)),  # int64
            rng.integers(0, 1 << 20, (rng.integers(1, 9), rng.integers(1, 50))).astype(np.int32),
            rng.integers(0, 9, 2 * (step + 1) ** 3).astype(np.int32)[::2],  # strided, growing
            np.zeros(0, np.int32),
            rng.standard_normal(3).astype(np.float32),
        ]
        staged = stager.stage(arrays)
        for array, tensor in zip(arrays, staged, strict=True):
            assert tensor.dtype == torch.from_numpy(np.ascontiguousarray(array)).dtype
            assert tensor.shape == array.shape
            assert np.array_equal(tensor.numpy(), array)
            # A view of the device side, not the host side that the next step overwrites.
            assert tensor.untyped_storage().data_ptr() == stager._buffer.device_bytes.data_ptr()


def _runner(device: str = "cpu", dtype: torch.dtype = torch.float32) -> ModelRunner:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.random_preset("tiny")).to(device=device, dtype=dtype)
    return ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE)


def _prefill(runner: ModelRunner, num_seqs: int, rng: np.random.Generator) -> list:
    """``num_seqs`` sequences of 3 to 17 tokens computed into blocks of their own: each one's
    (block table, context length)."""
    seqs, next_block = [], 1  # block 0 stays unused: padding rows may read it
    for _ in range(num_seqs):
        num_tokens = int(rng.integers(3, 18))
        table = list(range(next_block, next_block - (-(num_tokens + 8) // BLOCK_SIZE)))
        next_block += len(table)  # room for 8 decodes
        batch = StepBatch(
            input_ids=rng.integers(0, 257, num_tokens),
            start_pos=np.array([0]),
            num_new=np.array([num_tokens]),
            block_tables=np.array([table], np.int32),
        )
        runner.execute_batch(batch)
        seqs.append((table, num_tokens))
    return seqs


def _decode_batch(seqs: list, rows: list[int], rng: np.random.Generator) -> StepBatch:
    width = max(len(seqs[r][0]) for r in rows)
    block_tables = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        block_tables[i, : len(seqs[r][0])] = seqs[r][0]
    return StepBatch(
        input_ids=rng.integers(0, 257, len(rows)),
        start_pos=np.array([seqs[r][1] for r in rows]),
        num_new=np.ones(len(rows), np.int64),
        block_tables=block_tables,
    )


def check_padded_steps(device: str, dtype: torch.dtype, *, capture: bool, **tolerance) -> None:
    """Batches of every padding amount, shrinking and growing (stale rows behind them): each
    step's logits are the plain path's, and the KV cache changes exactly at the step's slots,
    to the plain path's values."""
    rng = np.random.default_rng(1)
    plain, padded = _runner(device, dtype), _runner(device, dtype)
    seqs = _prefill(plain, 20, np.random.default_rng(2))
    _prefill(padded, 20, np.random.default_rng(2))
    padded.graphs = DecodeGraphs(
        padded.model,
        padded.kv_caches,
        block_size=BLOCK_SIZE,
        max_model_len=NUM_BLOCKS * BLOCK_SIZE,
        max_num_seqs=20,
        capture=capture,
    )
    for num_seqs in [17, 3, 1, 9, 20, 5, 2, 16]:
        rows = sorted(rng.choice(20, num_seqs, replace=False).tolist())
        batch = _decode_batch(seqs, rows, rng)
        before = [k.clone() for k, _ in padded.kv_caches]
        want = plain.execute_batch(batch)
        got = padded.execute_batch(batch)
        assert got.shape == want.shape == (num_seqs, 257)
        torch.testing.assert_close(got, want, **tolerance)
        slots = set()
        for r in rows:
            table, position = seqs[r]
            slots.add(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            seqs[r] = (table, position + 1)  # the next step decodes one position further
        for k_before, (k_after, _) in zip(before, padded.kv_caches, strict=True):
            changed = (k_before != k_after).flatten(2).any(-1).flatten().nonzero().flatten()
            assert set(changed.tolist()) == slots
        for (k_plain, v_plain), (k_padded, v_padded) in zip(
            plain.kv_caches, padded.kv_caches, strict=True
        ):
            torch.testing.assert_close(k_padded, k_plain, **tolerance)
            torch.testing.assert_close(v_padded, v_plain, **tolerance)


def check_piecewise_steps(
    device: str,
    dtype: torch.dtype,
    *,
    capture: bool,
    num_splits: int | None = None,
    step_sizes: tuple[int, ...] = (8, 2, 5, 1, 8, 3, 6, 4, 7),
    **tolerance,
) -> None:
    """Steps of prompt chunks and decodes side by side, of every padding amount and shrinking
    after larger ones (stale rows behind them), run with all but attention from the stretches
    of ``PrefillGraphs``: each step's logits and KV cache are the plain path's."""
    rng = np.random.default_rng(4)
    plain, piecewise = _runner(device, dtype), _runner(device, dtype)
    piecewise.prefill_graphs = PrefillGraphs(
        piecewise.model,
        piecewise.kv_caches,
        max_num_tokens=40,
        capture=capture,
        num_splits=num_splits,
    )
    assert piecewise.prefill_graphs.sizes == [16, 32, 40]
    # Eight sequences of 16 blocks each (block 0 unused), filled a few tokens at a time.
    tables = [list(range(1 + 16 * s, 17 + 16 * s)) for s in range(8)]
    lengths = [0] * 8
    for num_seqs in step_sizes:
        rows = sorted(rng.choice(8, num_seqs, replace=False).tolist())
        num_new = rng.integers(1, 6, num_seqs)
        num_new[0] = max(num_new[0], 2)  # never all decodes: those are DecodeGraphs' steps
        batch = StepBatch(
            input_ids=rng.integers(0, 257, int(num_new.sum())),
            start_pos=np.array([lengths[r] for r in rows]),
            num_new=num_new,
            block_tables=np.array([tables[r] for r in rows], np.int32),
        )
        want = plain.execute_batch(batch)
        got = piecewise.execute_batch(batch)
        assert got.shape == want.shape == (num_seqs, 257)
        torch.testing.assert_close(got, want, **tolerance)
        for r, n in zip(rows, num_new.tolist(), strict=True):
            lengths[r] += n
        for (k_plain, v_plain), (k_got, v_got) in zip(
            plain.kv_caches, piecewise.kv_caches, strict=True
        ):
            torch.testing.assert_close(k_got, k_plain, **tolerance)
            torch.testing.assert_close(v_got, v_plain, **tolerance)
    # A step past the largest size goes the plain way.
    assert not piecewise.prefill_graphs.can_run(41)
    big = StepBatch(
        input_ids=rng.integers(0, 257, 41),
        start_pos=np.array([0]),
        num_new=np.array([41]),
        block_tables=np.array([tables[0][:11]], np.int32),
    )
    torch.testing.assert_close(piecewise.execute_batch(big), plain.execute_batch(big), **tolerance)


SEQUENCE_STEPS = [(0, 37), (0, 5), (1, 16), (0, 2), (1, 40), (2, 17), (0, 33), (1, 1)]


def check_sequence_steps(
    device: str,
    dtype: torch.dtype,
    *,
    capture: bool,
    steps: list[tuple[int, int]] = SEQUENCE_STEPS,
    **tolerance,
) -> None:
    """One sequence's steps of every padding amount, a long one after short ones and short ones
    after it (stale rows behind them), over growing cached contexts, run whole by
    ``SequenceGraphs``: each step's logits are the plain path's, and the KV cache changes
    exactly at the step's slots, to the plain path's values."""
    rng = np.random.default_rng(5)
    plain, whole = _runner(device, dtype), _runner(device, dtype)
    whole.sequence_graphs = SequenceGraphs(
        whole.model,
        whole.kv_caches,
        block_size=BLOCK_SIZE,
        max_model_len=NUM_BLOCKS * BLOCK_SIZE,
        max_num_tokens=40,
        capture=capture,
    )
    assert whole.sequence_graphs.sizes == [16, 32, 40]
    # Three sequences of 40 blocks each (block 0 unused); the first two grow step by step.
    tables = [list(range(1 + 40 * s, 41 + 40 * s)) for s in range(3)]
    lengths = [0, 0, 0]
    for seq, num_new in steps:  # (sequence, new tokens)
        start = lengths[seq]
        table = tables[seq][: -(-(start + num_new) // BLOCK_SIZE) + int(rng.integers(0, 3))]
        batch = StepBatch(
            input_ids=rng.integers(0, 257, num_new),
            start_pos=np.array([start]),
            num_new=np.array([num_new]),
            block_tables=np.array([table], np.int32),
        )
        before = [k.clone() for k, _ in whole.kv_caches]
        want = plain.execute_batch(batch)
        got = whole.execute_batch(batch)
        assert got.shape == want.shape == (1, 257)
        torch.testing.assert_close(got, want, **tolerance)
        slots = {
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(start, start + num_new)
        }
        for k_before, (k_after, _) in zip(before, whole.kv_caches, strict=True):
            changed = (k_before != k_after).flatten(2).any(-1).flatten().nonzero().flatten()
            assert set(changed.tolist()) == slots
        for (k_plain, v_plain), (k_got, v_got) in zip(
            plain.kv_caches, whole.kv_caches, strict=True
        ):
            torch.testing.assert_close(k_got, k_plain, **tolerance)
            torch.testing.assert_close(v_got, v_plain, **tolerance)
        lengths[seq] += num_new


def test_one_sequence_steps_match_the_plain_path() -> None:
    check_sequence_steps("cpu", torch.float32, capture=False)


def test_one_sequence_kernel_path_through_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA branch of the whole forward on CPU tensors, through Triton's interpreter:
    attention launched for the padded token count and the longest context (its splits), the
    sequence's rows and context read from the static inputs."""
    monkeypatch.setattr("kvswitch.worker.attention.use_triton", lambda device: True)
    # (Four steps: padded up, down to the smallest size, exact, over a cached context.)
    steps = SEQUENCE_STEPS[:4]
    check_sequence_steps("cpu", torch.float32, capture=False, steps=steps, atol=1e-5, rtol=1e-5)


def test_steps_of_several_sequences_or_every_token_leave_the_sequence_graphs() -> None:
    """Two sequences, teacher forcing, a step past the largest size or a table past the
    longest context take the other paths; run refuses what it cannot take."""
    runner = _runner()
    graphs = runner.sequence_graphs = SequenceGraphs(
        runner.model,
        runner.kv_caches,
        block_size=BLOCK_SIZE,
        max_model_len=8 * BLOCK_SIZE,
        max_num_tokens=20,
        capture=False,
    )
    calls = []
    original = graphs.run
    graphs.run = lambda *args: calls.append(len(args[0])) or original(*args)
    assert graphs.can_run(20, 8)
    assert not graphs.can_run(21, 8)
    assert not graphs.can_run(20, 9)
    assert not graphs.can_run(0, 1)

    def batch(num_new: list[int], width: int) -> StepBatch:
        return StepBatch(
            input_ids=np.arange(sum(num_new)) % 257,
            start_pos=np.zeros(len(num_new), np.int64),
            num_new=np.array(num_new),
            block_tables=np.arange(1, 1 + width * len(num_new), dtype=np.int32).reshape(
                len(num_new), width
            ),
        )

    assert runner.execute_batch(batch([3, 4], 2)).shape == (2, 257)
    assert runner.execute_batch(batch([7], 2), every_token=True).shape == (7, 257)
    assert runner.execute_batch(batch([21], 9)).shape == (1, 257)
    assert runner.execute_batch(batch([5], 9)).shape == (1, 257)
    assert calls == []
    assert runner.execute_batch(batch([5], 8)).shape == (1, 257)
    assert calls == [5]
    with pytest.raises(ValueError, match="the graphs take 1 to 20 tokens over at most 8 blocks"):
        original(np.zeros(21, np.int64), np.arange(21), np.zeros(21, np.int32), 21, np.ones(8))


def test_piecewise_steps_match_the_plain_path() -> None:
    check_piecewise_steps("cpu", torch.float32, capture=False)


def test_piecewise_kernel_path_through_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch of the stretches on CPU tensors, through Triton's interpreter: K/V stored
    by store_kv inside them, attention's context splits left in their buffers and merged at the
    start of the next stretch; against the plain path, whose kernels merge at once."""
    monkeypatch.setattr("kvswitch.worker.attention.use_triton", lambda device: True)
    # (Three steps, shrinking and growing: each costs the interpreter seconds.)
    check_piecewise_steps(
        "cpu",
        torch.float32,
        capture=False,
        num_splits=3,
        step_sizes=(8, 2, 5),
        atol=1e-5,
        rtol=1e-5,
    )


def test_padded_decode_steps_match_the_plain_path_and_write_only_their_slots() -> None:
    check_padded_steps("cpu", torch.float32, capture=False)


def test_steps_the_graphs_cannot_take_run_the_plain_path() -> None:
    """More sequences than captured, a table wider than the context, prefill and teacher
    forcing go the plain way."""
    runner = _runner()
    runner.graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        block_size=BLOCK_SIZE,
        max_model_len=8 * BLOCK_SIZE,
        max_num_seqs=2,
        capture=False,
    )
    assert runner.graphs.can_run(2, 8)
    assert not runner.graphs.can_run(3, 8)
    assert not runner.graphs.can_run(2, 9)
    assert not runner.graphs.can_run(0, 1)
    batch = StepBatch(
        input_ids=np.array([5, 6, 7]),
        start_pos=np.array([0, 0, 0]),
        num_new=np.ones(3, np.int64),
        block_tables=np.array([[1], [2], [3]], np.int32),
    )
    assert runner.execute_batch(batch).shape == (3, 257)
    with pytest.raises(ValueError, match="the graphs take 1 to 2 sequences of at most 8 blocks"):
        runner.graphs.run(
            batch.input_ids,
            batch.start_pos,
            np.zeros(3, np.int32),
            np.ones(3, np.int32),
            batch.block_tables,
        )


def test_cuda_graphs_are_on_by_default_on_a_gpu_and_refused_off_one() -> None:
    assert EngineConfig(device="cuda").cuda_graphs is True
    assert EngineConfig(device="cuda:1", cuda_graphs=False).cuda_graphs is False
    assert EngineConfig().cuda_graphs is False
    with pytest.raises(ValueError, match="use it with a cuda device"):
        EngineConfig(cuda_graphs=True)
    model = CausalLM(ModelConfig.random_preset("tiny"))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ModelRunner(model, 8, BLOCK_SIZE, cuda_graphs=True)


@gpu_test
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, {"atol": 1e-4, "rtol": 1e-4}), (torch.bfloat16, {"atol": 0.1, "rtol": 0.05})],
)
def test_captured_graphs_match_the_plain_path(dtype: torch.dtype, tolerance: dict) -> None:
    check_padded_steps("cuda", dtype, capture=True, **tolerance)


@gpu_test
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, {"atol": 1e-4, "rtol": 1e-4}), (torch.bfloat16, {"atol": 0.1, "rtol": 0.05})],
)
def test_captured_stretches_match_the_plain_path(dtype: torch.dtype, tolerance: dict) -> None:
    check_piecewise_steps("cuda", dtype, capture=True, **tolerance)


@gpu_test
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, {"atol": 1e-4, "rtol": 1e-4}), (torch.bfloat16, {"atol": 0.1, "rtol": 0.05})],
)
def test_captured_sequence_graphs_match_the_plain_path(dtype: torch.dtype, tolerance: dict) -> None:
    check_sequence_steps("cuda", dtype, capture=True, **tolerance)


@gpu_test
def test_captured_graphs_serve_the_tokens_of_the_plain_engine() -> None:
    """Greedy decodes of 40 requests arriving while others decode (several capture sizes,
    padding, growing contexts): the engine with graphs produces the plain engine's tokens."""

    def generate(cuda_graphs: bool) -> dict[str, list[int]]:
        engine = LLMEngine(
            EngineConfig(
                device="cuda", kv_cache_bytes=64 << 20, max_num_seqs=40, cuda_graphs=cuda_graphs
            )
        )
        assert (engine.runner.graphs is not None) == cuda_graphs
        rng = np.random.default_rng(3)
        outputs: dict[str, list[int]] = {}

        def step() -> None:
            produced = engine.step()
            for request_id, token_id in zip(produced.request_ids, produced.token_ids, strict=True):
                outputs[request_id].append(token_id)

        for i in range(40):
            prompt = rng.integers(0, 257, int(rng.integers(5, 90))).tolist()
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 30))))
            outputs[f"r{i}"] = []
            if i % 7 == 0:
                step()
        while engine.has_unfinished():
            step()
        return outputs

    assert generate(cuda_graphs=True) == generate(cuda_graphs=False)
