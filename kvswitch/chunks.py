"""Token chunks that join: what a stream's reader has not taken yet goes as one chunk.

A worker's stream merges the chunks its router has not read (``worker/call_stream.py``), a router
those its client has not (``router/worker_streams.py``): fewer messages, each one's cost paid once
for the tokens it carries. A chunk joins the one before it only when it is tokens and text alone;
one with logprobs, an embedding or the stream's cached count goes as it is.
"""

from __future__ import annotations

from typing import Any


def merges(response: Any) -> bool:
    """Whether ``response`` (a ``WorkerGenerateResponse``) is a chunk of tokens and text alone:
    no logprobs, no embedding, not a stream's first chunk (it carries the cached count)."""
    if not response.HasField("chunk"):
        return False
    chunk = response.chunk
    return not (
        chunk.HasField("logprobs")
        or chunk.HasField("prompt_logprobs")
        or chunk.HasField("num_cached_tokens")
        or chunk.embedding
    )


def join(response: Any, following: Any) -> None:
    """Append ``following``'s chunk to ``response``'s (both ``merges``): its tokens and text
    after, its count of tokens without text yet in place."""
    chunk, after = response.chunk, following.chunk
    chunk.token_ids.extend(after.token_ids)
    chunk.text += after.text
    chunk.num_pending_text_tokens = after.num_pending_text_tokens
