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
from kvswitch.worker.request import Logprobs

# The most float32 logits put through the LM head at once: a 4K-token prompt of a 128K vocabulary
# whole would take 2 GiB; a small vocabulary goes in one piece.
PROMPT_CHUNK_LOGITS = 1 << 24


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> Logprobs:
    """The logprob of ``token_ids[i]`` under row ``i`` of ``logits`` [n, vocab], and of the
    ``num_top`` most likely tokens of each row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1).to(logprobs.device)).squeeze(1)
    top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    return Logprobs(chosen.cpu().numpy(), top_ids.cpu().numpy(), top_values.cpu().numpy())


def rows_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[Logprobs]:
    """``token_logprobs`` of each row alone, row ``i`` with ``num_top[i]`` alternatives (the
    sampled tokens of a step's requests)."""
    run = token_logprobs(logits, token_ids, max(num_top))
    return [
        Logprobs(
            run.logprobs[i : i + 1],
            run.top_token_ids[i : i + 1, :k],
            run.top_logprobs[i : i + 1, :k],
        )
        for i, k in enumerate(num_top)
    ]


@torch.inference_mode()
def prompt_logprobs(
    model: CausalLM, hidden: torch.Tensor, prompt_token_ids: np.ndarray, num_top: int
) -> Logprobs:
    """Each prompt token's logprob given the tokens before it (the first has none, so there is
    one fewer than the prompt's tokens), from the prompt's final hidden states ``hidden``
    [num_prompt_tokens, hidden_size] (host or device) through the LM head, a chunk of rows at
    a time."""
    param = model.lm_head.weight
    targets = torch.from_numpy(np.ascontiguousarray(prompt_token_ids[1:], np.int64))
    num_rows = len(targets)
    chunk_rows = max(PROMPT_CHUNK_LOGITS // param.shape[0], 1)
    runs = []
    for start in range(0, num_rows, chunk_rows):
        end = min(start + chunk_rows, num_rows)
        rows = hidden[start:end].to(param.device, param.dtype, non_blocking=True)
        runs.append(token_logprobs(model.lm_head(rows), targets[start:end], num_top))
    return Logprobs.join(runs)


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
