"""Chat messages to prompt tokens: a checkpoint's own chat template, or the built-in model's.

A Hugging Face checkpoint carries a Jinja template that writes a conversation out as the text
its model was trained on, special tokens spelled out: ``chat_template.jinja`` beside the
tokenizer, else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named
templates, of which "default" is used). It is rendered as ``transformers`` renders it: in a
sandbox, with ``messages``, ``add_generation_prompt=True``, the special tokens by name
(``bos_token``, ``eos_token``, ...), ``raise_exception`` and ``strftime_now``; and the text is
tokenized without adding special tokens, since the template wrote them.

The built-in model has no template of its own; it gets ``BUILTIN_TEMPLATE``, one line per
message and an open line for the answer::

    system: You are terse.
    user: Hello
    assistant:

and BOS as a token (the byte tokenizer's BOS has no text to write).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvswitch.checkpoint import RANDOM_PREFIX
from kvswitch.tokenizer import Tokenizer

BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed rendering it."""


class _Refused(Exception):
    pass


class ChatTemplate:
    """One model's chat template, compiled, and the tokenizer its text is tokenized with."""

    def __init__(
        self,
        source: str,
        tokenizer: Tokenizer,
        special_tokens: Mapping[str, str] | None = None,
        *,
        bos_as_token: bool = False,
    ) -> None:
        """``special_tokens``: their text by name, as the template reads them; ``bos_as_token``:
        BOS goes in as a token id, whatever the text (the built-in template). Raises
        ``ChatTemplateError`` for a template that does not compile."""
        self.source = source
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self._bos_as_token = bos_as_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        bos_text = self.special_tokens.get("bos_token", "")
        bos_id = tokenizer.bos_token_id
        # NOTE: a SentencePiece model reads "<s>" written in text as text, not as BOS; such a
        # tokenizer gets the template's leading BOS as the token instead.
        self._bos_text_to_token = bool(
            bos_text
            and bos_id is not None
            and tokenizer.encode(bos_text, add_bos=False) != [bos_id]
        )

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text of a conversation, open for the assistant's answer;
        ``ChatTemplateError`` when the template refuses it or fails."""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, **self.special_tokens
            )
        except _Refused as e:
            raise ChatTemplateError(f"the model's chat template refused the messages: {e}") from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"the model's chat template failed on the messages: {e}") from e

    def encode(self, prompt: str) -> list[int]:
        """The token ids of a rendered prompt: BOS once, where the template put it."""
        tokenizer = self.tokenizer
        if self._bos_as_token:
            return tokenizer.encode(prompt)
        bos_text = self.special_tokens.get("bos_token", "")
        if self._bos_text_to_token and prompt.startswith(bos_text):
            assert tokenizer.bos_token_id is not None
            rest = tokenizer.encode(prompt[len(bos_text) :], add_bos=False)
            return [tokenizer.bos_token_id, *rest]
        return tokenizer.encode(prompt, add_bos=False)


def load_chat_template(model: str, tokenizer: Tokenizer | None) -> tuple[ChatTemplate | None, str]:
    """The chat template of the router's ``model`` (a checkpoint directory; empty = the built-in
    model), or None and why there is none."""
    if tokenizer is None:
        return None, "the model has no tokenizer, so messages cannot become tokens"
    if not model:
        return ChatTemplate(BUILTIN_TEMPLATE, tokenizer, bos_as_token=True), ""
    if model.startswith(RANDOM_PREFIX):
        return None, f"{model} has random weights and no chat template"
    root = Path(model)
    try:
        config = _read_json(root / "tokenizer_config.json")
        source = _template_source(root, config)
    except (OSError, ValueError) as e:
        return None, f"{model}'s chat template cannot be read: {e}"
    if not source:
        return None, (
            f"{model} has no chat template (neither chat_template.jinja nor a chat_template in "
            "tokenizer_config.json); send prompts to /v1/completions instead"
        )
    special_tokens = {
        name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))
    }
    try:
        return ChatTemplate(source, tokenizer, special_tokens), ""
    except ChatTemplateError as e:
        return None, f"{model}: {e}"


def _template_source(root: Path, config: Mapping[str, Any]) -> str:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else ""


def _token_text(token: Any) -> str:
    if isinstance(token, dict):  # an AddedToken written out
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        content = json.load(f)
    return content if isinstance(content, dict) else {}


def _environment() -> ImmutableSandboxedEnvironment:
    """Jinja as ``transformers`` sets it up for chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise _Refused(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)
