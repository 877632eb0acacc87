"""What the router reads of a request it may forward to an OpenAI-API engine (``EngineRequest``):
the model, the prompt (to hash and route it), the output's bound, the stream flag and kvswitch's
own fields. Every other field is the engine's to read and check: a stock vLLM server takes
parameters the router's own front refuses (``top_k``, ``n``, ``logprobs``, tools, images), and the
router passes them through untouched.

A request the router sends to one of its kvswitch workers instead is read again by the front's
strict models, which refuse what a worker would not honour.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvswitch.router.openai_protocol import RoutingOptions

_UINT32_MAX = (1 << 32) - 1


class EngineRequest(BaseModel):
    """``POST /v1/completions`` or ``/v1/chat/completions`` as forwarded to an engine."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool | None = False
    max_tokens: int | None = Field(default=None, ge=1, le=_UINT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_UINT32_MAX)
    lora: str | None = None
    cache_salt: str | None = None
    routing: RoutingOptions | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if prompt is not None and not prompt:
            raise ValueError("must not be empty")
        return prompt

    def routed_prompt(self) -> str | list[int]:
        """The prompt the request is routed by: its one prompt, or of a batch, the first;
        ValueError where there is none."""
        prompt = self.prompt
        if prompt is None:
            raise ValueError("prompt: a completion needs one")
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return prompt  # type: ignore[return-value]
        first = prompt[0]
        if not first:
            raise ValueError("prompt: the first prompt of the batch is empty")
        return first  # type: ignore[return-value]

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation as the chat template takes it: each message's role and its text
        (text parts joined by lines; images and other parts leave no text); ValueError where
        there is none."""
        if not self.messages:
            raise ValueError("messages: a chat needs at least one")
        messages = []
        for message in self.messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = [p.get("text") for p in content if isinstance(p, dict)]
                content = "\n".join(p for p in parts if isinstance(p, str))
            messages.append({"role": str(message.get("role", "")), "content": content or ""})
        return messages

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
