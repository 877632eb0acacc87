"""A checkpoint whose greedy answer a test chooses, with a real byte-level BPE tokenizer.

The tokenizer is trained here on a few Chinese sentences and emoji, so that, as in the
vocabularies of real models, some of its tokens end partway through a character and some finish
one character and begin the next::

    ANSWER "问题的答案是什么? 答案 is 好 🚀", the bytes of each of its tokens:
    [e9 97] [ae e9] [a2 98] [的答案] [e6 98] [af e4] [bb 80] [么] [?] [ ] [答案] ...
     ^ 问 begun  ^ 问 ended, 题 begun         ^ 是 begun  ^ 是 ended, 什 begun
    ... [ is] [ 好] [20 f0 9f] [9a] [80]     (🚀 in three tokens)

The model is a one-layer Llama that reads only the last token: attention and MLP write nothing
(their output projections are zero), the embedding is one-hot, and the output head gives each
token of a chosen chain the next one. Prompted with any text that ends in ``CUE``, it answers
``ANSWER``'s tokens, then EOS, whatever worker computes which part of it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvswitch.tokenizer import REPLACEMENT_CHAR, HFTokenizer
from kvswitch.worker.model import CausalLM
from kvswitch.worker.model_config import ModelConfig

CORPUS = [
    "答案 is 好",
    "问题的答案是什么",
    "答案很好",
    "好的答案",
    "日本語のテキスト",
    "smile 😀 done",
    "party 🎉 time",
    "😀😀 🎉",
    "the answer is good",
    "答案 😀 好",
] * 4
ANSWER = "问题的答案是什么? 答案 is 好 🚀"
CUE = ":"  # every prompt ends with it; the model answers it with ANSWER
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}answer:{% endif %}"
)
BOS, EOS = "<s>", "</s>"  # ids 0 and 1
HIDDEN_SIZE = 384  # at least the vocabulary: each token its own direction


@dataclass(frozen=True)
class CjkCheckpoint:
    model_dir: Path
    tokenizer: HFTokenizer
    answer_ids: list[int]  # ANSWER's tokens; the model then gives EOS
    eos_token_id: int


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE (pre-tokenizer and decoder) of about 320 tokens; ``<s>`` 0, ``</s>`` 1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def write_checkpoint(model_dir: Path) -> CjkCheckpoint:
    """The tokenizer (``tokenizer.json``, its configs with ``CHAT_TEMPLATE``) and the model
    (``config.json``, ``model.safetensors``) in ``model_dir``, where workers and routers load
    them from."""
    model_dir.mkdir(parents=True, exist_ok=True)
    trained = train_tokenizer()
    trained.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    vocab_size = trained.get_vocab_size()
    assert vocab_size <= HIDDEN_SIZE
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (model_dir / "config.json").write_text(json.dumps(hf), encoding="utf-8")

    tokenizer = HFTokenizer(model_dir)
    answer_ids = tokenizer.encode(ANSWER, add_bos=False)
    cue_id = tokenizer.encode(CUE, add_bos=False)[-1]
    # The chain needs one successor per token; and the handoffs the tests make must fall inside
    # characters: the answer's first token is half a character.
    assert len(set(answer_ids)) == len(answer_ids) and cue_id not in answer_ids
    assert tokenizer.decode(answer_ids[:1]) == REPLACEMENT_CHAR
    eos_id = tokenizer.eos_token_id
    assert eos_id == 1
    next_token = {cue_id: answer_ids[0], **dict(itertools.pairwise(answer_ids))}
    next_token[answer_ids[-1]] = eos_id

    model = CausalLM(ModelConfig.from_hf(hf))
    weights = {
        name: torch.ones_like(param) if name.endswith("norm.weight") else torch.zeros_like(param)
        for name, param in model.named_parameters()
    }
    weights["model.embed_tokens.weight"][:, :vocab_size] = torch.eye(vocab_size)
    for token_id, successor in next_token.items():
        weights["lm_head.weight"][successor, token_id] = 1.0
    save_file(weights, str(model_dir / "model.safetensors"))
    return CjkCheckpoint(model_dir, tokenizer, answer_ids, eos_id)
