"""Token logprobs in the OpenAI API's two shapes: the completions API's columns (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and the chat API's ``content`` entries
(``token``, ``logprob``, ``bytes``, ``top_logprobs``). No I/O here.

A token shows as its own text, or, where its bytes are part of a character that takes several
tokens, as ``bytes:`` and their escapes (``bytes:\\xe4\\xb8``, as vLLM writes them); the chat
shape's ``bytes`` are the token's bytes, which concatenate to the text. Where the router has no
tokenizer a token shows as ``token_id:N``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvswitch.tokenizer import Tokenizer
from kvswitch.v1 import common_pb2


@dataclass
class LogprobColumns:
    """Tokens' logprobs as the router relays them (``TokenLogprobs`` messages, joined): token
    ``i`` has ``logprobs[i]`` and the alternatives ``top_token_ids[i]``, ``top_logprobs[i]``."""

    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def __getitem__(self, span: slice) -> LogprobColumns:
        return LogprobColumns(
            self.logprobs[span], self.top_token_ids[span], self.top_logprobs[span]
        )

    def extend(self, message: common_pb2.TokenLogprobs) -> None:
        num_top, num_tokens = message.num_top, len(message.logprobs)
        ids, values = list(message.top_token_ids), list(message.top_logprobs)
        self.logprobs += message.logprobs
        self.top_token_ids += [ids[i * num_top : (i + 1) * num_top] for i in range(num_tokens)]
        self.top_logprobs += [values[i * num_top : (i + 1) * num_top] for i in range(num_tokens)]


class TokenTexts:
    """Each token id's text and bytes, as logprobs show them."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 - one per front, as long as it lives
    def text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        data = self._tokenizer.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def bytes_of(self, token_id: int) -> list[int]:
        if self._tokenizer is None:
            return list(self.text(token_id).encode("utf-8"))
        return list(self._tokenizer.token_bytes(token_id))


class CompletionLogprobs:
    """The completions API's ``logprobs`` of a stream's tokens, chunk after chunk: each token's
    ``text_offset`` counts the characters of the tokens before it, from the first chunk's."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._offset = 0

    def prompt(self, token_ids: Sequence[int], entries: LogprobColumns) -> dict[str, Any]:
        """The echoed prompt's: its first token has no logprob (nothing before it to score it
        by), the rest have one each."""
        body = self.output(token_ids[1:], entries)
        first = self._texts.text(token_ids[0])
        body["tokens"].insert(0, first)
        body["token_logprobs"].insert(0, None)
        body["top_logprobs"].insert(0, None)
        # NOTE: the first token's text came before the others' offsets were counted.
        body["text_offset"] = [0, *(offset + len(first) for offset in body["text_offset"])]
        self._offset += len(first)
        return body

    def output(self, token_ids: Sequence[int], entries: LogprobColumns) -> dict[str, Any]:
        """Output tokens' (``entries`` one per token): ``top_logprobs`` holds the most likely
        tokens and, as OpenAI's does, the chosen one."""
        text = self._texts.text
        tokens = [text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        tops = []
        for token, logprob, ids, values in zip(
            tokens, entries.logprobs, entries.top_token_ids, entries.top_logprobs, strict=True
        ):
            top = {text(t): lp for t, lp in zip(ids, values, strict=True)}
            top.setdefault(token, logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": list(entries.logprobs),
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def join_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``logprobs`` of several in order (the echoed prompt's, then the output's)."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [value for part in parts for value in part[key]] for key in keys}


def chat_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], entries: LogprobColumns
) -> dict[str, Any]:
    """The chat API's ``logprobs`` of output tokens (``entries`` one per token)."""

    def entry_of(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": texts.text(token_id),
            "logprob": logprob,
            "bytes": texts.bytes_of(token_id),
        }

    content = []
    for token_id, logprob, ids, values in zip(
        token_ids, entries.logprobs, entries.top_token_ids, entries.top_logprobs, strict=True
    ):
        item = entry_of(token_id, logprob)
        item["top_logprobs"] = [entry_of(t, lp) for t, lp in zip(ids, values, strict=True)]
        content.append(item)
    return {"content": content}
