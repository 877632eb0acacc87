"""add_lora's kernels against their torch reference: adapters and the base mixed token by token,
zero-padded ranks, strided output slices; compiled on a GPU at a 1B model's sizes."""

from __future__ import annotations

import pytest
import torch

from kvswitch.kernels.lora import add_lora
from kvswitch.kernels.reference import add_lora_ref
from tests.kernels.paged_case import DEVICE, gpu_test

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 0.1, "rtol": 0.02},
}


def check_add_lora(
    dtype: torch.dtype, *, num_in: int, num_out: int, rank: int, num_tokens: int, device: str
) -> None:
    """Tokens of three slots and the base, unsorted; slot 1's adapter of a lower rank; into
    column slices of a wider output, as the fused q/k/v projection's are."""
    generator = torch.Generator().manual_seed(1)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(device=device, dtype=dtype)

    a, b_t = randn(3, rank, num_in, scale=0.1), randn(3, rank, num_out, scale=0.1)
    a[1, rank // 2 :], b_t[1, rank // 2 :] = 0, 0
    scaling = torch.tensor([2.0, 0.5, 0.25], device=device)
    x, fused = randn(num_tokens, num_in), randn(num_tokens, num_out + 24)
    slot_of_token = torch.randint(-1, 3, (num_tokens,), generator=generator).to(device)
    want = add_lora_ref(fused[:, 24:].clone(), x, slot_of_token, a, b_t, scaling)
    got = add_lora(fused[:, 24:], x, slot_of_token, a, b_t, scaling)
    assert got.data_ptr() == fused[:, 24:].data_ptr()  # in place, into the slice
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    untouched = fused.clone()
    add_lora(fused[:, 24:], x, torch.full_like(slot_of_token, -1), a, b_t, scaling)
    assert torch.equal(fused, untouched)  # the base model's tokens: nothing added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_lora_matches_its_reference(dtype: torch.dtype) -> None:
    check_add_lora(dtype, num_in=40, num_out=150, rank=4, num_tokens=9, device=DEVICE)


def test_add_lora_refuses_shapes_that_disagree() -> None:
    y, x = torch.zeros(2, 5), torch.zeros(2, 3)
    a, b_t, scaling = torch.zeros(1, 2, 4), torch.zeros(1, 2, 5), torch.ones(1)
    with pytest.raises(ValueError, match="do not agree"):
        add_lora(y, x, torch.zeros(2, dtype=torch.int64), a, b_t, scaling)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_lora_compiled_at_a_1b_models_sizes(dtype: torch.dtype) -> None:
    """gate/up of a 1B Llama (2,048 -> 8,192), rank 64, 300 tokens; and down (8,192 -> 2,048)."""
    check_add_lora(dtype, num_in=2048, num_out=8192, rank=64, num_tokens=300, device="cuda")
    check_add_lora(dtype, num_in=8192, num_out=2048, rank=64, num_tokens=300, device="cuda")


@pytest.mark.parametrize("num_tokens", [7, 300], ids=["dense", "per-slot"])
def test_the_reference_adds_each_tokens_own_adapter(num_tokens: int) -> None:
    """Both of the reference's ways (every slot at once for a few tokens, a product per slot
    present for many) give each token ``scaling[s] * B_s @ A_s @ x`` and the base's nothing."""
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 3, 10, generator=generator), torch.randn(4, 6, 3, generator=generator)
    scaling = torch.tensor([1.0, 2.0, 0.5, 3.0])
    x, base = torch.randn(num_tokens, 10, generator=generator), torch.randn(num_tokens, 6)
    slot_of_token = torch.randint(-1, 3, (num_tokens,), generator=generator)  # slot 3 unused
    got = add_lora_ref(base.clone(), x, slot_of_token, a, b.transpose(1, 2).contiguous(), scaling)
    expected = base.clone()
    for t, slot in enumerate(slot_of_token.tolist()):
        if slot >= 0:
            expected[t] += scaling[slot] * (b[slot] @ (a[slot] @ x[t]))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
