#!/usr/bin/env python3
"""Write ``hash_vectors.json``: reference vectors for kvswitch block hashing (docs/HASHING.md).

This script is deliberately standalone. It computes every expected value with its own short
reading of the specification, using nothing but ``xxhash`` and ``struct``, and it never imports
``cache_index``, so the vectors check the project's implementation instead of echoing it.

Run from anywhere; the JSON is written next to this file::

    python tests/data/make_hash_vectors.py
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import xxhash

OUT_PATH = Path(__file__).with_name("hash_vectors.json")

DOMAIN = b"kvswitch/v1\x00"
LORA_TAG = 1
SALT_TAG = 2
MM_TAG = 3
U32_MAX = 2**32 - 1


# --- the specification, written out plainly --------------------------------------------------


def spec_root(namespace: str) -> bytes:
    return xxhash.xxh3_128_digest(DOMAIN + namespace.encode("utf-8"))


def spec_tlv(tag: int, payload: bytes) -> bytes:
    return struct.pack("<B", tag) + struct.pack("<I", len(payload)) + payload


def spec_extra(
    index: int,
    block_size: int,
    lora: str | None,
    salt: str | None,
    items: list[tuple[bytes, int, int]],
) -> bytes:
    """Extra-key bytes of block ``index``; ``items`` are (content_hash, offset, length)."""
    out = b""
    if lora is not None:
        out += spec_tlv(LORA_TAG, lora.encode("utf-8"))
    if salt is not None and index == 0:
        out += spec_tlv(SALT_TAG, salt.encode("utf-8"))
    lo = index * block_size
    hi = lo + block_size
    for content_hash, offset, length in sorted(items, key=lambda it: (it[1], it[0])):
        if offset < hi and offset + length > lo:
            out += spec_tlv(MM_TAG, struct.pack("<I", offset) + content_hash)
    return out


def spec_chain(
    tokens: list[int],
    block_size: int,
    namespace: str,
    lora: str | None,
    salt: str | None,
    items: list[tuple[bytes, int, int]],
) -> tuple[list[bytes], list[bytes]]:
    """(extra bytes per full block, hash per full block)."""
    extras: list[bytes] = []
    chain: list[bytes] = []
    parent = spec_root(namespace)
    for index in range(len(tokens) // block_size):
        block = tokens[index * block_size : (index + 1) * block_size]
        assert all(0 <= t <= U32_MAX for t in block)
        extra = spec_extra(index, block_size, lora, salt, items)
        parent = xxhash.xxh3_128_digest(parent + struct.pack(f"<{block_size}I", *block) + extra)
        extras.append(extra)
        chain.append(parent)
    return extras, chain


# --- the cases -------------------------------------------------------------------------------


def pseudo_tokens(count: int, seed: int, vocab: int = 152_000) -> list[int]:
    """Deterministic token ids (a tiny LCG); only used to fill the lists stored in the JSON."""
    state = seed
    out = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((state >> 33) % vocab)
    return out


IMAGE = hashlib.sha256(b"kvswitch test image: cat.png").digest()  # 32-byte content hash
AUDIO = xxhash.xxh3_128_digest(b"kvswitch test audio: hello.wav")  # 16-byte content hash
SMALL = bytes.fromhex("a1b2c3d4")  # content hashes may have any non-zero length

CASES: list[dict] = [
    {
        "name": "empty_namespace",
        "note": "namespace '' still gets the domain prefix: root = xxh3_128(b'kvswitch/v1\\0')",
        "namespace": "",
        "block_size": 4,
        "tokens": list(range(1, 13)),
    },
    {
        "name": "unicode_namespace",
        "note": "the namespace is hashed as UTF-8",
        "namespace": "Qwen2.5-7B-Instruct ünïcødé 模型 🚀",
        "block_size": 4,
        "tokens": list(range(1, 13)),
    },
    {
        "name": "extreme_token_ids",
        "note": "0 and 2**32-1 are valid ids",
        "namespace": "test-model",
        "block_size": 4,
        "tokens": [0, U32_MAX, 0, U32_MAX, U32_MAX, U32_MAX, U32_MAX, U32_MAX, 0, 0, 0, 0],
    },
    {
        "name": "block_size_1",
        "note": "every token is a block",
        "namespace": "test-model",
        "block_size": 1,
        "tokens": [7, 0, 151_999, 42, 42],
    },
    {
        "name": "block_size_4_worked_example",
        "note": "the worked example of docs/HASHING.md: the 2 trailing tokens are not hashed",
        "namespace": "test-model",
        "block_size": 4,
        "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    },
    {
        "name": "block_size_16_partial_tail",
        "note": "40 tokens: two full blocks, the last 8 tokens are not hashed",
        "namespace": "meta-llama/Llama-3.1-8B-Instruct",
        "block_size": 16,
        "tokens": pseudo_tokens(40, seed=1),
    },
    {
        "name": "shorter_than_one_block",
        "note": "no full block: the chain is empty",
        "namespace": "test-model",
        "block_size": 16,
        "tokens": pseudo_tokens(15, seed=2),
    },
    {
        "name": "lora_only",
        "note": "the LoRA field is on every block",
        "namespace": "test-model",
        "block_size": 4,
        "lora": "sql-adapter",
        "tokens": list(range(1, 13)),
    },
    {
        "name": "salt_only",
        "note": "the salt is on block 0 only, yet every hash differs from the unsalted chain",
        "namespace": "test-model",
        "block_size": 4,
        "cache_salt": "tenant-42",
        "tokens": list(range(1, 13)),
    },
    {
        "name": "lora_salt_two_mm_items",
        "note": (
            "image [2, 8) overlaps blocks 0 and 1 (and ends exactly where block 2 starts); "
            "audio [9, 11) lies inside block 2; block 3 carries only the LoRA field"
        ),
        "namespace": "test-model",
        "block_size": 4,
        "lora": "vision-lora",
        "cache_salt": "s",
        "mm_items": [(IMAGE, 2, 6), (AUDIO, 9, 2)],
        "tokens": list(range(100, 118)),
    },
    {
        "name": "mm_items_out_of_order",
        "note": (
            "items are listed out of order; they are written sorted by (offset, content_hash): "
            "the two at offset 4 are ordered by their content hash bytes"
        ),
        "namespace": "test-model",
        "block_size": 4,
        "mm_items": [(IMAGE, 9, 2), (SMALL, 4, 1), (AUDIO, 4, 3), (IMAGE, 0, 1)],
        "tokens": list(range(100, 112)),
    },
    {
        "name": "all_extras_block_size_16",
        "note": (
            "block size 16 with a UTF-8 LoRA name, a salt, an item spanning blocks 0-2 and an "
            "item starting in the unhashed tail"
        ),
        "namespace": "meta-llama/Llama-3.1-8B-Instruct",
        "block_size": 16,
        "lora": "résumé-lora",
        "cache_salt": "user:1234",
        "mm_items": [(IMAGE, 5, 40), (AUDIO, 50, 8)],
        "tokens": pseudo_tokens(54, seed=3),
    },
]


def build_vector(case: dict) -> dict:
    lora = case.get("lora")
    salt = case.get("cache_salt")
    items = case.get("mm_items", [])
    extras, chain = spec_chain(
        case["tokens"], case["block_size"], case["namespace"], lora, salt, items
    )
    return {
        "name": case["name"],
        "note": case["note"],
        "namespace": case["namespace"],
        "block_size": case["block_size"],
        "lora": lora,
        "cache_salt": salt,
        "mm_items": [
            {"content_hash": h.hex(), "offset": offset, "length": length}
            for h, offset, length in items
        ],
        "tokens": case["tokens"],
        "root": spec_root(case["namespace"]).hex(),
        "extras": [e.hex() for e in extras],
        "chain": [h.hex() for h in chain],
    }


def render(vectors: list[dict]) -> str:
    """JSON with one field a line, so that diffs of the file stay readable."""
    blocks = []
    for vector in vectors:
        fields = [
            f"      {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in vector.items()
        ]
        blocks.append("    {\n" + ",\n".join(fields) + "\n    }")
    header = {
        "spec": "docs/HASHING.md",
        "generator": "tests/data/make_hash_vectors.py",
        "hash": "xxh3_128, 16-byte digests, hex-encoded",
    }
    head = "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in header.items())
    return "{\n" + head + '  "vectors": [\n' + ",\n".join(blocks) + "\n  ]\n}\n"


def main() -> None:
    vectors = [build_vector(case) for case in CASES]
    assert len({v["name"] for v in vectors}) == len(vectors)
    text = render(vectors)
    assert json.loads(text)["vectors"] == vectors
    OUT_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {len(vectors)} vectors ({len(text.encode())} bytes) to {OUT_PATH}")


if __name__ == "__main__":
    main()
