"""rms_norm and rotary against their references, and the model that switches between them.

The kernels run through the interpreter on CPU (tiny shapes): odd sizes, GQA head counts,
positions out of order, strided views, rows where eps decides the result. The model's CPU path is
pinned to the unfused decoder it replaced, bit for bit; on a GPU its fused forward must match it.
"""

from __future__ import annotations

import pytest
import torch

from kvswitch.kernels import rms_norm, rms_norm_ref, rotary, rotary_ref
from kvswitch.kernels.layout import interpreting
from kvswitch.worker.attention import AttentionMetadata
from kvswitch.worker.model import CausalLM
from kvswitch.worker.model_config import ModelConfig
from kvswitch.worker.model_runner import ModelRunner, ScheduledSeq
from kvswitch.worker.rope import RopeConfig
from tests.kernels.paged_case import DEVICE, DTYPES, TOLERANCES, gpu_test

EPS = 1e-5


def _rows(num_tokens: int, hidden_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, as a strided view (every row padded by 8 columns), with row 1 all zeros
    and row 2 so small that eps outweighs its mean square."""
    gen = torch.Generator().manual_seed(seed)
    padded = torch.randn(num_tokens, hidden_size + 8, generator=gen) * 2
    padded[1] = 0
    padded[2] *= 1e-3
    return padded.to(dtype).to(DEVICE)[:, :hidden_size]


def _weight(hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return (torch.rand(hidden_size, generator=gen) + 0.5).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [24, 40, 256])
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden_size: int) -> None:
    x, weight = _rows(6, hidden_size, dtype, seed=hidden_size), _weight(hidden_size, dtype)
    assert x.stride(0) == hidden_size + 8
    want = rms_norm_ref(x, weight, EPS)
    got = rms_norm(x, weight, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # 0 * rsqrt(0 + eps), not NaN
    if dtype != torch.float32:
        # Rounded where the reference rounds (the normalized row to the dtype, then the product):
        # rounding once instead changes a quarter of the fp16 values. (In fp32 the sum's order
        # alone moves whole rows by an ulp.)
        assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [40, 8192])
def test_rms_norm_adds_the_residual_first_and_returns_the_sum(
    dtype: torch.dtype, hidden_size: int
) -> None:
    x, weight = _rows(3, hidden_size, dtype, seed=1), _weight(hidden_size, dtype)
    residual = _rows(3, hidden_size, dtype, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    want_out, want_sum = rms_norm_ref(x, weight, EPS, residual)
    got_out, got_sum = rms_norm(x, weight, EPS, residual)
    assert torch.equal(got_sum, want_sum)  # one rounding of an add: exactly torch's
    torch.testing.assert_close(got_out, want_out, **TOLERANCES[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_of_no_rows() -> None:
    x = torch.zeros(0, 16, device=DEVICE)
    out, total = rms_norm(x, torch.ones(16, device=DEVICE), EPS, x)
    assert out.shape == total.shape == (0, 16)


def test_rms_norm_rejects_bad_input() -> None:
    x = torch.zeros(3, 16, device=DEVICE)
    weight = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, hidden_size\]"):
        rms_norm(x[None], weight, EPS)
    with pytest.raises(ValueError, match="x dtype must be one of"):
        rms_norm(x.double(), weight.double(), EPS)
    with pytest.raises(ValueError, match="hidden dimension must be contiguous"):
        rms_norm(x.t(), weight[:3], EPS)
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[16\] tensor"):
        rms_norm(x, weight[:8], EPS)
    with pytest.raises(ValueError, match="they must match"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="residual is"):
        rms_norm(x, weight, EPS, x[:2])
    with pytest.raises(ValueError, match="residual dtype must be one of"):
        rms_norm(x, weight, EPS, x.long())
    wide = torch.zeros(1, 32769, device=DEVICE)
    with pytest.raises(ValueError, match="exceeds the kernel's 32768"):
        rms_norm(wide, torch.ones(32769, device=DEVICE), EPS)


def _table(head_dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    # NOTE: yarn, so that cos and sin carry a scale other than 1 (sin^2 + cos^2 != 1).
    rope = RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    cos, sin = rope.cos_sin(head_dim, 64)
    return cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)


POSITIONS = [5, 0, 63, 17, 17, 2, 40]  # out of order, repeated, the table's last row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim", [(4, 2, 24), (6, 1, 40), (3, 3, 16), (8, 2, 64)]
)
def test_rotary_matches_reference_on_views_of_a_projection(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """q and k are views of one fused QKV output ([tokens, (Hq + 2 Hkv) * D]); v must be left
    as it was."""
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens = len(POSITIONS)
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, :q_width].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, q_width + kv_width :].clone()
    cos, sin = _table(head_dim)
    positions = torch.tensor(POSITIONS, device=DEVICE)
    want_q, want_k = rotary_ref(q, k, cos, sin, positions)
    rotary(q, k, cos, sin, positions)
    torch.testing.assert_close(q, want_q, **TOLERANCES[dtype])
    torch.testing.assert_close(k, want_k, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, q_width + kv_width :], v_before)


def test_rotary_strided_heads_and_a_table_in_the_models_dtype() -> None:
    """Heads spaced wider than head_dim (the gaps stay untouched), and fp16 tables, as a model
    cast to fp16 holds them: the math still runs in fp32 on the table's values."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, head_dim = len(POSITIONS), 24
    q_wide = torch.randn(num_tokens, 2, 2 * head_dim, generator=gen).half().to(DEVICE)
    k_wide = torch.randn(num_tokens, 1, 2 * head_dim, generator=gen).half().to(DEVICE)
    q, k = q_wide[:, :, :head_dim], k_wide[:, :, :head_dim]
    gaps = q_wide[:, :, head_dim:].clone(), k_wide[:, :, head_dim:].clone()
    cos, sin = _table(head_dim, torch.float16)
    positions = torch.tensor(POSITIONS, device=DEVICE)
    want_q, want_k = rotary_ref(q, k, cos, sin, positions)
    rotary(q, k, cos, sin, positions)
    torch.testing.assert_close(q, want_q, **TOLERANCES[torch.float16])
    torch.testing.assert_close(k, want_k, **TOLERANCES[torch.float16])
    assert torch.equal(q_wide[:, :, head_dim:], gaps[0])
    assert torch.equal(k_wide[:, :, head_dim:], gaps[1])


def test_rotary_rejects_bad_input() -> None:
    q = torch.zeros(3, 4, 16, device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    cos, sin = _table(16)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"q must be \[num_tokens, num_heads, head_dim\]"):
        rotary(q[0], k, cos, sin, positions)
    with pytest.raises(ValueError, match="k head_dim must be contiguous"):
        rotary(q, k.transpose(1, 2), cos, sin, positions)
    with pytest.raises(ValueError, match="must agree on num_tokens, head_dim and dtype"):
        rotary(q, k.half(), cos, sin, positions)
    with pytest.raises(ValueError, match="must agree"):
        rotary(q, k[:2], cos, sin, positions)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rotary(q[..., :15], k[..., :15], cos, sin, positions)
    with pytest.raises(ValueError, match=r"cos must be a \[max_positions, 8\] table"):
        rotary(q, k, cos[:, :4], sin, positions)
    with pytest.raises(ValueError, match="cos and sin must have one shape, dtype and layout"):
        rotary(q, k, cos, sin.half(), positions)
    with pytest.raises(ValueError, match=r"positions must be a \[3\] int64 tensor"):
        rotary(q, k, cos, sin, positions.int())
    with pytest.raises(ValueError, match="positions must be contiguous"):
        rotary(q, k, cos, sin, torch.zeros(6, dtype=torch.int64, device=DEVICE)[::2])


# -- the model -------------------------------------------------------------------------------


def _model(dtype: torch.dtype, device: torch.device | str = "cpu") -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.random_preset("tiny"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.copy_(torch.rand_like(param) + 0.5)  # not all ones: the scale must count
    return model.to(device=device, dtype=dtype).eval()


def _prefill(model: CausalLM, num_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sequence's prefill through ``model.model``: final hidden states and the K caches."""
    config = model.config
    block_size = 4
    num_blocks = -(-num_tokens // block_size)
    device = model.lm_head.weight.device
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    kv_caches = [
        (
            torch.zeros(shape, dtype=model.lm_head.weight.dtype, device=device),
            torch.zeros(shape, dtype=model.lm_head.weight.dtype, device=device),
        )
        for _ in range(config.num_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        cu_q_lens=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        max_q_len=num_tokens,
        max_seq_len=num_tokens,
    )
    input_ids = torch.randint(0, 257, (num_tokens,), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(num_tokens, device=device)
    with torch.inference_mode():
        hidden = model.model(input_ids.to(device), positions, kv_caches, meta)
    return hidden, [k for k, _ in kv_caches]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_forward_is_the_unfused_decoder_bit_for_bit(dtype: torch.dtype) -> None:
    """Carrying the residual into the next norm computes exactly what ``x = x + attn(norm(x));
    x = x + mlp(norm(x))`` computed: the same adds, in the same order, in the same dtype."""
    model = _model(dtype)
    fused, _ = _prefill(model, 9)
    inner = model.model

    def unfused(input_ids, positions, kv_caches, meta):
        x = inner.embed_tokens(input_ids)
        for layer, kv_cache in zip(inner.layers, kv_caches, strict=True):
            normed = layer.input_layernorm(x)
            x = x + layer.self_attn(normed, positions, inner.rotary, kv_cache, meta)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return inner.norm(x)

    inner.forward = unfused  # NOTE: on this instance only: the old layer loop, same modules
    want, _ = _prefill(model, 9)
    assert torch.equal(fused, want)


@pytest.mark.skipif(not interpreting(), reason="Triton runs CPU tensors only in its interpreter")
def test_the_models_kernel_path_through_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's CUDA branch (fused norms, in-place rotary), run on CPU tensors through the
    interpreter, against its CPU branch. Attention keeps its own switch (the CPU references)."""
    model = _model(torch.float32)
    want_hidden, want_keys = _prefill(model, 6)
    monkeypatch.setattr("kvswitch.worker.model.use_triton", lambda device: True)
    got_hidden, got_keys = _prefill(model, 6)
    torch.testing.assert_close(got_hidden, want_hidden, atol=1e-5, rtol=1e-5)
    for got, want in zip(got_keys, want_keys, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _serve(model: CausalLM) -> list[torch.Tensor]:
    """Logits of a two-sequence prefill (every token) and two batched decode steps."""
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 257, (19,), generator=gen).tolist()
    b = torch.randint(0, 257, (8,), generator=gen).tolist()
    blocks_a, blocks_b = [9, 2, 14, 5, 11, 12], [15, 1, 3]
    logits = [
        runner.execute(
            [ScheduledSeq(a, 0, blocks_a), ScheduledSeq(b, 0, blocks_b)], every_token=True
        )
    ]
    for step in range(2):
        logits.append(
            runner.execute(
                [
                    ScheduledSeq([3 + step], 19 + step, blocks_a),
                    ScheduledSeq([9], 8 + step, blocks_b),
                ]
            )
        )
    return [x.cpu() for x in logits]


@gpu_test
def test_cuda_forward_with_fused_kernels_matches_the_cpu_forward() -> None:
    want = _serve(_model(torch.float32))
    for got, ref in zip(_serve(_model(torch.float32, "cuda")), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # bf16 rounds differently on the two devices (matmuls accumulate in other orders): the fused
    # path must be about as close to the fp32 forward as the CPU's bf16 forward is.
    cpu_bf16 = _serve(_model(torch.bfloat16))
    cuda_bf16 = _serve(_model(torch.bfloat16, "cuda"))
    for got, cpu, ref in zip(cuda_bf16, cpu_bf16, want, strict=True):
        cpu_error = (cpu - ref).abs().max().item()
        assert (got - ref).abs().max().item() <= 2 * cpu_error + 0.02
        torch.testing.assert_close(got, cpu, atol=0.2, rtol=0.1)
