"""Tokenizers and streaming decode: the built-in byte tokenizer, and a Hugging Face
tokenizer.json and a SentencePiece tokenizer.model the tests train themselves on a few
sentences."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvswitch.tokenizer import (
    REPLACEMENT_CHAR,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDecoder,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerFileError,
    load_tokenizer,
)
from tests.cjk_checkpoint import ANSWER, CUE, CjkCheckpoint, write_checkpoint

EMOJI = "\U0001f600"  # four UTF-8 bytes: F0 9F 98 80
TEXTS = ["hello world", "naïve café, déjà vu", f"smile {EMOJI} done", "日本語のテキスト"]
TRAINING_SENTENCES = [
    "the cache-aware router sends each request to the worker that holds its prompt",
    "a worker keeps the key and value cache of recent prompts in blocks",
    "hello world, hello router, hello worker",
] * 3


# -- the byte tokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips(text: str) -> None:
    tokenizer = ByteTokenizer()
    token_ids = tokenizer.encode(text)
    assert token_ids == [256, *text.encode("utf-8")]
    assert tokenizer.decode(token_ids) == text
    array = tokenizer.encode_array(text)  # what the router hashes, built without a list
    assert array.dtype == np.uint32 and array.tolist() == token_ids


def test_byte_tokenizer_bos_and_vocabulary() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == 257
    assert tokenizer.bos_token_id == 256 and tokenizer.eos_token_id is None
    assert tokenizer.stop_token_ids == ()
    assert tokenizer.encode("hi", add_bos=False) == [104, 105]
    assert tokenizer.decode([256, 104, 256, 105]) == "hi"  # BOS is skipped wherever it is
    assert tokenizer.decode([104, 0xFF, 105]) == f"h{REPLACEMENT_CHAR}i"
    with pytest.raises(ValueError, match="257"):
        tokenizer.decode([300])


def test_load_tokenizer_without_a_model_is_the_byte_tokenizer() -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_load_tokenizer_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"neither tokenizer\.json nor tokenizer\.model.*token ids"
    ):
        load_tokenizer(tmp_path)


# -- streaming with the byte tokenizer -------------------------------------------------------------


def stream(decoder: IncrementalDecoder, token_ids: list[int], step: int = 1) -> list[str]:
    pieces = [decoder.push(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]
    return [*pieces, decoder.flush()]


def test_an_emoji_arriving_byte_by_byte_is_emitted_whole() -> None:
    tokenizer = ByteTokenizer()
    token_ids = tokenizer.encode(f"a{EMOJI}b{EMOJI}", add_bos=False)
    pieces = stream(IncrementalDecoder(tokenizer), token_ids)
    assert pieces == ["a", "", "", "", EMOJI, "b", "", "", "", EMOJI, ""]
    assert "".join(pieces) == tokenizer.decode(token_ids)


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_byte_stream_concatenates_to_the_full_decode(step: int) -> None:
    tokenizer = ByteTokenizer()
    token_ids = tokenizer.encode(" / ".join(TEXTS), add_bos=False)
    pieces = stream(IncrementalDecoder(tokenizer, [256, 65]), token_ids, step)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(token_ids)


def test_a_character_split_between_prompt_and_output_is_emitted_with_the_output() -> None:
    tokenizer = ByteTokenizer()
    emoji_bytes = list(EMOJI.encode("utf-8"))
    decoder = IncrementalDecoder(tokenizer, [256, 65, *emoji_bytes[:2]])
    assert decoder.push(emoji_bytes[2:3]) == ""
    assert decoder.push([*emoji_bytes[3:], 66]) == f"{EMOJI}B"


def test_flush_hands_over_an_unfinished_character() -> None:
    decoder = IncrementalDecoder(ByteTokenizer())
    assert decoder.push([104, 0xF0, 0x9F]) == "h"
    assert decoder.flush() == REPLACEMENT_CHAR


# -- a Hugging Face tokenizer ----------------------------------------------------------------------


def build_tokenizer_json(model_dir: Path, *, template_bos: bool) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on a few sentences, so most characters outside them (the emoji,
    the Japanese) are split into several byte tokens. ``<s>`` is id 0 and ``</s>`` is id 1."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_SENTENCES, trainer)
    if template_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return tokenizer


def write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content), encoding="utf-8")


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    build_tokenizer_json(tmp_path, template_bos=False)
    write_json(tmp_path / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>"})
    return tmp_path


def test_hf_tokenizer_round_trips_and_reads_bos_eos(hf_dir: Path) -> None:
    tokenizer = load_tokenizer(hf_dir)
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.stop_token_ids == (1,)
    trained = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tokenizer.vocab_size == trained.get_vocab_size() > 256
    for text in TEXTS:
        token_ids = tokenizer.encode(text)
        assert token_ids[0] == 0 and 0 not in token_ids[1:]
        assert token_ids[1:] == tokenizer.encode(text, add_bos=False)
        assert tokenizer.decode(token_ids) == text
        assert tokenizer.encode_array(text).tolist() == token_ids
    assert tokenizer.decode([0, *tokenizer.encode("hello", add_bos=False), 1]) == "hello"


def test_bos_from_the_template_is_not_added_twice(tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path, template_bos=True)
    write_json(tmp_path / "tokenizer_config.json", {"bos_token": {"content": "<s>"}})
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.bos_token_id == 0
    token_ids = tokenizer.encode("hello world")
    assert token_ids[0] == 0 and token_ids.count(0) == 1
    assert tokenizer.encode("hello world", add_bos=False) == token_ids[1:]


def test_eos_list_in_config_json(tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path, template_bos=False)
    write_json(tmp_path / "config.json", {"bos_token_id": 0, "eos_token_id": [1, 5, 7]})
    tokenizer = HFTokenizer(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.stop_token_ids == (1, 5, 7)
    assert tokenizer.encode("hello")[0] == 0


def test_generation_config_eos_ids_stop_too(tmp_path: Path) -> None:
    # Llama 3 instruct: config.json names one EOS, generation_config.json the end-of-turn ones.
    build_tokenizer_json(tmp_path, template_bos=False)
    write_json(tmp_path / "config.json", {"bos_token_id": 0, "eos_token_id": 1})
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [1, 8, 9]})
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.eos_token_id == 1
    assert tokenizer.stop_token_ids == (1, 8, 9)


def test_tokenizer_config_eos_leads_the_stop_ids(tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path, template_bos=False)
    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "</s>"})
    write_json(tmp_path / "config.json", {"eos_token_id": [7, 1]})
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.eos_token_id == 1
    assert tokenizer.stop_token_ids == (1, 7)


def test_no_bos_is_added_when_the_model_is_trained_without_one(tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path, template_bos=False)
    write_json(tmp_path / "tokenizer_config.json", {"bos_token": "<s>", "add_bos_token": False})
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_bos=False)


def test_without_any_bos_nothing_is_prepended(tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path, template_bos=False)
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_id is None
    assert tokenizer.stop_token_ids == ()
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_bos=False)


def check_stream(tokenizer: Tokenizer, texts: list[str], step: int) -> list[str]:
    """Streams ``texts`` (and an emoji split into byte tokens) after a prompt, ``step`` tokens a
    push: no piece breaks a character, and the pieces add up to what the tokens add to the
    prompt's text. Returns the pieces."""
    prompt_ids = tokenizer.encode(
        "a prompt longer than the context the decoder keeps: hello router"
    )
    output_ids = tokenizer.encode(" / ".join(texts) + f" {EMOJI}", add_bos=False)
    # The emoji must really be split across tokens for this test to mean anything.
    assert all(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in output_ids[-4:])
    pieces = stream(IncrementalDecoder(tokenizer, prompt_ids), output_ids, step)
    # A worker hands over its prompt as a numpy array: the same text, and only its tail kept.
    from_array = IncrementalDecoder(tokenizer, np.array(prompt_ids, np.int64))
    assert len(from_array._token_ids) <= IncrementalDecoder.NUM_CONTEXT_TOKENS
    assert stream(from_array, output_ids, step) == pieces
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    full = tokenizer.decode(prompt_ids + output_ids)
    assert full == tokenizer.decode(prompt_ids) + "".join(pieces)
    return pieces


@pytest.mark.parametrize("step", [1, 2, 3])
def test_hf_stream_concatenates_to_the_full_decode(hf_dir: Path, step: int) -> None:
    tokenizer = load_tokenizer(hf_dir)
    pieces = check_stream(tokenizer, TEXTS, step)
    output_ids = tokenizer.encode(" / ".join(TEXTS) + f" {EMOJI}", add_bos=False)
    assert "".join(pieces) == tokenizer.decode(output_ids)


def test_hf_stream_holds_a_broken_character_until_flush(hf_dir: Path) -> None:
    tokenizer = load_tokenizer(hf_dir)
    emoji_ids = tokenizer.encode(EMOJI, add_bos=False)
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push(tokenizer.encode("hello", add_bos=False)) == "hello"
    assert decoder.push(emoji_ids[:2]) == ""
    assert decoder.flush().endswith(REPLACEMENT_CHAR)


# -- a stream that changes worker partway ----------------------------------------------------------


@pytest.fixture(scope="module")
def cjk(tmp_path_factory: pytest.TempPathFactory) -> CjkCheckpoint:
    return write_checkpoint(tmp_path_factory.mktemp("cjk"))


def handed_on(
    tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int], num_first: int, step: int
) -> list[str]:
    """The pieces of text of ``output_ids``, ``step`` tokens a push: the first ``num_first`` by
    one decoder, the rest by one that takes the prompt and those as its prompt and the first's
    pending tokens, as the worker that goes on with a stream does."""
    first = IncrementalDecoder(tokenizer, prompt_ids)
    pieces = [
        first.push(output_ids[i : min(i + step, num_first)]) for i in range(0, num_first, step)
    ]
    prompt = [*prompt_ids, *output_ids[:num_first]]
    second = IncrementalDecoder(tokenizer, prompt, first.num_pending_tokens)
    return pieces + stream(second, output_ids[num_first:], step)


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("kind", ["bpe", "bytes"])
def test_a_stream_handed_on_at_any_token_loses_and_repeats_nothing(
    cjk: CjkCheckpoint, kind: str, step: int
) -> None:
    tokenizer = cjk.tokenizer if kind == "bpe" else ByteTokenizer()
    prompt_ids = tokenizer.encode(f"question{CUE}")
    output_ids = tokenizer.encode(f"{ANSWER} 日本語のテキスト {EMOJI}", add_bos=False)
    whole = tokenizer.decode(output_ids)
    for num_first in range(len(output_ids) + 1):
        pieces = handed_on(tokenizer, prompt_ids, output_ids, num_first, step)
        assert "".join(pieces) == whole, f"handed on after {num_first} tokens"
        assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_the_text_handed_on_may_hold_whole_characters(cjk: CjkCheckpoint) -> None:
    """A token that ends one character and begins the next holds the first back with it: the
    next decoder must send both, not only what followed the unfinished one."""
    tokenizer, answer_ids = cjk.tokenizer, cjk.answer_ids
    prompt_ids = tokenizer.encode(f"question{CUE}")
    num_first = 6  # up to the token that ends 是 and begins 什
    first = IncrementalDecoder(tokenizer, prompt_ids)
    assert "".join(first.push([t]) for t in answer_ids[:num_first]) == "问题的答案"
    assert first.num_pending_tokens == 2  # [e6 98] [af e4]: "是" and half of "什"
    prompt = [*prompt_ids, *answer_ids[:num_first]]
    second = IncrementalDecoder(tokenizer, prompt, num_pending_tokens=2)
    assert second.push(answer_ids[num_first : num_first + 1]) == "是什"  # [bb 80] ends 什
    assert second.num_pending_tokens == 0
    assert second.push(answer_ids[num_first + 1 : num_first + 2]) == "么"
    # EOS has no text: nothing is pending once the stream is flushed.
    assert second.push([cjk.eos_token_id]) == ""
    assert second.flush() == "" and second.num_pending_tokens == 0


# -- a SentencePiece tokenizer.model ---------------------------------------------------------------


def build_sentencepiece_model(model_dir: Path, *, vocab_size: int = 400, **options) -> bytes:
    """A BPE SentencePiece model trained as Llama's was (no normalization, a dummy prefix space,
    bytes for characters outside the vocabulary): <unk> 0, <s> 1, </s> 2."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_SENTENCES),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
        **options,
    )
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "tokenizer.model").write_bytes(model.getvalue())
    return model.getvalue()


@pytest.fixture
def sp_dir(tmp_path: Path) -> Path:
    """A Llama checkpoint's tokenizer files without tokenizer.json."""
    build_sentencepiece_model(tmp_path, byte_fallback=True)
    write_json(
        tmp_path / "config.json",
        {"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 400},
    )
    write_json(
        tmp_path / "tokenizer_config.json",
        {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "add_bos_token": True,
        },
    )
    return tmp_path


SP_TEXTS = [*TEXTS, "line one\nline two\n\n  indented", "tabs\tand  two spaces", "digits 12345"]


def test_a_checkpoint_with_only_tokenizer_model_tokenizes_as_transformers_does(sp_dir: Path):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(sp_dir))
    ours = load_tokenizer(sp_dir)
    assert isinstance(ours, SentencePieceTokenizer)
    assert (ours.bos_token_id, ours.eos_token_id, ours.stop_token_ids) == (1, 2, (2,))
    assert ours.vocab_size == len(theirs) > 256
    for text in SP_TEXTS:
        token_ids = ours.encode(text)
        assert token_ids == theirs(text)["input_ids"], text
        assert ours.encode(text, add_bos=False) == token_ids[1:]
        assert ours.decode(token_ids) == theirs.decode(token_ids, skip_special_tokens=True) == text
    # The emoji and the Japanese really are spelled in byte pieces.
    assert len(ours.encode(EMOJI, add_bos=False)) >= 4


def test_a_leading_space_is_kept_as_sentencepiece_keeps_it(sp_dir: Path):
    # NOTE: the model was trained on sentencepiece's own output, so that is the reference. On a
    # text that starts with a space, transformers 5 (which rebuilds the model as a tokenizers
    # one) drops that space; sentencepiece keeps it, and so does decode.
    model = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tokenizer = SentencePieceTokenizer(sp_dir)
    for text in [" leading", "  two leading"]:
        assert tokenizer.encode(text) == [1, *model.encode(text)]
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_sentencepiece_special_tokens_default_to_the_models_own(tmp_path: Path):
    build_sentencepiece_model(tmp_path, byte_fallback=True)  # no configs at all
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.encode("hello")[0] == 1
    assert tokenizer.decode([1, *tokenizer.encode("hello", add_bos=False), 2, 400, -1]) == "hello"
    write_json(tmp_path / "tokenizer_config.json", {"bos_token": "</s>", "add_bos_token": False})
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.bos_token_id == 2
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_bos=False)


@pytest.mark.parametrize("step", [1, 2, 3])
def test_sentencepiece_stream_concatenates_to_the_full_decode(sp_dir: Path, step: int) -> None:
    pieces = check_stream(load_tokenizer(sp_dir), SP_TEXTS, step)
    # After a prompt, the first piece keeps its leading space (decoding alone drops it).
    assert pieces[0].startswith(" ")


def test_tokenizer_json_wins_over_tokenizer_model(sp_dir: Path) -> None:
    build_tokenizer_json(sp_dir, template_bos=False)
    assert isinstance(load_tokenizer(sp_dir), HFTokenizer)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model"])
def test_a_tokenizer_file_that_cannot_be_read_is_named(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("{not a tokenizer")
    with pytest.raises(TokenizerFileError, match=rf"{tmp_path / name} cannot be read: "):
        load_tokenizer(tmp_path)


def test_token_bytes_are_what_each_token_stands_for_even_part_of_a_character(
    tmp_path: Path,
) -> None:
    from tests.cjk_checkpoint import ANSWER, write_checkpoint

    checkpoint = write_checkpoint(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    pieces = [tokenizer.token_bytes(t) for t in checkpoint.answer_ids]
    assert b"".join(pieces) == ANSWER.encode()
    assert pieces[:3] == [b"\xe9\x97", b"\xae\xe9", b"\xa2\x98"]  # 问 and 题 split three ways
    assert tokenizer.token_bytes(tokenizer.eos_token_id) == b""  # a special token stands for none
    byte_tokenizer = load_tokenizer(None)
    assert [byte_tokenizer.token_bytes(b) for b in "好".encode()] == [b"\xe5", b"\xa5", b"\xbd"]
