"""vLLM's KV events read in both of the shapes vLLM has published, and named as kvswitch names
the same prompts: a request routed by those names finds the blocks the engine said it holds."""

from __future__ import annotations

import msgpack
import pytest

from kvswitch.cache_index.events import AllBlocksCleared, BlockRemoved, BlockStored, replay
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.vllm_events import (
    BlockSizeMismatch,
    EngineAllBlocksCleared,
    EngineBlockNames,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEventBatch,
    EngineEventError,
    decode_batch,
    encode_batch,
)

B = 4
MODEL = "meta-llama/Llama-3.2-1B"
PROMPT = list(range(100, 100 + 3 * B))  # three full blocks


def stored(hashes, parent, tokens, **fields) -> EngineBlockStored:
    return EngineBlockStored(tuple(hashes), parent, tuple(tokens), B, **fields)


def names() -> EngineBlockNames:
    return EngineBlockNames(namespace=MODEL, block_size=B)


@pytest.mark.parametrize("arrays", [False, True], ids=["maps", "arrays"])
def test_both_shapes_read_back_the_same_batch(arrays: bool) -> None:
    batch = EngineEventBatch(
        1.5,
        (
            stored([11, 12], None, PROMPT[: 2 * B], medium="GPU", lora_name="ad", group_idx=0),
            EngineBlockRemoved((11,), "GPU"),
            EngineAllBlocksCleared(),
        ),
        data_parallel_rank=2,
    )
    assert decode_batch(encode_batch(batch, arrays=arrays)) == batch


def test_fields_and_events_it_does_not_know_are_passed_over() -> None:
    payload = msgpack.packb(
        {
            "ts": 2.0,
            "events": [
                {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
                 "token_ids": PROMPT[:B], "block_size": B, "lora_id": None, "medium": "GPU",
                 "lora_name": None, "kv_cache_spec_sliding_window": None, "new_field": [1, 2]},
                {"type": "BlockTeleported", "block_hashes": [5]},
                ["BlockRemoved", [7], "CPU"],
            ],
        }
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.ts == 2.0 and batch.data_parallel_rank is None
    assert batch.events == (
        stored([b"\x01" * 32], None, PROMPT[:B], medium="GPU"),
        EngineBlockRemoved((7,), "CPU"),
    )


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb("hello"), "a batch is a map or an array"),
        (msgpack.packb({"ts": "soon", "events": []}), "a batch's ts and events"),
        (msgpack.packb([1.0, [42]]), "an event is a tagged map or a tagged array"),
        (msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]), "a BlockRemoved event"),
    ],
)
def test_what_is_not_a_batch_is_refused_saying_why(payload: bytes, message: str) -> None:
    with pytest.raises(EngineEventError, match=message):
        decode_batch(payload)


def test_blocks_get_the_names_the_router_gives_the_same_prompt() -> None:
    """One chain stored in two steps (the second naming its parent by the engine's hash), and
    another under a LoRA adapter: each block's name is the one the router hashes the prompt to."""
    engine = names()
    first = engine.apply([stored([11, 12], None, PROMPT[: 2 * B])])
    second = engine.apply([stored([13], 12, PROMPT[2 * B :])])
    expected = hash_prompt_blocks(PROMPT, B, MODEL)
    assert first == [BlockStored(tuple(expected[:2]))]
    assert second == [BlockStored((expected[2],))]
    adapted = engine.apply([stored([21, 22, 23], None, PROMPT, lora_name="sql")])
    assert adapted == [BlockStored(tuple(hash_prompt_blocks(PROMPT, B, MODEL, lora="sql")))]
    # vLLM puts the adapter's name into each block's extra keys too: the same names.
    again = names().apply(
        [stored([31, 32, 33], None, PROMPT, lora_name="sql", extra_keys=(("sql",),) * 3)]
    )
    assert again == adapted
    assert engine.stats.num_stored == 6 and len(engine) == 6


def test_a_cache_salt_in_the_first_blocks_keys_names_the_chain_as_a_salted_prompt() -> None:
    """vLLM appends a request's cache_salt to its first block's extra keys (after the adapter's
    name): the chain gets the names the router gives the prompt with that salt."""
    salted = names().apply(
        [stored([1, 2, 3], None, PROMPT, extra_keys=(("tenant-7",), None, None))]
    )
    assert salted == [
        BlockStored(tuple(hash_prompt_blocks(PROMPT, B, MODEL, cache_salt="tenant-7")))
    ]
    both = names().apply(
        [
            stored(
                [1, 2, 3],
                None,
                PROMPT,
                lora_name="sql",
                extra_keys=(("sql", "tenant-7"), ("sql",), ("sql",)),
            )
        ]
    )
    expected = hash_prompt_blocks(PROMPT, B, MODEL, lora="sql", cache_salt="tenant-7")
    assert both == [BlockStored(tuple(expected))]
    # A string in a later block's keys is no salt (vLLM salts the first block only).
    [later] = names().apply([stored([1, 2, 3], None, PROMPT, extra_keys=(None, ("x",), None))])
    assert later.block_hashes[0] == hash_prompt_blocks(PROMPT, B, MODEL)[0]
    assert later.block_hashes[1] != hash_prompt_blocks(PROMPT, B, MODEL)[1]


def test_blocks_with_other_extra_keys_never_take_a_plain_prompts_names() -> None:
    engine = names()
    [event] = engine.apply(
        [stored([1, 2, 3], None, PROMPT, extra_keys=(("img-1f3a", 0), None, None))]
    )
    plain = hash_prompt_blocks(PROMPT, B, MODEL)
    assert not set(event.block_hashes) & set(plain)  # block 0 differs, so its children do


def test_a_block_stays_named_while_any_tier_holds_it() -> None:
    """The CPU tier's stored event carries no tokens: its blocks are known by the engine's
    names. The index drops a block only when the last tier let it go."""
    engine = names()
    [gpu] = engine.apply([stored([11, 12], None, PROMPT[: 2 * B])])
    offloaded = engine.apply([EngineBlockStored((11, 12), None, (), 0, medium="CPU")])
    assert offloaded == [BlockStored(gpu.block_hashes)]
    assert engine.media_of(11) == {"GPU", "CPU"}
    assert engine.apply([EngineBlockRemoved((11, 12), "GPU")]) == []  # the CPU tier has them
    assert engine.apply([EngineBlockRemoved((12,), "CPU")]) == [BlockRemoved(gpu.block_hashes[1:])]
    assert engine.name_of(12) is None and engine.name_of(11) == gpu.block_hashes[0]
    assert engine.apply([EngineAllBlocksCleared()]) == [AllBlocksCleared()]
    assert len(engine) == 0


def test_the_blocks_the_gpu_holds_are_told_apart_once_another_tier_shows() -> None:
    """``apply_tiers``: beside the blocks any tier holds, those the GPU holds, so that a CPU
    hit can count below a GPU one; ``tiered`` once a CPU tier has told of blocks."""
    engine = names()
    any_tier, on_gpu = engine.apply_tiers([stored([11, 12], None, PROMPT[: 2 * B])])
    assert any_tier == on_gpu == [BlockStored(any_tier[0].block_hashes)]
    assert not engine.tiered
    name_11, name_12 = any_tier[0].block_hashes
    offloaded = EngineBlockStored((11, 12), None, (), 0, medium="CPU")
    assert engine.apply_tiers([offloaded]) == ([BlockStored((name_11, name_12))], [])
    assert engine.tiered
    # The GPU lets both go: still held (by the CPU), no longer on the GPU.
    dropped = engine.apply_tiers([EngineBlockRemoved((11, 12), "GPU")])
    assert dropped == ([], [BlockRemoved((name_11, name_12))])
    assert engine.gpu_block_names() == set() and engine.block_names() == {name_11, name_12}
    # A block loaded back onto the GPU is the GPU's again.
    back = EngineBlockStored((11,), None, tuple(PROMPT[:B]), B, medium="GPU")
    assert engine.apply_tiers([back])[1] == [BlockStored((name_11,))]
    assert engine.gpu_block_names() == {name_11}
    assert engine.apply_tiers([EngineAllBlocksCleared()]) == (
        [AllBlocksCleared()],
        [AllBlocksCleared()],
    )


def test_what_cannot_be_named_is_counted_not_guessed() -> None:
    """A block whose parent the router never heard of (it joined late, or a message was lost),
    or a tokenless tier's block it never saw stored: no name, counted. A sliding-window group's
    blocks are left out."""
    engine = names()
    assert engine.apply([stored([13], 12, PROMPT[:B])]) == []
    assert engine.apply([EngineBlockStored((99,), None, (), 0, medium="CPU")]) == []
    assert engine.stats.num_orphans == 2
    window = stored([5], None, PROMPT[:B], kv_cache_spec_kind="sliding_window", group_idx=1)
    assert engine.apply([window]) == []
    assert engine.stats.num_skipped_groups == 1
    full = stored([6], None, PROMPT[:B], kv_cache_spec_kind="full_attention", group_idx=0)
    assert engine.apply([full]) == [BlockStored((hash_prompt_blocks(PROMPT, B, MODEL)[0],))]
    assert len(engine) == 1


def test_blocks_of_another_size_are_refused_naming_both() -> None:
    engine = EngineBlockNames(namespace=MODEL, block_size=16)
    with pytest.raises(BlockSizeMismatch, match="hold 4 tokens, the router's --block-size is 16"):
        engine.apply([stored([1], None, PROMPT[:B])])
    assert len(engine) == 0


def test_replaying_the_index_events_gives_the_engines_blocks_by_name() -> None:
    engine = names()
    events = [
        *engine.apply([stored([11, 12, 13], None, PROMPT)]),
        *engine.apply([EngineBlockRemoved((13,), None)]),
    ]
    assert replay(events) == engine.block_names() == set(hash_prompt_blocks(PROMPT, B, MODEL)[:2])
