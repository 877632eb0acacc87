"""Text to token ids and back: a built-in byte tokenizer, a checkpoint's Hugging Face
``tokenizer.json`` or SentencePiece ``tokenizer.model``, and an incremental decoder that streams
text without breaking characters.

The worker itself runs on token ids; a tokenizer is only needed where text comes in or goes out.
"""

from __future__ import annotations

import codecs
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from kvswitch.checkpoint import generation_eos_token_ids, token_ids

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character


class TokenizerFileError(Exception):
    """A checkpoint's tokenizer file is there but cannot be read."""


class Tokenizer(ABC):
    """Maps text to token ids and back.

    ``decode`` skips special tokens (BOS, EOS, ...) and writes U+FFFD for bytes that do not form
    valid UTF-8. ``encode`` never fails on text.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    # Text up to this long is encoded on a server's event loop, longer text on a thread (a BPE
    # tokenizer takes about 2.5 us a token, which would stall every stream the loop relays).
    inline_chars: int = 1024

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every token id that ends generation; EOS first."""
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @abstractmethod
    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, led by BOS when ``add_bos`` and the tokenizer has one."""

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as uint32, as the router hashes and sends a prompt."""
        return np.asarray(self.encode(text), np.uint32)

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens left out."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which may be part of a character (a token's logprob
        shows them); its text's UTF-8 where the tokenizer keeps no bytes."""
        return self.decode([token_id]).encode("utf-8")


class ByteTokenizer(Tokenizer):
    """The built-in model's tokenizer: token ``b`` (0..255) is the byte ``b``; 256 is BOS."""

    BOS_TOKEN_ID = 256
    inline_chars = 1 << 16  # NOTE: a byte a token, in C: 64 KiB in well under a millisecond

    def __init__(self) -> None:
        self.vocab_size = 257
        self.bos_token_id = self.BOS_TOKEN_ID
        self.eos_token_id = None

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS_TOKEN_ID, *ids] if add_bos else ids

    def encode_array(self, text: str) -> np.ndarray:
        data = text.encode("utf-8")
        ids = np.empty(len(data) + 1, np.uint32)
        ids[0] = self.BOS_TOKEN_ID
        ids[1:] = np.frombuffer(data, np.uint8)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.to_bytes(token_ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.to_bytes([token_id])

    def to_bytes(self, token_ids: Sequence[int]) -> bytes:
        """The bytes of ``token_ids``, BOS left out; ValueError for ids outside the vocabulary."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the byte vocabulary [0, 257)")
        return bytes(t for t in token_ids if t != self.BOS_TOKEN_ID)


@dataclass(frozen=True)
class SpecialTokens:
    """A checkpoint's BOS and EOS, read from its configs.

    ``tokenizer_config.json`` names them (``bos_token`` / ``eos_token``) and, where it names
    none, ``config.json`` gives ids (``bos_token_id`` / ``eos_token_id``). ``config.json``'s EOS
    may be a list: every entry is a stop token, and the first is EOS unless the tokenizer config
    names its own. The EOS ids of ``generation_config.json`` stop too (as the worker's engine
    stops on them).
    """

    bos_token_id: int | None
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]  # EOS first
    prepend_bos: bool  # False for models (Qwen2) that name a BOS token but train without one

    @classmethod
    def read(
        cls,
        model_dir: Path,
        token_to_id: Callable[[str], int | None],
        *,
        default_bos: int | None = None,
        default_eos: int | None = None,
    ) -> SpecialTokens:
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        model_config = _read_json(model_dir / "config.json")
        config_eos_ids = list(token_ids(model_config.get("eos_token_id")))
        bos = _token_id(tokenizer_config.get("bos_token"), token_to_id)
        eos = _token_id(tokenizer_config.get("eos_token"), token_to_id)
        if bos is None:
            bos = model_config.get("bos_token_id")
        if eos is None:
            eos = next(iter(config_eos_ids), None)
        bos = default_bos if bos is None else bos
        eos = default_eos if eos is None else eos
        stop_ids = [] if eos is None else [eos]
        return cls(
            bos_token_id=bos,
            eos_token_id=eos,
            stop_token_ids=tuple(
                dict.fromkeys([*stop_ids, *config_eos_ids, *generation_eos_token_ids(model_dir)])
            ),
            prepend_bos=bool(tokenizer_config.get("add_bos_token", True)),
        )


def _token_id(
    token: str | dict[str, Any] | None, token_to_id: Callable[[str], int | None]
) -> int | None:
    if isinstance(token, dict):  # an AddedToken written out
        token = token.get("content")
    return token_to_id(token) if token else None


class _CheckpointTokenizer(Tokenizer):
    """A checkpoint's own tokenizer, its BOS and EOS as ``SpecialTokens`` reads them."""

    def _set_special_tokens(self, special: SpecialTokens) -> None:
        self._special = special
        self.bos_token_id = special.bos_token_id
        self.eos_token_id = special.eos_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._special.stop_token_ids


class HFTokenizer(_CheckpointTokenizer):
    """A Hugging Face fast tokenizer read from ``<model_dir>/tokenizer.json``."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._set_special_tokens(SpecialTokens.read(model_dir, self._tokenizer.token_to_id))
        spec = _read_json(model_dir / "tokenizer.json")
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        self._special_ids = frozenset(
            t["id"] for t in spec.get("added_tokens", []) if t.get("special")
        )

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        # NOTE: encode_batch lets go of the GIL while it works (encode does not), so a caller
        # may tokenize a long prompt on a thread without stalling the others.
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=add_bos)
        ids = encoding.ids
        # The post-processor (a template in tokenizer.json) may already have put BOS first.
        bos = self.bos_token_id
        if add_bos and self._special.prepend_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        # NOTE: a byte-level BPE's token is its bytes spelt one printable character each
        # (GPT-2's table); a byte-fallback token is "<0xE4>"; others are their text.
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None or token_id in self._special_ids:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return super().token_bytes(token_id)


class SentencePieceTokenizer(_CheckpointTokenizer):
    """A SentencePiece model read from ``<model_dir>/tokenizer.model``, for checkpoints that ship
    one instead of ``tokenizer.json`` (the first Llama and Mistral releases, many of their
    fine-tunes).

    Text is encoded exactly as the ``sentencepiece`` library encodes it, which is what such a
    model was trained on: "<s>" written in a prompt is text, not BOS. BOS and EOS come from the
    configs as ``SpecialTokens`` reads them, else from the SentencePiece model itself.
    """

    def __init__(self, model_dir: str | Path) -> None:
        import sentencepiece  # only where such a checkpoint is served

        model_dir = Path(model_dir)
        self._model = sentencepiece.SentencePieceProcessor(
            model_file=str(model_dir / "tokenizer.model")
        )
        self.vocab_size = self._model.get_piece_size()
        self._set_special_tokens(
            SpecialTokens.read(
                model_dir,
                self._piece_id,
                default_bos=self._model.bos_id() if self._model.bos_id() >= 0 else None,
                default_eos=self._model.eos_id() if self._model.eos_id() >= 0 else None,
            )
        )

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        # NOTE: sentencepiece lets go of the GIL while it encodes, as encode_batch does above.
        ids = self._model.encode(text)
        bos = self.bos_token_id
        if add_bos and self._special.prepend_bos and bos is not None:
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        # Control pieces (BOS, EOS) decode to nothing; ids past the vocabulary (an embedding
        # padded beyond it) have no text.
        return self._model.decode([t for t in token_ids if 0 <= t < self.vocab_size])

    def _piece_id(self, piece: str) -> int | None:
        piece_id = self._model.piece_to_id(piece)
        return piece_id if self._model.id_to_piece(piece_id) == piece else None


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: which byte each character of a byte-level BPE's tokens
    stands for (printable bytes themselves, the rest shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF_CHAR = _byte_of_char()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """The byte tokenizer for the built-in model (``model_dir`` None), else the checkpoint's
    ``tokenizer.json``, or its ``tokenizer.model`` where it has no tokenizer.json; ValueError
    when it has neither, ``TokenizerFileError`` when the one it has cannot be read."""
    if model_dir is None:
        return ByteTokenizer()
    model_dir = Path(model_dir)
    for name, tokenizer_class in [
        ("tokenizer.json", HFTokenizer),
        ("tokenizer.model", SentencePieceTokenizer),
    ]:
        if (model_dir / name).is_file():
            try:
                return tokenizer_class(model_dir)
            except Exception as e:  # each library raises its own kinds (tokenizers: Exception)
                raise TokenizerFileError(f"{model_dir / name} cannot be read: {e}") from e
    raise ValueError(
        f"{model_dir} has neither tokenizer.json nor tokenizer.model, so this model cannot turn "
        "text into tokens; add the checkpoint's tokenizer, or send prompts as token ids, which "
        "need no tokenizer"
    )


class IncrementalDecoder:
    """Streams the text of generated tokens, a few tokens at a time.

    ``push`` returns only the text that is new and never ends partway through a character: text
    that ends in U+FFFD (a character whose bytes have not all arrived) is held back until it
    completes, and ``flush`` hands over whatever is still held once generation ends. The pushes
    plus the flush concatenate to the text the generated tokens add after the prompt.

    A stream that goes on from another decoder (the next worker of a disaggregated prefill, a
    stream resumed after a failure) starts from that one's state: its prompt ends with the
    output so far, of which the last ``num_pending_tokens`` had their text held back there
    (that decoder's ``num_pending_tokens``). Their text leads this decoder's, so the two streams
    concatenate to the text one decoder would have given.
    """

    # How many tokens before the unread ones are decoded with them, so that tokens whose text
    # depends on their neighbours (a leading space, a merged byte sequence) decode as in context.
    NUM_CONTEXT_TOKENS = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        num_pending_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        num_pending_tokens = min(max(num_pending_tokens, 0), len(prompt_token_ids))
        # Only the prompt's last few tokens are ever read, as Python ints (the prompt may be a
        # numpy array of 128K of them).
        num_tail = min(self.NUM_CONTEXT_TOKENS + num_pending_tokens, len(prompt_token_ids))
        tail = [int(t) for t in prompt_token_ids[len(prompt_token_ids) - num_tail :]]
        if isinstance(tokenizer, ByteTokenizer):
            # NOTE: bytes decode one at a time, so the codec's own pending buffer is the whole
            # state; seeding it with the prompt completes a character split across the boundary.
            # UTF-8 resynchronizes within 3 bytes, so the bytes it holds then are exactly those
            # the decoder before it held back, whatever num_pending_tokens says.
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._utf8.decode(tokenizer.to_bytes(tail[-3:]))
            return
        self._token_ids = tail
        # Window: tokens [prefix_offset, read_offset) were emitted and give context; tokens from
        # read_offset on are not emitted yet.
        self._read_offset = len(self._token_ids) - num_pending_tokens
        self._prefix_offset = max(self._read_offset - self.NUM_CONTEXT_TOKENS, 0)

    @property
    def num_pending_tokens(self) -> int:
        """How many of the last tokens pushed (or of the prompt's pending ones) have text not
        returned yet; 0 after ``flush``."""
        if isinstance(self.tokenizer, ByteTokenizer):
            held, _ = self._utf8.getstate()
            return len(held)
        return len(self._token_ids) - self._read_offset

    def push(self, token_ids: Sequence[int]) -> str:
        """The new, complete text that ``token_ids`` add; may be empty."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return self._utf8.decode(self.tokenizer.to_bytes(token_ids))
        self._token_ids.extend(token_ids)
        return self._read(final=False)

    def flush(self) -> str:
        """The text still held back (possibly ending in U+FFFD); call once, at the end."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return self._utf8.decode(b"", final=True)
        return self._read(final=True)

    def _read(self, *, final: bool) -> str:
        decode = self.tokenizer.decode
        emitted_text = decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = decode(self._token_ids[self._prefix_offset :])
        if len(window_text) <= len(emitted_text):
            if final:  # nothing left to hand over: tokens without text (EOS) are not pending
                self._read_offset = len(self._token_ids)
            return ""
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return window_text[len(emitted_text) :]
