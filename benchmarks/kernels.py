"""``kvswitch bench kernels``: the paged-attention kernels on a CUDA GPU, in bf16.

- paged_decode: achieved HBM bandwidth (bytes of K/V read / time), as a fraction of the device's
  datasheet peak and of a measured device-to-device copy;
- paged_prefill: TFLOP/s beside torch's scaled_dot_product_attention on contiguous K/V of the
  same shapes, measured in the same run;
- store_kv: GB/s moved (rows read plus rows written).

Every kernel's output is checked against its torch reference before it is timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks.timing import BenchmarkUnavailable, machine_info

if TYPE_CHECKING:
    import torch

# Datasheet HBM bandwidth in bytes/s, by a substring of the device name (SXM parts).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


@dataclass(frozen=True)
class KernelBenchConfig:
    decode_batch: int = 64
    decode_context: int = 4096
    prefill_batch: int = 4
    prefill_tokens: int = 4096
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    store_tokens: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        for name in ("decode_batch", "decode_context", "prefill_batch", "prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


def _paged_cache(num_seqs: int, seq_len: int, config: KernelBenchConfig, gen: torch.Generator):
    """A bf16 cache holding ``num_seqs`` sequences of ``seq_len`` tokens on scattered pages."""
    import torch

    pages_per_seq = math.ceil(seq_len / config.block_size)
    num_blocks = num_seqs * pages_per_seq
    shape = (num_blocks, config.block_size, config.num_kv_heads, config.head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = order.view(num_seqs, pages_per_seq).cuda()
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, block_tables, seq_lens


def _copy_bandwidth(do_bench) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    import torch

    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def run(config: KernelBenchConfig) -> dict:
    # NOTE: torch is imported here, not at the top, so that `kvswitch --help` starts fast.
    import torch

    if not torch.cuda.is_available():
        raise BenchmarkUnavailable(
            "bench kernels needs a CUDA GPU: none is visible to torch here. The kernels "
            "are tested on CPU through Triton's interpreter (make test); their speed is measured "
            "on a GPU only."
        )
    from triton.testing import do_bench

    from kernels import paged_decode, paged_decode_ref, paged_prefill, store_kv, store_kv_ref

    gen = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    name = torch.cuda.get_device_name()
    scale = config.head_dim**-0.5
    tolerance = {"atol": 1.5e-2, "rtol": 1e-2}
    results: dict = {"device": name, "machine": machine_info()}

    # -- paged_decode: memory bound, so bandwidth is the figure --------------------------------
    batch, context = config.decode_batch, config.decode_context
    k_cache, v_cache, block_tables, seq_lens = _paged_cache(batch, context, config, gen)
    query = torch.randn(
        batch, config.num_q_heads, config.head_dim, dtype=torch.bfloat16, device="cuda"
    )
    out = paged_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=context)
    check = slice(0, 2)
    ref = paged_decode_ref(
        query[check], k_cache, v_cache, block_tables[check], seq_lens[check], scale
    )
    torch.testing.assert_close(out[check], ref, **tolerance)
    decode_ms = do_bench(
        lambda: paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=context, out=out
        )
    )
    kv_bytes = 2 * batch * context * config.num_kv_heads * config.head_dim * 2
    decode_bw = kv_bytes / (decode_ms * 1e-3)
    copy_bw = _copy_bandwidth(do_bench)
    peak_bw = next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)
    results.update(
        decode_ms=decode_ms,
        decode_bytes_per_s=decode_bw,
        copy_bytes_per_s=copy_bw,
        decode_fraction_of_copy=decode_bw / copy_bw,
        datasheet_bytes_per_s=peak_bw,
        decode_fraction_of_peak=decode_bw / peak_bw if peak_bw else None,
    )
    del k_cache, v_cache

    # -- paged_prefill: compute bound, against SDPA on contiguous K/V ------------------------
    batch, tokens = config.prefill_batch, config.prefill_tokens
    k_cache, v_cache, block_tables, seq_lens = _paged_cache(batch, tokens, config, gen)
    query = torch.randn(
        batch * tokens, config.num_q_heads, config.head_dim, dtype=torch.bfloat16, device="cuda"
    )
    cu_q_lens = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * tokens
    out = paged_prefill(
        query, k_cache, v_cache, block_tables, cu_q_lens, seq_lens, scale, max_q_len=tokens
    )
    # Contiguous copies of the same K/V for SDPA: [batch, heads, tokens, head_dim].
    pages = block_tables.long()
    k_dense = k_cache[pages].reshape(batch, -1, config.num_kv_heads, config.head_dim)[:, :tokens]
    v_dense = v_cache[pages].reshape(batch, -1, config.num_kv_heads, config.head_dim)[:, :tokens]
    q_sdpa = query.view(batch, tokens, config.num_q_heads, config.head_dim).transpose(1, 2)
    k_sdpa, v_sdpa = k_dense.transpose(1, 2).contiguous(), v_dense.transpose(1, 2).contiguous()
    q_sdpa = q_sdpa.contiguous()

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_sdpa, k_sdpa, v_sdpa, is_causal=True, scale=scale, enable_gqa=True
        )

    expected = sdpa().transpose(1, 2).reshape(batch * tokens, config.num_q_heads, config.head_dim)
    torch.testing.assert_close(out, expected, **tolerance)
    prefill_ms = do_bench(
        lambda: paged_prefill(
            query,
            k_cache,
            v_cache,
            block_tables,
            cu_q_lens,
            seq_lens,
            scale,
            max_q_len=tokens,
            out=out,
        )
    )
    sdpa_ms = do_bench(sdpa)
    # Causal: each query attends to (position + 1) keys; two matmuls of 2 flops per MAC.
    flops = 4 * batch * config.num_q_heads * config.head_dim * tokens * (tokens + 1) / 2
    results.update(
        prefill_ms=prefill_ms,
        prefill_tflops=flops / (prefill_ms * 1e-3) / 1e12,
        sdpa_ms=sdpa_ms,
        sdpa_tflops=flops / (sdpa_ms * 1e-3) / 1e12,
        prefill_vs_sdpa=sdpa_ms / prefill_ms,
    )
    del k_cache, v_cache

    # -- store_kv: bytes moved ------------------------------------------------------------------
    num_tokens = config.store_tokens
    num_blocks = math.ceil(num_tokens / config.block_size) * 2
    shape = (num_blocks, config.block_size, config.num_kv_heads, config.head_dim)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    rows = (num_tokens, config.num_kv_heads, config.head_dim)
    key = torch.randn(rows, dtype=torch.bfloat16, device="cuda")
    value = torch.randn(rows, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(num_blocks * config.block_size, generator=gen)[:num_tokens]
    slots = slots.to(torch.int32).cuda()
    store_kv(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    store_ms = do_bench(lambda: store_kv(key, value, k_cache, v_cache, slots))
    moved = 2 * 2 * key.numel() * key.element_size()  # K and V, each read once and written once
    results.update(store_ms=store_ms, store_bytes_per_s=moved / (store_ms * 1e-3))
    return results
