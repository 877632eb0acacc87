"""Chat templates: the built-in model's, and a checkpoint's from tokenizer_config.json or
chat_template.jinja, rendered as transformers renders them and tokenized with one BOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvswitch.router.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from kvswitch.tokenizer import ByteTokenizer, load_tokenizer
from tests.test_tokenizer import build_sentencepiece_model, build_tokenizer_json

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello"}]
RENDERED = "<s>[system] Be terse.</s>[user] hello</s>[assistant]"


def write_config(model_dir: Path, **config: object) -> None:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, **config}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def test_the_built_in_model_gets_a_plain_template_and_bos_as_a_token() -> None:
    template, why = load_chat_template("", ByteTokenizer())
    assert template is not None and why == ""
    prompt = template.render(MESSAGES)
    assert prompt == "system: Be terse.\nuser: hello\nassistant:"
    assert template.encode(prompt) == [256, *prompt.encode()]


@pytest.mark.parametrize("template_bos", [False, True], ids=["plain", "bos-post-processor"])
def test_a_checkpoint_template_puts_bos_in_once(tmp_path: Path, template_bos: bool) -> None:
    build_tokenizer_json(tmp_path, template_bos=template_bos)
    write_config(tmp_path, chat_template=TEMPLATE)
    tokenizer = load_tokenizer(tmp_path)
    template, _ = load_chat_template(str(tmp_path), tokenizer)
    assert template is not None
    prompt = template.render(MESSAGES)
    assert prompt == RENDERED
    token_ids = template.encode(prompt)
    assert token_ids[0] == 0 and token_ids.count(0) == 1  # <s> is id 0
    assert token_ids.count(1) == 2  # each </s> the template wrote is one token
    assert tokenizer.decode(token_ids) == "[system] Be terse.[user] hello[assistant]"


def test_a_sentencepiece_checkpoint_gets_the_templates_bos_as_the_token(tmp_path: Path) -> None:
    build_sentencepiece_model(tmp_path, byte_fallback=True)
    write_config(tmp_path, chat_template=TEMPLATE)
    tokenizer = load_tokenizer(tmp_path)
    template, _ = load_chat_template(str(tmp_path), tokenizer)
    assert template is not None
    token_ids = template.encode(template.render(MESSAGES))
    # SentencePiece reads "<s>" in text as text: BOS must come in as the id, once.
    assert token_ids[0] == 1 and token_ids.count(1) == 1
    assert token_ids[1:] == tokenizer.encode(RENDERED.removeprefix("<s>"), add_bos=False)


def test_the_default_of_named_templates_and_a_jinja_file(tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path, template_bos=False)
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}]
    write_config(tmp_path, chat_template=named)
    tokenizer = load_tokenizer(tmp_path)
    template, _ = load_chat_template(str(tmp_path), tokenizer)
    assert template is not None and template.render(MESSAGES) == RENDERED
    (tmp_path / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}!")
    template, _ = load_chat_template(str(tmp_path), tokenizer)
    assert template is not None and template.render(MESSAGES) == "hello!"


def test_a_checkpoint_without_a_template_has_none_and_says_why(tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path, template_bos=False)
    write_config(tmp_path)
    template, why = load_chat_template(str(tmp_path), load_tokenizer(tmp_path))
    assert template is None and "no chat template" in why and "/v1/completions" in why
    template, why = load_chat_template("random:tiny", None)
    assert template is None and "no tokenizer" in why


def test_a_template_that_does_not_compile_is_no_template(tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path, template_bos=False)
    write_config(tmp_path, chat_template="{% for m in messages %}")
    template, why = load_chat_template(str(tmp_path), load_tokenizer(tmp_path))
    assert template is None and "does not compile" in why


def test_the_template_refuses_with_raise_exception_and_runs_sandboxed() -> None:
    template = ChatTemplate(TEMPLATE, ByteTokenizer(), {"bos_token": "", "eos_token": ""})
    with pytest.raises(ChatTemplateError, match="refused the messages: no tools here"):
        template.render([{"role": "tool", "content": "x"}])
    unsafe = ChatTemplate("{{ messages.__class__.__mro__ }}", ByteTokenizer())
    with pytest.raises(ChatTemplateError, match="failed"):
        unsafe.render(MESSAGES)
    as_json = ChatTemplate("{{ messages[0] | tojson }}", ByteTokenizer())
    assert as_json.render([{"role": "user", "content": "café <b>"}]) == (
        '{"role": "user", "content": "café <b>"}'
    )
