"""Turns a step's logits into one next token per sequence: greedy, temperature and top-p.

Each non-greedy request draws from its own ``torch.Generator``, so a seeded request produces the
same tokens whichever other requests happen to share its batch; a seeded one is reseeded for every
output position (``seed_for_position``), so it also produces them wherever it resumes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

MAX_SEED = 2**64 - 1  # torch generators take an unsigned 64-bit seed, as the protocol does


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` 0 means greedy (argmax); ``top_p`` keeps the smallest set of most likely
    tokens whose probability reaches it; ``seed`` makes a sampled request reproducible.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        # NOTE: written so that NaN fails too.
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        # A list passed by a caller would make the params unhashable; store a tuple.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def seed_for_position(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for its ``position``-th output token (0-based).

    Reseeding per position, rather than drawing on from one stream, makes a token depend only
    on (seed, position, logits): a request recomputed after preemption, or resumed on another
    worker after its ``position`` earlier tokens, draws exactly what it would have drawn.
    """
    return xxhash.xxh64_intdigest(struct.pack("<QQ", seed, position))


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The random source for one request: None for greedy requests (they draw nothing), one
    seeded with ``params.seed`` when given, and one seeded from the OS's entropy otherwise."""
    if params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


class Sampler:
    """Stateless; all randomness comes from the generators passed to ``sample``."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Pick one token per row of ``logits`` [num_seqs, vocab_size] (any float dtype).

        Row ``i`` follows ``params[i]`` and, unless greedy, draws from ``generators[i]`` (None
        falls back to torch's global generator). Returns int64 token ids [num_seqs] on the
        logits' device. Only a sampled row advances its own generator, by one draw.
        """
        num_seqs = logits.shape[0]
        if len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"got {num_seqs} rows of logits, {len(params)} params and "
                f"{len(generators)} generators; they must match"
            )
        logits = logits.float()
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1)
        token_ids = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            token_ids[index] = logits[index].argmax(dim=-1)
        if sampled_rows:
            index = torch.tensor(sampled_rows, device=logits.device)
            sub_params = [params[i] for i in sampled_rows]
            sub_generators = [generators[i] for i in sampled_rows]
            token_ids[index] = self._sample_rows(logits[index], sub_params, sub_generators)
        return token_ids

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        device = logits.device
        temperatures = torch.tensor([p.temperature for p in params], device=device)
        top_ps = torch.tensor([p.top_p for p in params], device=device)
        probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
        # NOTE: a stable sort keeps ties in vocabulary order, so a row's nucleus does not depend
        # on the other rows in the batch.
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
        # A token stays if the mass of the tokens ranked above it is still short of top_p; the
        # most likely token always stays. top_p == 1 keeps everything, immune to rounding.
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = (mass_above < top_ps.unsqueeze(1)) | (top_ps.unsqueeze(1) >= 1.0)
        keep[:, 0] = True
        sorted_probs = sorted_probs.masked_fill(~keep, 0.0)
        # NOTE: one draw per row with the row's own generator; multinomial needs no renormalizing.
        ranks = torch.cat(
            [
                torch.multinomial(sorted_probs[row], 1, generator=generator)
                for row, generator in enumerate(generators)
            ]
        )
        return sorted_ids.gather(1, ranks.unsqueeze(1)).squeeze(1)
