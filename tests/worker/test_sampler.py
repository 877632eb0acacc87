"""The sampler: parameter checks, greedy, per-request seeds, top-p and temperature."""

from __future__ import annotations

import math

import pytest
import torch

from kvswitch.worker.request import SamplingParams
from kvswitch.worker.sampler import Sampler, make_generator

VOCAB_SIZE = 50


def random_logits(num_seqs: int, seed: int) -> torch.Tensor:
    return torch.randn(num_seqs, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 3


def draw(params: SamplingParams, logits_row: torch.Tensor, num_draws: int) -> torch.Tensor:
    """``num_draws`` tokens from one row, all from one seeded generator."""
    generator = make_generator(params, "cpu")
    return Sampler().sample(
        logits_row.expand(num_draws, -1), [params] * num_draws, [generator] * num_draws
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": (3, -2)}, "stop_token_ids"),
    ],
)
def test_invalid_params_are_refused_with_the_field_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_defaults_and_stop_ids_become_a_tuple() -> None:
    params = SamplingParams(stop_token_ids=[7, 9])  # type: ignore[arg-type]
    assert params.stop_token_ids == (7, 9)
    assert params.is_greedy
    assert hash(params) == hash(SamplingParams(stop_token_ids=(7, 9)))


def test_make_generator() -> None:
    assert make_generator(SamplingParams(seed=5), "cpu") is None  # greedy draws nothing
    seeded = make_generator(SamplingParams(temperature=1.0, seed=5), "cpu")
    assert seeded is not None and seeded.initial_seed() == 5
    # Unseeded requests share torch's global generator: one draw for all of them.
    assert make_generator(SamplingParams(temperature=1.0), "cpu") is None


def test_one_batched_draw_follows_the_distribution() -> None:
    """20,000 unseeded rows of the same distribution, sampled in one call: each token comes up
    as often as its probability says (the exponential race is exact, not an approximation)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((20_000, VOCAB_SIZE), -math.inf)
    logits[:, :4] = probs.log()
    params = [SamplingParams(temperature=1.0)] * len(logits)
    torch.manual_seed(0)
    token_ids = Sampler().sample(logits, params, [None] * len(logits))
    counts = torch.bincount(token_ids, minlength=VOCAB_SIZE).float() / len(logits)
    assert counts[4:].sum() == 0
    torch.testing.assert_close(counts[:4], probs, atol=0.012, rtol=0)


def test_greedy_is_argmax() -> None:
    logits = random_logits(6, seed=0)
    params = [SamplingParams()] * 6
    token_ids = Sampler().sample(logits, params, [None] * 6)
    assert token_ids.dtype == torch.int64
    assert token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_a_seeded_request_samples_the_same_alone_or_in_any_batch() -> None:
    sampler = Sampler()
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    other = SamplingParams(temperature=1.3, seed=99)
    greedy = SamplingParams()
    alone_generator = make_generator(params, "cpu")
    unseeded = SamplingParams(temperature=1.0)
    batch_generators = [None, make_generator(other, "cpu"), make_generator(params, "cpu"), None]
    alone, batched = [], []
    for step in range(30):
        logits = random_logits(4, seed=step)
        alone += sampler.sample(logits[2:3], [params], [alone_generator]).tolist()
        batch = sampler.sample(logits, [greedy, other, params, unseeded], batch_generators)
        batched.append(batch[2].item())
        assert batch[0].item() == logits[0].argmax().item()
    assert alone == batched


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(VOCAB_SIZE)  # uniform: any two seeds agreeing on 40 draws is hopeless
    first = draw(SamplingParams(temperature=1.0, seed=1), logits, 40).tolist()
    again = draw(SamplingParams(temperature=1.0, seed=1), logits, 40).tolist()
    second = draw(SamplingParams(temperature=1.0, seed=2), logits, 40).tolist()
    assert first == again
    assert first != second


def test_a_tiny_top_p_always_picks_the_argmax() -> None:
    logits = random_logits(1, seed=3)[0]
    params = SamplingParams(temperature=5.0, top_p=1e-6, seed=0)
    assert set(draw(params, logits, 500).tolist()) == {logits.argmax().item()}


def test_top_p_never_samples_outside_the_nucleus() -> None:
    # Probabilities 0.5, 0.3, 0.1, 0.05, 0.05 over tokens 4, 0, 2, 1, 3: with top_p 0.75 the
    # nucleus is {4, 0}, since 0.5 falls short of 0.75 and 0.8 reaches it.
    probs = torch.tensor([0.3, 0.05, 0.1, 0.05, 0.5])
    params = SamplingParams(temperature=1.0, top_p=0.75, seed=11)
    token_ids = draw(params, probs.log(), 4000)
    assert set(token_ids.tolist()) == {0, 4}
    share_of_4 = (token_ids == 4).float().mean().item()
    assert abs(share_of_4 - 0.5 / 0.8) < 0.05


def test_temperature_sharpens_or_flattens_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    shares = {}
    for temperature in (0.5, 1.0, 2.0):
        params = SamplingParams(temperature=temperature, seed=7)
        token_ids = draw(params, logits, 4000)
        shares[temperature] = (token_ids == 0).float().mean().item()
        expected = torch.softmax(logits / temperature, dim=-1)[0].item()
        assert abs(shares[temperature] - expected) < 0.05
    assert shares[0.5] > shares[1.0] > shares[2.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_accepted(dtype: torch.dtype) -> None:
    logits = random_logits(3, seed=5)
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=3), SamplingParams()]
    generators = [make_generator(p, "cpu") for p in params]
    token_ids = Sampler().sample(logits.to(dtype), params, generators)
    assert token_ids.dtype == torch.int64 and token_ids.shape == (3,)
    half_argmax = logits.to(dtype).argmax(dim=-1)
    assert token_ids[0] == half_argmax[0] and token_ids[2] == half_argmax[2]
    assert 0 <= token_ids[1].item() < VOCAB_SIZE


def test_rows_params_and_generators_must_match() -> None:
    with pytest.raises(ValueError, match="must match"):
        Sampler().sample(random_logits(2, seed=0), [SamplingParams()], [None])
