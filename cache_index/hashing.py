"""Chained block hashes: the one implementation the router, workers and index share.

A prompt is cut into full blocks of ``block_size`` tokens. Block ``i`` is named by a 16-byte
xxh3-128 digest of its parent's name, its own tokens and its extra keys, so equal names mean equal
prefixes (up to hash collisions) and the cache needs no tree::

    tokens   | t0 ... t15 | t16 ... t31 | t32 ... t47 | t48 t49 (partial: never hashed)
    hash     |     h0     |     h1      |     h2      |
    parent   |   root     |     h0      |     h1      |

    root = xxh3_128(b"kvswitch/v1\\0" + namespace)
    h_i  = xxh3_128(parent + tokens_i as little-endian uint32 + extra_i)

The extra keys (LoRA adapter, cache salt, multimodal items) and their byte encoding are described
in ``docs/HASHING.md``; with none of them, ``extra_i`` is empty.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from xxhash import xxh3_128_digest

HASH_BYTES = 16
DEFAULT_BLOCK_SIZE = 16
ROOT_DOMAIN = b"kvswitch/v1\x00"

# Tags of the extra-key fields, in the order they are written.
TAG_LORA = 0x01
TAG_CACHE_SALT = 0x02
TAG_MM_ITEM = 0x03

_FIELD_HEADER = struct.Struct("<BI")  # tag: u8, payload length: u32
_U32 = struct.Struct("<I")
_MAX_U32 = 0xFFFF_FFFF

TokenIds = Sequence[int] | np.ndarray


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
def root_hash(namespace: str) -> bytes:
    """The parent of a chain's first block; ``namespace`` is the model name."""
    return xxh3_128_digest(ROOT_DOMAIN + namespace.encode("utf-8"))


def hash_block_tokens(parent: bytes, tokens: TokenIds, extra: bytes = b"") -> bytes:
    """The 16-byte name of one block, given its parent's name, its tokens and its extra keys."""
    return xxh3_128_digest(parent + tokens_to_bytes(tokens) + extra)


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
        return root_hash(self.namespace)

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
        if not self.has_extras:
            # NOTE: the hot path for plain text prompts: one slice, one concat, one digest a block.
            for start in range(0, len(data), step):
                parent = xxh3_128_digest(parent + data[start : start + step])
                append(parent)
            return hashes
        for i, start in enumerate(range(0, len(data), step), start=first):
            parent = xxh3_128_digest(parent + data[start : start + step] + self.block_extra(i))
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
) -> list[bytes]:
    """The chain of hashes over all full blocks of a prompt."""
    hasher = BlockHasher(namespace, block_size, lora, cache_salt, tuple(mm_items))
    return hasher.hash_blocks(tokens)
