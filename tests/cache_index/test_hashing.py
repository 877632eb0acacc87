"""Block hashing against the reference vectors of tests/data and the rules of docs/HASHING.md."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_128_digest

from kvswitch.cache_index.hashing import (
    BlockHasher,
    MMItem,
    hash_block_tokens,
    hash_prompt_blocks,
    root_hash,
    tokens_from_bytes,
    tokens_to_bytes,
)

VECTORS_PATH = Path(__file__).resolve().parent.parent / "data" / "hash_vectors.json"
VECTORS: list[dict] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))["vectors"]

IMAGE = bytes(range(32))
AUDIO = b"\xff" * 16


def mm_items_of(vector: dict) -> tuple[MMItem, ...]:
    return tuple(
        MMItem(bytes.fromhex(m["content_hash"]), m["offset"], m["length"])
        for m in vector["mm_items"]
    )


def hasher_of(vector: dict) -> BlockHasher:
    return BlockHasher(
        vector["namespace"],
        vector["block_size"],
        lora=vector["lora"],
        cache_salt=vector["cache_salt"],
        mm_items=mm_items_of(vector),
    )


# --- reference vectors -----------------------------------------------------------------------


def test_vectors_file_is_small_and_complete() -> None:
    assert VECTORS_PATH.stat().st_size < 60_000
    names = [v["name"] for v in VECTORS]
    assert len(names) == len(set(names)) >= 10
    assert any(not v["chain"] for v in VECTORS), "a case with no full block"
    assert {v["block_size"] for v in VECTORS} >= {1, 4, 16}


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_chain(vector: dict) -> None:
    chain = hash_prompt_blocks(
        vector["tokens"],
        vector["block_size"],
        vector["namespace"],
        lora=vector["lora"],
        cache_salt=vector["cache_salt"],
        mm_items=mm_items_of(vector),
    )
    assert [h.hex() for h in chain] == vector["chain"]
    assert len(chain) == len(vector["tokens"]) // vector["block_size"]
    assert all(len(h) == 16 for h in chain)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_extras_and_root(vector: dict) -> None:
    hasher = hasher_of(vector)
    assert hasher.root.hex() == vector["root"]
    assert [hasher.block_extra(i).hex() for i in range(len(vector["chain"]))] == vector["extras"]
    assert hasher.has_extras == any(vector["extras"])


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_chain_from_block_formula(vector: dict) -> None:
    """The chain is hash_block_tokens applied block by block with the recorded extras."""
    size = vector["block_size"]
    parent = bytes.fromhex(vector["root"])
    for i, (extra, expected) in enumerate(zip(vector["extras"], vector["chain"], strict=True)):
        block = vector["tokens"][i * size : (i + 1) * size]
        parent = hash_block_tokens(parent, block, bytes.fromhex(extra))
        assert parent.hex() == expected


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_numpy_input(vector: dict) -> None:
    tokens = np.asarray(vector["tokens"], dtype=np.uint32)
    assert [h.hex() for h in hasher_of(vector).hash_blocks(tokens)] == vector["chain"]


# --- the raw formulas ------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", ["", "test-model", "模型 🚀"])
def test_root_hash_formula(namespace: str) -> None:
    expected = xxh3_128_digest(b"kvswitch/v1\x00" + namespace.encode("utf-8"))
    assert root_hash(namespace) == expected
    assert len(expected) == 16


def test_hash_block_tokens_formula() -> None:
    parent = bytes(range(16))
    tokens = [1, 0xFFFF_FFFF, 0, 258]
    raw = b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00\x02\x01\x00\x00"
    assert tokens_to_bytes(tokens) == raw
    assert hash_block_tokens(parent, tokens) == xxh3_128_digest(parent + raw)
    assert hash_block_tokens(parent, tokens, b"xyz") == xxh3_128_digest(parent + raw + b"xyz")
    assert hash_block_tokens(parent, np.asarray(tokens, dtype=np.int64)) == xxh3_128_digest(
        parent + raw
    )


def test_plain_chain_formula() -> None:
    tokens = list(range(10, 30))
    parent = xxh3_128_digest(b"kvswitch/v1\x00m")
    expected = []
    for i in range(5):
        parent = xxh3_128_digest(parent + struct.pack("<4I", *tokens[4 * i : 4 * i + 4]))
        expected.append(parent)
    assert hash_prompt_blocks([*tokens, 1, 2, 3], 4, "m") == expected


def test_extra_field_layout() -> None:
    hasher = BlockHasher("m", 4, lora="ab", cache_salt="é", mm_items=(MMItem(b"\x0a\x0b", 5, 1),))
    lora = b"\x01" + struct.pack("<I", 2) + b"ab"
    salt = b"\x02" + struct.pack("<I", 2) + "é".encode()
    item = b"\x03" + struct.pack("<I", 6) + struct.pack("<I", 5) + b"\x0a\x0b"
    assert hasher.block_extra(0) == lora + salt
    assert hasher.block_extra(1) == lora + item
    assert hasher.block_extra(2) == lora
    assert BlockHasher("m", 4).block_extra(0) == b""


def test_mm_overlap_rule_is_half_open() -> None:
    item = MMItem(b"h", offset=4, length=4)  # [4, 8): exactly block 1 of size 4
    hasher = BlockHasher("m", 4, mm_items=(item,))
    assert [bool(hasher.block_extra(i)) for i in range(4)] == [False, True, False, False]
    spanning = BlockHasher("m", 4, mm_items=(MMItem(b"h", offset=3, length=6),))  # [3, 9)
    assert [bool(spanning.block_extra(i)) for i in range(4)] == [True, True, True, False]


def test_mm_items_are_sorted_canonically() -> None:
    a, b, c = MMItem(b"\x02", 4, 1), MMItem(b"\x01\xff", 4, 2), MMItem(b"\x00", 0, 9)
    tokens = list(range(12))
    one = BlockHasher("m", 4, mm_items=(a, b, c))
    other = BlockHasher("m", 4, mm_items=(c, a, b))
    assert one.mm_items == other.mm_items == (c, b, a)
    assert one.hash_blocks(tokens) == other.hash_blocks(tokens)
    assert hash_prompt_blocks(tokens, 4, "m", mm_items=[a, b, c]) == one.hash_blocks(tokens)
    assert hash_prompt_blocks(tokens, 4, "m", mm_items=iter([b, c, a])) == one.hash_blocks(tokens)


# --- token input forms and validation --------------------------------------------------------

TOKENS = [0, 1, 2, 3, 151_999, 7, 0xFFFF_FFFF, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.mark.parametrize("extras", [{}, {"lora": "l", "cache_salt": "s"}])
@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.uint64, np.dtype(">u4")])
def test_numpy_and_list_inputs_agree(dtype: np.dtype, extras: dict) -> None:
    expected = hash_prompt_blocks(TOKENS, 4, "m", **extras)
    assert len(expected) == 4
    array = np.asarray(TOKENS, dtype=dtype)
    assert hash_prompt_blocks(array, 4, "m", **extras) == expected
    assert hash_prompt_blocks(tuple(TOKENS), 4, "m", **extras) == expected
    assert hash_prompt_blocks([np.int64(t) for t in TOKENS], 4, "m", **extras) == expected


def test_int32_input_agrees() -> None:
    tokens = [t for t in TOKENS if t < 2**31]
    expected = hash_prompt_blocks(tokens, 4, "m")
    assert hash_prompt_blocks(np.asarray(tokens, dtype=np.int32), 4, "m") == expected
    assert hash_prompt_blocks(np.asarray(tokens, dtype=np.uint32), 4, "m") == expected


def test_non_contiguous_array_agrees() -> None:
    wide = np.asarray([t for t in TOKENS for _ in (0, 1)], dtype=np.uint32)
    assert hash_prompt_blocks(wide[::2], 4, "m") == hash_prompt_blocks(TOKENS, 4, "m")


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
@pytest.mark.parametrize("position", [0, 5])
def test_out_of_range_ids_are_rejected(bad: int, position: int) -> None:
    tokens = list(range(8))
    tokens[position] = bad
    with pytest.raises(ValueError):
        hash_prompt_blocks(tokens, 4, "m")
    with pytest.raises(ValueError):
        hash_prompt_blocks(np.asarray(tokens, dtype=np.int64), 4, "m")
    with pytest.raises(ValueError):
        tokens_to_bytes(tokens)
    with pytest.raises(ValueError):
        hash_block_tokens(bytes(16), tokens)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((4, 8), dtype=np.uint32),
        np.zeros((2, 8), dtype=np.uint32),  # fewer rows than a block holds tokens
        np.zeros((1, 1), dtype=np.int64),
        np.array(5, dtype=np.uint32),
        np.zeros(8, dtype=np.float64),
        np.zeros(2, dtype=np.float32),  # shorter than one block
        np.zeros(0, dtype=np.float64),
        np.zeros(8, dtype=bool),
        np.array(["1"] * 8),
    ],
    ids=["2d", "2d-short", "2d-tiny", "0d", "float", "float-short", "float-empty", "bool", "str"],
)
def test_bad_arrays_are_rejected(array: np.ndarray) -> None:
    with pytest.raises(ValueError):
        hash_prompt_blocks(array, 4, "m")
    with pytest.raises(ValueError):
        tokens_to_bytes(array)


def test_token_bytes_read_back_as_the_same_ids_without_a_copy() -> None:
    ids = [0, 1, 256, 0xFFFF_FFFF]
    data = tokens_to_bytes(ids)
    assert data == struct.pack("<4I", *ids)
    tokens = tokens_from_bytes(data)
    assert tokens.tolist() == ids and tokens.dtype == np.dtype("<u4")
    assert not tokens.flags.owndata and not tokens.flags.writeable  # a view of `data`
    assert hash_prompt_blocks(tokens, 2, "m") == hash_prompt_blocks(ids, 2, "m")
    assert tokens_from_bytes(b"").tolist() == []


@pytest.mark.parametrize("num_bytes", [1, 3, 5, 4097])
def test_bytes_that_are_not_whole_ids_are_rejected(num_bytes: int) -> None:
    with pytest.raises(ValueError, match=f"4 bytes each; got {num_bytes} bytes"):
        tokens_from_bytes(b"\x01" * num_bytes)


def test_non_integer_list_items_are_rejected() -> None:
    with pytest.raises(ValueError):
        hash_prompt_blocks([0, 1, 2.0, 3], 4, "m")
    with pytest.raises(ValueError):
        hash_prompt_blocks([0, 1, "2", 3], 4, "m")


# --- incremental hashing ---------------------------------------------------------------------

HASHERS = {
    "plain": BlockHasher("m", 4),
    "extras": BlockHasher(
        "m",
        4,
        lora="l",
        cache_salt="s",
        mm_items=(MMItem(IMAGE, 3, 6), MMItem(AUDIO, 13, 1)),
    ),
    "size-1": BlockHasher("m", 1, cache_salt="s"),
}


@pytest.mark.parametrize("name", list(HASHERS))
def test_incremental_token_by_token_equals_one_shot(name: str) -> None:
    hasher = HASHERS[name]
    tokens = [(i * 7919) % 1000 for i in range(23)]
    one_shot = hasher.hash_blocks(tokens)
    assert len(one_shot) == 23 // hasher.block_size
    chain: list[bytes] = []
    for n in range(len(tokens) + 1):
        new = hasher.hash_blocks(tokens[:n], chain)
        assert len(new) == n // hasher.block_size - len(chain)
        chain += new
        assert chain == one_shot[: n // hasher.block_size]
    assert chain == one_shot


@pytest.mark.parametrize("name", list(HASHERS))
def test_incremental_on_growing_array(name: str) -> None:
    hasher = HASHERS[name]
    tokens = np.arange(100, 123, dtype=np.int64)
    chain: list[bytes] = []
    for n in range(0, len(tokens) + 1, 3):
        chain += hasher.hash_blocks(tokens[:n], chain)
    chain += hasher.hash_blocks(tokens, chain)
    assert chain == hasher.hash_blocks(tokens.tolist())


def test_prefix_is_trusted_and_only_new_hashes_are_returned() -> None:
    hasher = HASHERS["extras"]
    tokens = list(range(16))
    full = hasher.hash_blocks(tokens)
    assert hasher.hash_blocks(tokens, full[:2]) == full[2:]
    assert hasher.hash_blocks(tokens, full) == []
    assert hasher.hash_blocks(tokens[:6], full) == []  # prefix already longer than the tokens


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=5),
    salt=st.none() | st.text(min_size=1, max_size=5),
)
def test_incremental_any_split(tokens: list[int], cuts: list[int], salt: str | None) -> None:
    hasher = BlockHasher("m", 4, lora="l", cache_salt=salt, mm_items=(MMItem(b"x", 6, 5),))
    chain: list[bytes] = []
    for cut in [*sorted(cuts), len(tokens)]:
        chain += hasher.hash_blocks(tokens[:cut], chain)
    assert chain == hasher.hash_blocks(tokens)


# --- isolation between chains ----------------------------------------------------------------

LONG = [(i * 31 + 7) % 5000 for i in range(64)]


def test_salted_chains_share_no_hash() -> None:
    plain = hash_prompt_blocks(LONG, 4, "m")
    salted_a = hash_prompt_blocks(LONG, 4, "m", cache_salt="a")
    salted_b = hash_prompt_blocks(LONG, 4, "m", cache_salt="b")
    assert len(plain) == len(salted_a) == len(salted_b) == 16
    assert not set(plain) & set(salted_a)
    assert not set(plain) & set(salted_b)
    assert not set(salted_a) & set(salted_b)
    assert salted_a == hash_prompt_blocks(LONG, 4, "m", cache_salt="a")


def test_lora_chains_share_no_hash_with_base() -> None:
    base = hash_prompt_blocks(LONG, 4, "m")
    lora_a = hash_prompt_blocks(LONG, 4, "m", lora="a")
    lora_b = hash_prompt_blocks(LONG, 4, "m", lora="b")
    assert not set(base) & set(lora_a)
    assert not set(base) & set(lora_b)
    assert not set(lora_a) & set(lora_b)


def test_namespaces_share_no_hash() -> None:
    assert not set(hash_prompt_blocks(LONG, 4, "m")) & set(hash_prompt_blocks(LONG, 4, "m2"))


def test_lora_and_salt_fields_cannot_be_confused() -> None:
    as_lora = hash_prompt_blocks(LONG, 4, "m", lora="x")
    as_salt = hash_prompt_blocks(LONG, 4, "m", cache_salt="x")
    assert as_lora[0] != as_salt[0]


def test_mm_content_is_part_of_the_name() -> None:
    one = hash_prompt_blocks(LONG, 4, "m", mm_items=[MMItem(b"cat", 8, 8)])
    other = hash_prompt_blocks(LONG, 4, "m", mm_items=[MMItem(b"dog", 8, 8)])
    plain = hash_prompt_blocks(LONG, 4, "m")
    assert one[:2] == other[:2] == plain[:2]  # blocks before the item
    assert not set(one[2:]) & set(other[2:])
    assert not set(one[2:]) & set(plain[2:])


@pytest.mark.parametrize("extras", [{}, {"lora": "l"}, {"cache_salt": "s"}])
@pytest.mark.parametrize("diverge_at", [0, 1, 15, 16, 17, 40, 63])
def test_shared_prefix_shares_exactly_the_leading_blocks(extras: dict, diverge_at: int) -> None:
    block_size = 16
    other = list(LONG)
    other[diverge_at] += 1
    a = hash_prompt_blocks(LONG, block_size, "m", **extras)
    b = hash_prompt_blocks(other, block_size, "m", **extras)
    shared = diverge_at // block_size
    assert a[:shared] == b[:shared]
    assert not set(a[shared:]) & set(b[shared:])


# --- validation of the hasher and its items --------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher("m", block_size)
    with pytest.raises(ValueError, match="block_size"):
        hash_prompt_blocks(LONG, block_size, "m")


def test_empty_lora_and_salt_are_rejected() -> None:
    with pytest.raises(ValueError, match="lora"):
        BlockHasher("m", lora="")
    with pytest.raises(ValueError, match="cache_salt"):
        BlockHasher("m", cache_salt="")
    with pytest.raises(ValueError, match="lora"):
        hash_prompt_blocks(LONG, 4, "m", lora="")
    with pytest.raises(ValueError, match="cache_salt"):
        hash_prompt_blocks(LONG, 4, "m", cache_salt="")
    assert not BlockHasher("m", lora=None, cache_salt=None).has_extras


def test_mm_item_validation() -> None:
    with pytest.raises(ValueError, match="content_hash"):
        MMItem(b"", 0, 1)
    with pytest.raises(ValueError, match="offset"):
        MMItem(b"h", -1, 1)
    with pytest.raises(ValueError, match="offset"):
        MMItem(b"h", 2**32, 1)
    with pytest.raises(ValueError, match="length"):
        MMItem(b"h", 0, 0)
    with pytest.raises(ValueError, match="length"):
        MMItem(b"h", 0, -3)
    assert MMItem(b"h", 2**32 - 1, 1).offset == 2**32 - 1


def test_hasher_defaults() -> None:
    hasher = BlockHasher("m")
    assert hasher.block_size == 16
    assert hasher.root == root_hash("m")
    assert not hasher.has_extras
    assert BlockHasher("m", mm_items=(MMItem(b"h", 0, 1),)).has_extras
