"""Turns a step's logits into one next token per sequence: greedy, temperature and top-p.

A sampled row picks ``argmax(probs / q)`` with ``q`` drawn from Exp(1) per token (the exponential
race: token ``j`` wins with probability ``probs[j]``), so a whole batch samples in one operation.
A seeded request draws its ``q`` from its own ``torch.Generator``, reseeded for every output
position (``seed_for_position``): it produces the same tokens whichever other requests share its
batch, and wherever it resumes. Unseeded rows share one draw from torch's global generator.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import xxhash

from kvswitch.worker.request import SamplingParams


def seed_for_position(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for its ``position``-th output token (0-based).

    Reseeding per position, rather than drawing on from one stream, makes a token depend only
    on (seed, position, logits): a request recomputed after preemption, or resumed on another
    worker after its ``position`` earlier tokens, draws exactly what it would have drawn.
    """
    return xxhash.xxh64_intdigest(struct.pack("<QQ", seed, position))


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The random source of a seeded sampled request, seeded with ``params.seed``; None for the
    others (greedy requests draw nothing, unseeded ones draw from torch's global generator)."""
    if params.is_greedy or params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


class Sampler:
    """Stateless; all randomness comes from the generators passed to ``sample`` (and torch's
    global generator for rows without one)."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Pick one token per row of ``logits`` [num_seqs, vocab_size] (any float dtype).

        Row ``i`` follows ``params[i]`` and, unless greedy, draws from ``generators[i]`` (None:
        torch's global generator). Returns int64 token ids [num_seqs] on the logits' device. A
        row with a generator advances only it, by one draw of ``vocab_size`` numbers.
        """
        num_seqs = logits.shape[0]
        if len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"got {num_seqs} rows of logits, {len(params)} params and "
                f"{len(generators)} generators; they must match"
            )
        logits = logits.float()
        token_ids = logits.argmax(dim=-1)  # the greedy rows' answer; sampled rows overwrite it
        # NOTE: the field, not ``is_greedy``: a property call per row costs on every step.
        sampled_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if not sampled_rows:
            return token_ids
        if len(sampled_rows) == num_seqs:
            token_ids = self._sample_rows(logits, params, generators)
        else:
            index = torch.tensor(sampled_rows, device=logits.device)
            token_ids[index] = self._sample_rows(
                logits[index],
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )
        return token_ids

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        device = logits.device
        temperatures = torch.tensor([p.temperature for p in params], device=device)
        probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
        # The exponential race: one Exp(1) per token, each seeded row from its own generator.
        race = torch.empty_like(probs)
        shared_rows = [row for row, g in enumerate(generators) if g is None]
        if len(shared_rows) == len(generators):
            race.exponential_()
        elif shared_rows:
            index = torch.tensor(shared_rows, device=device)
            race[index] = torch.empty_like(race[index]).exponential_()
        for row, generator in enumerate(generators):
            if generator is not None:
                race[row].exponential_(generator=generator)
        token_ids = (probs / race).argmax(dim=-1)
        nucleus_rows = [row for row, p in enumerate(params) if p.top_p < 1.0]
        if nucleus_rows:  # else nothing to cut: no sort at all
            # NOTE: these rows race in rank order, over their nucleus only; a row's ranks depend
            # on its own probabilities alone, so it still samples the same alone or batched.
            index = torch.tensor(nucleus_rows, device=device)
            top_ps = torch.tensor([params[row].top_p for row in nucleus_rows], device=device)
            sorted_probs, sorted_ids = _nucleus(probs[index], top_ps)
            ranks = (sorted_probs / race[index]).argmax(dim=-1, keepdim=True)
            token_ids[index] = sorted_ids.gather(1, ranks).squeeze(1)
        return token_ids


def _nucleus(probs: torch.Tensor, top_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities sorted down, those outside its nucleus set to 0, and the token
    id of each rank. A token stays if the mass of the tokens ranked above it is still short of
    top_p; the most likely token always stays."""
    # NOTE: a stable sort keeps ties in vocabulary order, so a row's ranks do not depend on the
    # other rows in the batch.
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = mass_above < top_ps.unsqueeze(1)
    keep[:, 0] = True
    return sorted_probs.masked_fill_(~keep, 0.0), sorted_ids
