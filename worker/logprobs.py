"""What a request gets beyond its tokens: log-probabilities of its output and prompt tokens, and
its prompt's embedding, all from the model's final hidden states and its LM head.

Logprobs are the model's own distribution (``log_softmax`` of the raw logits, in float32), before
temperature and top-p, as OpenAI's API and transformers report them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvswitch.worker.model import CausalLM
from kvswitch.worker.request import TokenLogprobs

# Rows of prompt hidden states put through the LM head at once: a 128K vocabulary in float32 is
# 0.5 MiB a row, so a 4K-token prompt whole would take 2 GiB.
PROMPT_CHUNK_ROWS = 256


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Row ``i`` of ``logits`` [n, vocab]: the logprob of ``token_ids[i]`` and of the
    ``num_top[i]`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1).to(logprobs.device)).squeeze(1).tolist()
    most = max(num_top, default=0)
    if not most:
        return [TokenLogprobs(lp) for lp in chosen]
    top_values, top_ids = logprobs.topk(min(most, logprobs.shape[1]), dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(lp, tuple(ids[i][:k]), tuple(values[i][:k]))
        for i, (lp, k) in enumerate(zip(chosen, num_top, strict=True))
    ]


@torch.inference_mode()
def prompt_logprobs(
    model: CausalLM, hidden: torch.Tensor, prompt_token_ids: np.ndarray, num_top: int
) -> list[TokenLogprobs]:
    """Each prompt token's logprob given the tokens before it (the first has none, so there is
    one fewer than the prompt's tokens), from the prompt's final hidden states ``hidden``
    [num_prompt_tokens, hidden_size] (host or device) through the LM head, a chunk of rows at
    a time."""
    param = model.lm_head.weight
    targets = torch.from_numpy(np.ascontiguousarray(prompt_token_ids[1:], np.int64))
    num_rows = len(targets)
    out: list[TokenLogprobs] = []
    for start in range(0, num_rows, PROMPT_CHUNK_ROWS):
        end = min(start + PROMPT_CHUNK_ROWS, num_rows)
        rows = hidden[start:end].to(param.device, param.dtype, non_blocking=True)
        logits = model.lm_head(rows)
        out += token_logprobs(logits, targets[start:end], [num_top] * (end - start))
    return out


def pool(hidden: torch.Tensor, pooling: str) -> list[float]:
    """The prompt's embedding from its final hidden states [num_prompt_tokens, hidden_size]:
    the last token's (``"last"``) or their mean (``"mean"``), in float32, L2-normalized."""
    if pooling == "last":
        vector = hidden[-1].float()
    elif pooling == "mean":
        vector = hidden.float().mean(dim=0)
    else:
        raise ValueError(f"pooling must be 'last' or 'mean', not {pooling!r}")
    return torch.nn.functional.normalize(vector, dim=0).tolist()
