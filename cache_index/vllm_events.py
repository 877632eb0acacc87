"""vLLM's KV cache events, as a vLLM engine publishes them, read and named the way kvswitch names
blocks.

A vLLM server started with ``--kv-events-config`` publishes one message per scheduler step that
changed its prefix cache, three ZeroMQ frames ``[topic, seq, payload]`` (``seq`` 8 bytes
big-endian, from 0 in each process). The payload is msgpack, a batch of events, in one of two
shapes, both read here (fields this code does not know are ignored)::

    batch: {"ts": float, "events": [...], "data_parallel_rank": int}   (a map), or
           [ts, events, data_parallel_rank]                           (an array; older servers)
    event: {"type": "BlockStored", "block_hashes": [...], ...}         (a tagged map), or
           ["BlockStored", block_hashes, parent_block_hash, ...]      (a tagged array, in the
                                                                       fields' order below)

vLLM names a block by a hash kvswitch cannot compute (SHA-256 over pickled tuples, seeded per
process in older versions, 64 bits of it on the wire), so ``EngineBlockNames`` gives each block
kvswitch's own chained name (``hashing.py``), computed from the event's tokens, LoRA adapter and
extra keys and its parent's name, and keeps the engine's name -> kvswitch's, so that a removal,
or a stored event of another tier that carries no tokens, can be resolved. The index and the
router only ever see kvswitch's names: a request to the engine hashes to the same ones.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvswitch.cache_index.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from kvswitch.cache_index.hashing import (
    XXH3_NAMING,
    BlockHasher,
    BlockNaming,
    engine_extra_field,
    hash_block_tokens,
)

# An engine's name for a block: a 64-bit int by default, bytes where it sends whole digests.
EngineHash = int | bytes
GPU = "GPU"


class EngineEventError(ValueError):
    """A payload that is not a batch of vLLM KV events."""


class BlockSizeMismatch(ValueError):
    """An engine's blocks are not the size the router hashes prompts in: every name computed
    from them would be wrong."""


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]  # the blocks' tokens, concatenated; empty from a tier that has none
    block_size: int  # 0 where the tier sends no tokens
    lora_name: str | None = None
    medium: str | None = None  # "GPU", "CPU", ...; None: GPU
    extra_keys: tuple[Any, ...] | None = None  # one entry per block (a tuple, or None)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EngineAllBlocksCleared:
    pass


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineEventBatch:
    ts: float
    events: tuple[EngineEvent, ...]
    data_parallel_rank: int | None = None


# Each event's fields in the order a tagged array lists them after its tag (vLLM's field order).
_FIELDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "BlockStored": (
        EngineBlockStored,
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
        ),
    ),
    "BlockRemoved": (EngineBlockRemoved, ("block_hashes", "medium", "group_idx")),
    "AllBlocksCleared": (EngineAllBlocksCleared, ()),
}


def decode_batch(payload: bytes) -> EngineEventBatch:
    """A published payload's batch; ``EngineEventError`` saying what is wrong with it. Events of
    a type this code does not know are skipped."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise EngineEventError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise EngineEventError(f"a batch is a map or an array of ts and events, not {raw!r:.80}")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise EngineEventError(f"a batch's ts and events: {ts!r:.40}, {events!r:.80}")
    decoded = [event for event in map(_decode_event, events) if event is not None]
    return EngineEventBatch(float(ts), tuple(decoded), rank)


def _decode_event(raw: Any) -> EngineEvent | None:
    if isinstance(raw, dict):
        tag, values = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        values = dict(zip(_FIELDS.get(tag, (None, ()))[1], raw[1:], strict=False))
    else:
        raise EngineEventError(f"an event is a tagged map or a tagged array, not {raw!r:.80}")
    if tag not in _FIELDS:
        return None  # NOTE: a newer engine's event: the rest of the batch still counts
    kind, names = _FIELDS[tag]
    known = {f.name for f in dataclasses.fields(kind)}
    fields = {name: values[name] for name in names if name in known and name in values}
    try:
        if "block_hashes" in fields:
            fields["block_hashes"] = tuple(_engine_hash(h) for h in fields["block_hashes"])
        if fields.get("parent_block_hash") is not None:
            fields["parent_block_hash"] = _engine_hash(fields["parent_block_hash"])
        if "token_ids" in fields:
            fields["token_ids"] = tuple(int(t) for t in fields["token_ids"] or ())
        if fields.get("extra_keys") is not None:
            fields["extra_keys"] = tuple(
                None if keys is None else tuple(keys) for keys in fields["extra_keys"]
            )
        if kind is EngineBlockStored:
            fields.setdefault("parent_block_hash", None)
            fields.setdefault("token_ids", ())
            fields["block_size"] = int(fields.get("block_size") or 0)
        return kind(**fields)
    except (TypeError, ValueError) as e:
        raise EngineEventError(f"a {tag} event: {e}") from None


def _engine_hash(value: Any) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise ValueError(f"a block hash is an int or bytes, not {value!r:.40}")
    return value


def encode_batch(batch: EngineEventBatch, *, arrays: bool = False) -> bytes:
    """``batch`` as a vLLM engine publishes it: maps (``arrays`` False, as vLLM does since
    mid-2026) or arrays (as older servers did)."""
    events = [_encode_event(event, arrays) for event in batch.events]
    if arrays:
        return msgpack.packb([batch.ts, events, batch.data_parallel_rank])
    return msgpack.packb(
        {"ts": batch.ts, "events": events, "data_parallel_rank": batch.data_parallel_rank}
    )


def _encode_event(event: EngineEvent, arrays: bool) -> Any:
    tag = type(event).__name__.removeprefix("Engine")
    values = {
        name: (list(v) if isinstance(v, tuple) else v)
        for name, v in dataclasses.asdict(event).items()
    }
    values.setdefault("lora_id", None)
    if arrays:
        return [tag, *(values.get(name) for name in _FIELDS[tag][1])]
    return {"type": tag, **values}


@dataclass
class NamingStats:
    """What ``EngineBlockNames`` could not name, and what it left out."""

    num_stored: int = 0  # engine blocks named
    num_orphans: int = (
        0  # stored blocks whose parent (or, without tokens, whose own name) is unknown
    )
    num_skipped_groups: int = 0  # blocks of a KV cache group that is not full attention


@dataclass
class EngineBlockNames:
    """One engine's (one data-parallel rank's) blocks under kvswitch's names: ``apply`` turns
    its events into the ``CacheEvent`` s an index takes, by kvswitch name.

    ``namespace`` and ``block_size`` are the router's (the model's name, the blocks it hashes
    prompts in). A block stays named while any tier (``medium``) holds it; ``apply_tiers`` also
    says which of its blocks the GPU holds, once the engine has told of another tier
    (``tiered``: vLLM's CPU offloading), so that a router can weigh a CPU hit below a GPU one."""

    namespace: str
    block_size: int
    naming: BlockNaming = XXH3_NAMING
    stats: NamingStats = field(default_factory=NamingStats)
    tiered: bool = False  # a tier besides the GPU has held blocks
    # Engine name -> kvswitch name, and the tiers that hold the block.
    _names: dict[EngineHash, bytes] = field(default_factory=dict, repr=False)
    _media: dict[EngineHash, set[str]] = field(default_factory=dict, repr=False)
    # How many engine names each kvswitch name has (two, where the engine holds one prefix twice).
    _holders: Counter[bytes] = field(default_factory=Counter, repr=False)

    def __len__(self) -> int:
        return len(self._names)

    def name_of(self, engine_hash: EngineHash) -> bytes | None:
        return self._names.get(engine_hash)

    def media_of(self, engine_hash: EngineHash) -> set[str]:
        return set(self._media.get(engine_hash, ()))

    def block_names(self) -> set[bytes]:
        """Every block's kvswitch name: what a resync of the index sends."""
        return set(self._names.values())

    def gpu_block_names(self) -> set[bytes]:
        """The names of the blocks the GPU tier holds: what a resync of the GPU's entry sends."""
        return {name for h, name in self._names.items() if _on_gpu(self._media.get(h, ()))}

    def clear(self) -> None:
        self._names.clear()
        self._media.clear()
        self._holders.clear()

    def apply(self, events: Sequence[EngineEvent]) -> list[CacheEvent]:
        """The index's events for these engine events, in order. ``BlockSizeMismatch`` on a
        stored event with tokens in blocks of another size: nothing of it is applied."""
        return self.apply_tiers(events)[0]

    def apply_tiers(
        self, events: Sequence[EngineEvent]
    ) -> tuple[list[CacheEvent], list[CacheEvent]]:
        """``apply``'s events (the blocks any tier holds), and those of the blocks the GPU
        holds, in order."""
        out: list[CacheEvent] = []
        gpu: list[CacheEvent] = []
        for event in events:
            if isinstance(event, EngineBlockStored):
                names = self._stored(event)
                if not names:
                    continue
                out.append(BlockStored(tuple(names)))
                if _on_gpu((event.medium or GPU,)):
                    gpu.append(BlockStored(tuple(names)))
                else:
                    self.tiered = True
            elif isinstance(event, EngineBlockRemoved):
                medium = event.medium or GPU
                left_gpu = []
                if _on_gpu((medium,)):
                    left_gpu = [
                        self._names[h]
                        for h in event.block_hashes
                        if h in self._names and _on_gpu(self._media.get(h, ()))
                    ]
                else:
                    self.tiered = True
                names = self._removed(event)
                if names:
                    out.append(BlockRemoved(tuple(names)))
                if left_gpu:
                    gpu.append(BlockRemoved(tuple(left_gpu)))
            else:
                self.clear()
                out.append(AllBlocksCleared())
                gpu.append(AllBlocksCleared())
        return out, gpu

    def _stored(self, event: EngineBlockStored) -> list[bytes]:
        medium = event.medium or GPU
        if event.kv_cache_spec_kind and "full" not in event.kv_cache_spec_kind.lower():
            # NOTE: a sliding-window or other group's blocks do not hold a whole prefix.
            self.stats.num_skipped_groups += len(event.block_hashes)
            return []
        if not event.token_ids:
            return self._stored_elsewhere(event.block_hashes, medium)
        if event.block_size != self.block_size:
            raise BlockSizeMismatch(
                f"the engine's blocks hold {event.block_size} tokens, the router's "
                f"--block-size is {self.block_size}: set them equal"
            )
        if len(event.token_ids) != len(event.block_hashes) * self.block_size:
            raise EngineEventError(
                f"BlockStored: {len(event.token_ids)} tokens for {len(event.block_hashes)} "
                f"blocks of {self.block_size}"
            )
        if event.parent_block_hash is None:
            parent = BlockHasher(self.namespace, self.block_size, naming=self.naming).root
        else:
            known = self._names.get(event.parent_block_hash)
            if known is None:
                self.stats.num_orphans += len(event.block_hashes)
                return []
            parent = known
        lora = BlockHasher(
            self.namespace, self.block_size, lora=event.lora_name or None, naming=self.naming
        ).block_extra(0)
        names = []
        size = self.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * size : (i + 1) * size]
            extra = lora + self._engine_extra(event, i)
            parent = hash_block_tokens(parent, tokens, extra, self.naming)
            if self._names.get(engine_hash) != parent:
                self._forget(engine_hash)
                self._names[engine_hash] = parent
                self._holders[parent] += 1
            self._media.setdefault(engine_hash, set()).add(medium)
            names.append(parent)
        self.stats.num_stored += len(names)
        return names

    def _engine_extra(self, event: EngineBlockStored, i: int) -> bytes:
        """What besides the LoRA adapter the engine hashed into block ``i``. A chain's first
        block with one string besides is a cache salt (vLLM puts a request's ``cache_salt`` in
        its first block's keys): named as the router names a salted prompt. Anything else
        (multimodal items, ...) is folded into kvswitch's name: such blocks never match a plain
        prompt."""
        if not event.extra_keys or i >= len(event.extra_keys) or not event.extra_keys[i]:
            return b""
        keys = [key for key in event.extra_keys[i] if key != event.lora_name]
        if not keys:
            return b""
        if i == 0 and event.parent_block_hash is None and len(keys) == 1:
            (salt,) = keys
            if isinstance(salt, str) and salt:
                salted = BlockHasher(self.namespace, self.block_size, cache_salt=salt)
                return salted.block_extra(0)
        return engine_extra_field(msgpack.packb(keys, default=repr))

    def _stored_elsewhere(self, engine_hashes: Sequence[EngineHash], medium: str) -> list[bytes]:
        """Blocks a tier stored without their tokens: known by the engine's name, or orphans."""
        names = []
        for engine_hash in engine_hashes:
            name = self._names.get(engine_hash)
            if name is None:
                self.stats.num_orphans += 1
                continue
            self._media[engine_hash].add(medium)
            names.append(name)
        return names

    def _removed(self, event: EngineBlockRemoved) -> list[bytes]:
        medium = event.medium or GPU
        names = []
        for engine_hash in event.block_hashes:
            media = self._media.get(engine_hash)
            if media is None:
                continue
            media.discard(medium)
            if not media:
                name = self._forget(engine_hash)
                if name is not None and not self._holders[name]:
                    del self._holders[name]
                    names.append(name)
        return names

    def _forget(self, engine_hash: EngineHash) -> bytes | None:
        """Drop an engine name; the kvswitch name it had."""
        self._media.pop(engine_hash, None)
        name = self._names.pop(engine_hash, None)
        if name is not None:
            self._holders[name] -= 1
        return name


def _on_gpu(media: Iterable[str]) -> bool:
    return any(medium.upper() == GPU for medium in media)


def engine_hash_of(name: bytes) -> int:
    """What a kvswitch worker calls a block in vLLM-format events: the first 64 bits of its
    name, as vLLM's own default names are 64-bit ints."""
    return int.from_bytes(name[:8], "big")


def to_engine_events(events: Sequence[CacheEvent], block_size: int) -> list[EngineEvent]:
    """A kvswitch worker's cache events in vLLM's format, its blocks in the engine's one tier
    ("GPU", as vLLM calls the device's cache, whatever the device). A stored event without its
    tokens (blocks pulled from a peer) is left out: a consumer could not name its blocks; so
    are the host tier's events (``--offload-gb``), whose blocks carry no tokens."""
    out: list[EngineEvent] = []
    for event in events:
        if getattr(event, "medium", None) is not None:
            continue
        if isinstance(event, BlockStored):
            if not event.token_ids:
                continue
            parent = event.parent_block_hash
            out.append(
                EngineBlockStored(
                    tuple(map(engine_hash_of, event.block_hashes)),
                    None if parent is None else engine_hash_of(parent),
                    event.token_ids,
                    block_size,
                    lora_name=event.lora,
                    medium=GPU,
                    extra_keys=_extra_keys(event),
                )
            )
        elif isinstance(event, BlockRemoved):
            out.append(EngineBlockRemoved(tuple(map(engine_hash_of, event.block_hashes)), GPU))
        else:
            out.append(EngineAllBlocksCleared())
    return out


def _extra_keys(event: BlockStored) -> tuple[tuple[Any, ...] | None, ...] | None:
    """vLLM's per-block extra keys of a kvswitch event: the adapter's name in each block, and a
    cache salt in a chain's first one; None where there are none."""
    if event.cache_salt is None or event.parent_block_hash is not None:
        return None  # the adapter alone travels as lora_name
    lora = (event.lora,) if event.lora else ()
    rest: tuple[Any, ...] | None = lora or None
    return ((*lora, event.cache_salt),) + (rest,) * (len(event.block_hashes) - 1)
