"""Every position's logits of a token sequence from an engine's runner (teacher forcing), and
the check built on them: is a stream of output tokens greedy decoding of the model?"""

from __future__ import annotations

import numpy as np
import torch

from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.model_runner import StepBatch

# NOTE: two greedy decodes of one prompt may part at a near tie: a step's logits depend, in
# their last bits, on the batch around it and on prefill versus decode (the sums run in
# another order). A tie closer than this is float noise, not a lost or repeated token.
NEAR_TIE = 1e-4


def logits_after_every_token(
    engine: LLMEngine, sequence: list[int], *, lora: str | None = None
) -> torch.Tensor:
    """[len(sequence), vocab]: the logits after each token of ``sequence`` (under the adapter
    ``lora``), computed on the pool's last blocks, which no request of the caller may hold."""
    block_size = engine.config.block_size
    num_blocks, last = -(-len(sequence) // block_size), engine.kv_cache.pool.num_blocks
    lora_slots = None
    if lora is not None:
        slot = engine.loras.slots_for({lora})[lora]
        lora_slots = np.full(len(sequence), slot, np.int64)
    batch = StepBatch(
        input_ids=np.array(sequence, np.int64),
        start_pos=np.array([0]),
        num_new=np.array([len(sequence)]),
        block_tables=np.arange(last - num_blocks, last, dtype=np.int32)[None],
        lora_slots=lora_slots,
    )
    return engine.runner.execute_batch(batch, every_token=True)


def not_greedy(engine: LLMEngine, prompt: list[int], output: list[int]) -> list[int]:
    """The positions of ``output`` whose token is not the model's greedy choice after the
    prompt and the output before it, up to a near tie (``NEAR_TIE``)."""
    logits = logits_after_every_token(engine, prompt + output)[len(prompt) - 1 : -1]
    chosen = logits[torch.arange(len(output)), torch.tensor(output)]
    gaps = logits.max(dim=-1).values - chosen
    return [int(i) for i in torch.nonzero(gaps > NEAR_TIE).flatten()]
