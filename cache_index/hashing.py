"""Chained block hashes: the one implementation the router, workers and index share.

A prompt is cut into full blocks of ``block_size`` tokens. Block ``i`` is named by a 16-byte
digest of its parent's name, its own tokens and its extra keys, so equal names mean equal
prefixes (up to hash collisions) and the cache needs no tree::

    tokens   | t0 ... t15 | t16 ... t31 | t32 ... t47 | t48 t49 (partial: never hashed)
    hash     |     h0     |     h1      |     h2      |
    parent   |   root     |     h0      |     h1      |

    root = H(b"kvswitch/v1\\0" + namespace)
    h_i  = H(parent + tokens_i as little-endian uint32 + extra_i)

``H`` is the fleet's ``BlockNaming``: xxh3-128 (fast, unkeyed: anyone can build two prompts whose
blocks collide), or BLAKE2b-128 keyed with a secret derived from the fleet token, whose names no
one without the key can predict, let alone make collide. The extra keys (LoRA adapter, cache
salt, multimodal items) and their byte encoding are described in ``docs/HASHING.md``; with none
of them, ``extra_i`` is empty.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from xxhash import xxh3_128_digest

HASH_BYTES = 16
DEFAULT_BLOCK_SIZE = 16
ROOT_DOMAIN = b"kvswitch/v1\x00"

# Tags of the extra-key fields, in the order they are written.
TAG_LORA = 0x01
TAG_CACHE_SALT = 0x02
TAG_MM_ITEM = 0x03
TAG_ENGINE_EXTRA = 0x04  # what another engine hashed into a block besides tokens and adapter

_FIELD_HEADER = struct.Struct("<BI")  # tag: u8, payload length: u32
_U32 = struct.Struct("<I")
_MAX_U32 = 0xFFFF_FFFF

TokenIds = Sequence[int] | np.ndarray

# The two ways to name blocks (``BlockNaming.mode``).
XXH3 = "xxh3"
BLAKE2B_KEYED = "blake2b-keyed"
HASH_MODES = (XXH3, BLAKE2B_KEYED)
# BLAKE2b personalizations (at most 16 bytes): each use of a secret gets its own, so that the
# fleet token, the block-hash key and the key's public id never stand for each other.
KEY_PERSON = b"kvswitch-blocks"
KEY_ID_PERSON = b"kvswitch-keyid"
KEY_BYTES = 32
KEY_ID_BYTES = 8


@dataclass(frozen=True, slots=True)
class BlockNaming:
    """Which hash names blocks: ``xxh3`` (no key) or ``blake2b-keyed`` (BLAKE2b, 16-byte digests,
    keyed with ``key``). Every router and worker of a fleet must use the same one, key included:
    their names are otherwise never equal (``key_id`` tells them apart without showing the key).
    """

    mode: str = XXH3
    key: bytes = field(default=b"", repr=False)  # NOTE: never printed or logged
    # H(data) -> 16 bytes, built once from mode and key.
    digest: Callable[[bytes], bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in HASH_MODES:
            raise ValueError(
                f"block_hash must be one of {', '.join(HASH_MODES)}, got {self.mode!r}"
            )
        if self.mode == XXH3:
            if self.key:
                raise ValueError("xxh3 block names take no key")
            digest: Callable[[bytes], bytes] = xxh3_128_digest
        else:
            if not 16 <= len(self.key) <= 64:
                raise ValueError(
                    f"a blake2b-keyed key is 16 to 64 bytes, got {len(self.key)}: derive it "
                    "with BlockNaming.from_fleet_token"
                )
            digest = _keyed_blake2b(self.key)
        object.__setattr__(self, "digest", digest)

    def __reduce__(self) -> tuple:
        # NOTE: rebuilt from mode and key (an engine core process receives it in its config);
        # the digest function is a closure, which pickle cannot carry.
        return (BlockNaming, (self.mode, self.key))

    @classmethod
    def from_fleet_token(cls, fleet_token: str, mode: str = "") -> BlockNaming:
        """The naming a process with ``fleet_token`` uses: ``mode`` empty picks blake2b-keyed
        when there is a token and xxh3 when there is none. The key is derived from the token
        (``derive_key``), never the token itself. ValueError for blake2b-keyed without a token."""
        if not mode:
            mode = BLAKE2B_KEYED if fleet_token else XXH3
        if mode == BLAKE2B_KEYED:
            if not fleet_token:
                raise ValueError(
                    "block_hash blake2b-keyed needs a key, derived from the fleet token: set "
                    "--fleet-token or KVSWITCH_FLEET_TOKEN (the same on every router and worker)"
                )
            return cls(BLAKE2B_KEYED, derive_key(fleet_token))
        return cls(mode)

    @property
    def key_id(self) -> str:
        """A public fingerprint of the key (16 hex digits), empty for xxh3: what registrations
        carry so that routers and workers can check they agree without showing the key."""
        if not self.key:
            return ""
        return hashlib.blake2b(self.key, digest_size=KEY_ID_BYTES, person=KEY_ID_PERSON).hexdigest()

    def describe(self) -> str:
        """``xxh3``, or ``blake2b-keyed (key <key_id>)``: for messages and logs."""
        return self.mode if not self.key else f"{self.mode} (key {self.key_id})"


def derive_key(fleet_token: str) -> bytes:
    """The block-hash key of a fleet token: BLAKE2b-256 of its UTF-8 bytes, personalized
    ``kvswitch-blocks``. One-way: the key (or a name made with it) does not give the token."""
    return hashlib.blake2b(
        fleet_token.encode("utf-8"), digest_size=KEY_BYTES, person=KEY_PERSON
    ).digest()


def _keyed_blake2b(key: bytes) -> Callable[[bytes], bytes]:
    # NOTE: a keyed BLAKE2b spends one compression on the key block before any data; copying a
    # state that has it already halves the work for a block of 16 tokens.
    keyed = hashlib.blake2b(key=key, digest_size=HASH_BYTES)

    def digest(data: bytes) -> bytes:
        state = keyed.copy()
        state.update(data)
        return state.digest()

    return digest


XXH3_NAMING = BlockNaming()


@dataclass(frozen=True, slots=True)
class MMItem:
    """A multimodal input occupying ``length`` placeholder tokens from prompt position ``offset``.

    ``content_hash`` identifies the content (e.g. a digest of the image bytes): two items with the
    same placeholders but different content must never share a block.
    """

    content_hash: bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.content_hash:
            raise ValueError("MMItem.content_hash must not be empty")
        if not 0 <= self.offset <= _MAX_U32:
            raise ValueError(f"MMItem.offset must be in [0, 2**32), got {self.offset}")
        if self.length <= 0:
            raise ValueError(f"MMItem.length must be positive, got {self.length}")


@functools.lru_cache(maxsize=64)
def root_hash(namespace: str, naming: BlockNaming = XXH3_NAMING) -> bytes:
    """The parent of a chain's first block; ``namespace`` is the model name."""
    return naming.digest(ROOT_DOMAIN + namespace.encode("utf-8"))


def hash_block_tokens(
    parent: bytes, tokens: TokenIds, extra: bytes = b"", naming: BlockNaming = XXH3_NAMING
) -> bytes:
    """The 16-byte name of one block, given its parent's name, its tokens and its extra keys."""
    return naming.digest(parent + tokens_to_bytes(tokens) + extra)


def tokens_to_bytes(tokens: TokenIds) -> bytes:
    """Tokens as little-endian uint32 bytes; raises ValueError for ids outside [0, 2**32)."""
    if isinstance(tokens, np.ndarray):
        _check_token_array(tokens)
        if tokens.dtype != np.uint32 and tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high > _MAX_U32:
                raise ValueError(f"token ids must be in [0, 2**32), got range [{low}, {high}]")
        return tokens.astype("<u4", copy=False).tobytes()
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None


def tokens_from_bytes(data: bytes) -> np.ndarray:
    """The token ids ``tokens_to_bytes`` wrote: a read-only uint32 view of ``data``, no copy.
    ValueError if ``data`` is not a whole number of 4-byte ids."""
    if len(data) % 4:
        raise ValueError(
            f"token ids as little-endian uint32 take 4 bytes each; got {len(data)} bytes"
        )
    return np.frombuffer(data, "<u4")


def _check_token_array(tokens: np.ndarray) -> None:
    """Rejects arrays that are not 1-D integer arrays, whatever their length."""
    if tokens.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")


def _field(tag: int, payload: bytes) -> bytes:
    return _FIELD_HEADER.pack(tag, len(payload)) + payload


def engine_extra_field(payload: bytes) -> bytes:
    """The extra-key bytes for what another engine (vLLM) hashed into a block besides its
    tokens and LoRA adapter, ``payload`` encoding it: a block with it never shares a name with
    one without."""
    return _field(TAG_ENGINE_EXTRA, payload)


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Everything besides the tokens that names a request's blocks.

    ``hash_blocks`` extends an existing chain, so a decoding request hashes each block once, the
    moment it becomes full.
    """

    namespace: str
    block_size: int = DEFAULT_BLOCK_SIZE
    lora: str | None = None
    cache_salt: str | None = None
    mm_items: tuple[MMItem, ...] = ()
    naming: BlockNaming = XXH3_NAMING

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.lora == "":
            raise ValueError("lora must be None or a non-empty adapter name")
        if self.cache_salt == "":
            raise ValueError("cache_salt must be None or a non-empty string")
        # NOTE: a canonical order makes the hash independent of how the caller listed the items.
        ordered = tuple(sorted(self.mm_items, key=lambda m: (m.offset, m.content_hash)))
        object.__setattr__(self, "mm_items", ordered)

    @property
    def root(self) -> bytes:
        return root_hash(self.namespace, self.naming)

    @property
    def has_extras(self) -> bool:
        return self.lora is not None or self.cache_salt is not None or bool(self.mm_items)

    def block_extra(self, block_index: int) -> bytes:
        """The extra-key bytes of block ``block_index`` (``b""`` when there are none)."""
        parts: list[bytes] = []
        if self.lora is not None:
            parts.append(_field(TAG_LORA, self.lora.encode("utf-8")))
        if self.cache_salt is not None and block_index == 0:
            parts.append(_field(TAG_CACHE_SALT, self.cache_salt.encode("utf-8")))
        start = block_index * self.block_size
        end = start + self.block_size
        for item in self.mm_items:
            if item.offset >= end:
                break
            if item.offset + item.length > start:
                parts.append(_field(TAG_MM_ITEM, _U32.pack(item.offset) + item.content_hash))
        return b"".join(parts)

    def hash_blocks(self, tokens: TokenIds, prefix: Sequence[bytes] = ()) -> list[bytes]:
        """Hashes of the full blocks of ``tokens`` past the ``len(prefix)`` already hashed.

        ``prefix`` is the chain of the leading blocks (as returned by an earlier call); the
        returned list holds only the new hashes, in order.
        """
        if isinstance(tokens, np.ndarray):
            # NOTE: checked here too, or a bad array shorter than one block would pass unnoticed.
            _check_token_array(tokens)
        block_size = self.block_size
        first = len(prefix)
        num_blocks = len(tokens) // block_size
        if num_blocks <= first:
            return []
        data = tokens_to_bytes(tokens[first * block_size : num_blocks * block_size])
        parent = prefix[-1] if prefix else self.root
        step = block_size * 4
        hashes: list[bytes] = []
        append = hashes.append
        digest = self.naming.digest
        if not self.has_extras:
            # NOTE: the hot path for plain text prompts: one slice, one concat, one digest a block.
            for start in range(0, len(data), step):
                parent = digest(parent + data[start : start + step])
                append(parent)
            return hashes
        for i, start in enumerate(range(0, len(data), step), start=first):
            parent = digest(parent + data[start : start + step] + self.block_extra(i))
            append(parent)
        return hashes


def hash_prompt_blocks(
    tokens: TokenIds,
    block_size: int,
    namespace: str,
    *,
    lora: str | None = None,
    cache_salt: str | None = None,
    mm_items: Iterable[MMItem] = (),
    naming: BlockNaming = XXH3_NAMING,
) -> list[bytes]:
    """The chain of hashes over all full blocks of a prompt."""
    hasher = BlockHasher(namespace, block_size, lora, cache_salt, tuple(mm_items), naming)
    return hasher.hash_blocks(tokens)
