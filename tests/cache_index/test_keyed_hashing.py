"""Keyed block names (blake2b-keyed): known answers computed here with hashlib alone, the chain,
keys kept apart, and how a fleet token picks the mode."""

from __future__ import annotations

import hashlib
import pickle
import struct

import numpy as np
import pytest

from kvswitch.app.cli import build_parser
from kvswitch.app.cli_args import ConfigError, config_from_args
from kvswitch.cache_index.hashing import (
    BLAKE2B_KEYED,
    XXH3,
    XXH3_NAMING,
    BlockHasher,
    BlockNaming,
    MMItem,
    derive_key,
    hash_block_tokens,
    hash_prompt_blocks,
    root_hash,
)
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.router.server import RouterConfig
from kvswitch.worker.server import WorkerConfig

TOKEN = "fleet-secret"
KEYED = BlockNaming.from_fleet_token(TOKEN)


def reference_key(token: str) -> bytes:
    """docs/HASHING.md's derivation, written out with hashlib."""
    return hashlib.blake2b(token.encode(), digest_size=32, person=b"kvswitch-blocks").digest()


def h(key: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=16).digest()


def test_the_key_is_derived_from_the_token_not_the_token_itself() -> None:
    key = reference_key(TOKEN)
    assert derive_key(TOKEN) == key == KEYED.key
    assert key.hex() == "07122c1aa38e0c7affcd92d2cfe0a70c077696dcf783d9516b2cb9236836e9dc"
    assert TOKEN.encode() not in key
    expected_id = hashlib.blake2b(key, digest_size=8, person=b"kvswitch-keyid").hexdigest()
    assert KEYED.key_id == expected_id == "cc85fdac2d91c512"
    assert KEYED.describe() == f"blake2b-keyed (key {expected_id})"
    # Neither the key nor the token ever shows in a repr.
    assert key.hex() not in repr(KEYED) and repr(key) not in repr(KEYED)


def test_known_answers_plain_chain() -> None:
    """HASHING.md's worked example (namespace test-model, B = 4, tokens 1..10), keyed."""
    key = reference_key(TOKEN)
    root = h(key, b"kvswitch/v1\x00test-model")
    h0 = h(key, root + struct.pack("<4I", 1, 2, 3, 4))
    h1 = h(key, h0 + struct.pack("<4I", 5, 6, 7, 8))
    assert root_hash("test-model", KEYED) == root
    assert hash_prompt_blocks(list(range(1, 11)), 4, "test-model", naming=KEYED) == [h0, h1]
    # Pinned, for implementations in other languages (docs/HASHING.md).
    assert [x.hex() for x in (root, h0, h1)] == [
        "fc83c6a61666224c58e16b2e4c02f59a",
        "32645fbc11de150d38021b86f0fa4ba2",
        "fc44844c95d428300d68e19bbec880a7",
    ]


def test_known_answers_with_extra_keys() -> None:
    """The extra keys are the same TLV fields as with xxh3, under the keyed hash."""
    key = reference_key(TOKEN)
    tokens = list(range(100, 112))  # 3 blocks of 4
    item = MMItem(b"\x01\x02", offset=2, length=3)  # [2, 5): blocks 0 and 1
    lora = b"\x01" + struct.pack("<I", 2) + b"ad"
    salt = b"\x02" + struct.pack("<I", 1) + b"s"
    image = b"\x03" + struct.pack("<I", 6) + struct.pack("<I", 2) + b"\x01\x02"
    extras = [lora + salt + image, lora + image, lora]
    parent = h(key, b"kvswitch/v1\x00m")
    expected = []
    for i, extra in enumerate(extras):
        parent = h(key, parent + struct.pack("<4I", *tokens[4 * i : 4 * i + 4]) + extra)
        expected.append(parent)
    got = hash_prompt_blocks(
        tokens, 4, "m", lora="ad", cache_salt="s", mm_items=[item], naming=KEYED
    )
    assert got == expected


def test_chain_property_and_incremental_hashing() -> None:
    tokens = np.arange(40, dtype=np.uint32)
    hasher = BlockHasher("m", 4, cache_salt="t", naming=KEYED)
    chain = hasher.hash_blocks(tokens)
    assert len(chain) == 10
    parent = hasher.root
    for i, name in enumerate(chain):
        assert name == hash_block_tokens(
            parent, tokens[4 * i : 4 * i + 4], hasher.block_extra(i), KEYED
        )
        parent = name
    grown = chain[:3] + hasher.hash_blocks(tokens, chain[:3])
    assert grown == chain
    # The same prefix gives the same names; a changed token changes its block and every later one.
    changed = tokens.copy()
    changed[17] = 999
    other = hasher.hash_blocks(changed)
    assert other[:4] == chain[:4]
    assert not set(other[4:]) & set(chain)


def test_two_keys_and_xxh3_give_disjoint_names() -> None:
    tokens = list(range(64))
    one = hash_prompt_blocks(tokens, 4, "m", naming=KEYED)
    two = hash_prompt_blocks(tokens, 4, "m", naming=BlockNaming.from_fleet_token(TOKEN + "!"))
    plain = hash_prompt_blocks(tokens, 4, "m")
    assert plain == hash_prompt_blocks(tokens, 4, "m", naming=XXH3_NAMING)
    assert len(set(one) | set(two) | set(plain)) == 3 * 16


def test_a_fleet_token_switches_the_default_to_keyed() -> None:
    assert BlockNaming.from_fleet_token("") == XXH3_NAMING
    assert BlockNaming.from_fleet_token(TOKEN).mode == BLAKE2B_KEYED
    assert BlockNaming.from_fleet_token(TOKEN, XXH3) == XXH3_NAMING  # forced
    with pytest.raises(ValueError, match="blake2b-keyed needs a key"):
        BlockNaming.from_fleet_token("", BLAKE2B_KEYED)
    with pytest.raises(ValueError, match="block_hash must be one of"):
        BlockNaming.from_fleet_token(TOKEN, "sha1")
    assert RouterConfig().block_naming() == XXH3_NAMING
    assert RouterConfig(fleet_token=TOKEN).block_naming() == KEYED
    assert WorkerConfig(fleet_token=TOKEN).block_naming() == KEYED
    # The engine core (another process) gets the key in its config.
    engine_config = WorkerConfig(fleet_token=TOKEN).engine_config()
    assert pickle.loads(pickle.dumps(engine_config)).block_naming == KEYED


@pytest.mark.parametrize("command", ["router", "worker"])
def test_the_flag_without_a_fleet_token_is_refused(command: str) -> None:
    from kvswitch.router import server as router_server
    from kvswitch.worker import server as worker_server

    config_cls = router_server.RouterConfig if command == "router" else worker_server.WorkerConfig
    args = build_parser(command).parse_args([command, "--block-hash", "blake2b-keyed"])
    with pytest.raises(ConfigError, match="--block-hash blake2b-keyed needs a key"):
        config_from_args(config_cls, args)
    args = build_parser(command).parse_args([command, "--fleet-token", TOKEN])
    assert config_from_args(config_cls, args).block_naming() == KEYED


def test_worker_info_says_how_it_names_blocks() -> None:
    assert WorkerInfo("w", "x:1", "m", 4).names_blocks_as(XXH3_NAMING)  # older: xxh3
    keyed = WorkerInfo("w", "x:1", "m", 4, block_hash=KEYED.mode, block_hash_key_id=KEYED.key_id)
    assert keyed.names_blocks_as(KEYED)
    assert not keyed.names_blocks_as(XXH3_NAMING)
    assert not keyed.names_blocks_as(BlockNaming.from_fleet_token("another"))
    with pytest.raises(ValueError, match="block_hash_key_id"):
        WorkerInfo("w", "x:1", "m", 4, block_hash=BLAKE2B_KEYED)
    with pytest.raises(ValueError, match="block_hash must be one of"):
        WorkerInfo("w", "x:1", "m", 4, block_hash="md5")
