"""Block tables kept between steps, and the batch arrays built from them."""

from __future__ import annotations

import random

import numpy as np
import torch

from kvswitch.worker.block_table import BlockTables
from kvswitch.worker.model import CausalLM
from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.model_runner import ModelRunner, ScheduledSeq, StepBatch


def test_the_version_moves_exactly_when_a_row_changes_hands() -> None:
    tables = BlockTables(num_rows=2, num_columns=2)
    versions = [tables.version]
    tables.append("a", [1])  # a row handed out
    versions.append(tables.version)
    tables.append("a", [2, 3])  # the same row, longer (and wider): rows unchanged
    assert tables.version == versions[-1]
    tables.release("a")  # given back
    versions.append(tables.version)
    tables.release("a")  # nothing to give back
    assert tables.version == versions[-1]
    tables.append("b", [4])  # takes the row "a" had
    versions.append(tables.version)
    assert len(set(versions)) == 4


def test_rows_grow_in_place_and_are_reused() -> None:
    tables = BlockTables(num_rows=2, num_columns=2)
    tables.append("a", [7, 8])
    tables.append("b", [9])
    tables.append("a", [12, 13, 14])  # past the columns: the table widens
    tables.append("c", [])  # past the rows: the table grows; a row with no blocks yet
    assert tables.block_ids("a") == [7, 8, 12, 13, 14]
    assert tables.block_ids("b") == [9]
    assert tables.block_ids("c") == []
    assert len(tables) == 3
    row_b = tables.row("b")
    tables.release("b")
    tables.release("unknown")  # ignored
    assert tables.block_ids("b") == []
    tables.append("d", [3])
    assert tables.row("d") == row_b  # the freed row, reused
    assert tables.block_ids("d") == [3]
    batch = tables.gather(np.array([tables.row("d"), tables.row("a")]))
    assert batch.shape == (2, 5)
    assert batch[0, 0] == 3 and batch[1].tolist() == [7, 8, 12, 13, 14]


def test_random_appends_and_releases_match_plain_lists() -> None:
    rng = random.Random(0)
    tables = BlockTables(num_rows=1, num_columns=1)
    expected: dict[str, list[int]] = {}
    for step in range(2000):
        request_id = f"r{rng.randrange(40)}"
        if rng.random() < 0.2:
            tables.release(request_id)
            expected.pop(request_id, None)
        else:
            new = [rng.randrange(10_000) for _ in range(rng.randrange(4))]
            tables.append(request_id, new)
            expected.setdefault(request_id, []).extend(new)
        if step % 100 == 0:
            assert {r: tables.block_ids(r) for r in expected} == expected
            assert len(tables) == len(expected)


class _Capture:
    """A model that records what the runner hands it and returns zero logits."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.calls: list[tuple] = []

    def __call__(self, input_ids, positions, kv_caches, meta, logit_rows):
        self.calls.append((input_ids, positions, meta, logit_rows))
        return torch.zeros(len(logit_rows), self.model.config.vocab_size)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_positions_and_slots_are_those_of_each_token() -> None:
    """The array-built batch against the token-by-token definition, on random mixed batches."""
    block_size = 4
    runner = ModelRunner(CausalLM(ModelConfig.random_preset("tiny")), 64, block_size)
    capture = _Capture(runner.model)
    runner.model = capture
    rng = random.Random(1)
    for _ in range(50):
        seqs = []
        for _ in range(rng.randint(1, 6)):
            start = rng.randrange(30)
            num_new = rng.choice([1, 1, rng.randint(1, 12)])
            num_pages = -(-(start + num_new) // block_size) + rng.randrange(3)
            blocks = rng.sample(range(64), num_pages)
            seqs.append(ScheduledSeq([rng.randrange(257) for _ in range(num_new)], start, blocks))
        runner.execute(seqs, every_token=rng.random() < 0.5)
        input_ids, positions, meta, _ = capture.calls[-1]
        want_positions = [
            p for s in seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))
        ]
        want_slots = [
            s.block_ids[p // block_size] * block_size + p % block_size
            for s in seqs
            for p in range(s.start_pos, s.start_pos + len(s.token_ids))
        ]
        assert input_ids.tolist() == [t for s in seqs for t in s.token_ids]
        assert positions.tolist() == want_positions
        assert meta.slot_mapping.tolist() == want_slots
        assert meta.seq_lens.tolist() == [s.start_pos + len(s.token_ids) for s in seqs]
        for row, seq in enumerate(seqs):
            assert meta.block_tables[row, : len(seq.block_ids)].tolist() == seq.block_ids


def test_a_batch_built_from_arrays_runs_as_the_same_sequences() -> None:
    runner = ModelRunner(CausalLM(ModelConfig.random_preset("tiny")), 16, 4)
    seqs = [ScheduledSeq([256, 1, 2, 3, 4, 5], 0, [3, 9]), ScheduledSeq([256, 7], 0, [4])]
    expected = runner.execute(seqs)
    batch = StepBatch(
        input_ids=np.array([256, 1, 2, 3, 4, 5, 256, 7]),
        start_pos=np.array([0, 0]),
        num_new=np.array([6, 2]),
        block_tables=np.array([[3, 9], [4, 0]], np.int32),
    )
    torch.testing.assert_close(runner.execute_batch(batch), expected)
