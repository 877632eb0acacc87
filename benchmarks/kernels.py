"""``kvswitch bench kernels``: the paged-attention kernels on a CUDA GPU, in bf16.

- paged_decode: achieved HBM bandwidth (bytes of K/V read / time), as a fraction of the device's
  datasheet peak and of a measured device-to-device copy;
- paged_prefill: TFLOP/s beside torch's scaled_dot_product_attention on contiguous K/V of the
  same shapes, measured in the same run;
- store_kv: GB/s moved (rows read plus rows written).

Every kernel's output is checked against its torch reference before it is timed. With
``--sweep`` the attention kernels are also timed under each tile choice of ``DECODE_SWEEP`` and
``PREFILL_SWEEP`` (and decode under several split counts, and the prefix hit under each of
``PREFIX_HIT_SWEEP``'s tiles and split counts), to show which defaults to keep.
``--device cpu`` runs every step through Triton's interpreter (``TRITON_INTERPRET=1``, tiny
shapes): it checks the benchmark itself; its timings mean nothing.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvswitch.benchmarks.timing import BenchmarkUnavailable, machine_info

if TYPE_CHECKING:
    import torch

# Datasheet HBM bandwidth in bytes/s, by a substring of the device name (SXM parts).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}

# (block_n, num_warps, num_stages) for paged_decode; (block_m, block_n, num_warps) x stages for
# paged_prefill. The launchers' defaults are among them.
DECODE_SWEEP = [(n, 4, s) for n in (16, 32, 64, 128) for s in (2, 3)] + [(64, 8, 2)]
PREFILL_SWEEP = [
    (m, n, w, s)
    for m, n, w in ((64, 16, 4), (64, 64, 4), (128, 32, 8), (128, 64, 8), (128, 128, 8))
    for s in (2, 3)
]
DECODE_SPLITS = (1, 2, 4, 8)
# (block_m, block_n, num_warps) for the prefix hit's one query tile per head, each under every
# split count of PREFIX_HIT_SPLITS (two stages); the interpreter times one row, its own tiles in
# two splits (each interpreted launch takes it seconds).
PREFIX_HIT_SWEEP = [(64, 64, 4), (128, 64, 8), (128, 128, 8)]
PREFIX_HIT_SPLITS = (1, 2, 4, 8, 16)
DTYPES = ("bfloat16", "float16", "float32")
TOLERANCES = {
    "bfloat16": {"atol": 1.5e-2, "rtol": 1e-2},
    "float16": {"atol": 2e-3, "rtol": 1e-3},
    "float32": {"atol": 1e-4, "rtol": 1e-4},
}


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
    # add_lora (kernels/lora.py): a decode batch's tokens over lora_slots adapters of rank
    # lora_rank, on a projection of num_q_heads x head_dim in and out.
    lora_tokens: int = 64
    lora_slots: int = 8
    lora_rank: int = 16
    dtype: str = "bfloat16"
    device: str = "cuda"
    sweep: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        for name in (
            "decode_batch",
            "decode_context",
            "prefill_batch",
            "prefill_tokens",
            "lora_tokens",
            "lora_slots",
            "lora_rank",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def _cpu_ms(fn: Callable[[], object]) -> float:
    """The wall time of one call: it exercises the step; under the interpreter no timing
    measures anything, so one call is enough (each costs seconds)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


class _Bench:
    """The data, the timer and the checks that every section shares."""

    def __init__(self, config: KernelBenchConfig) -> None:
        import torch

        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.tolerance = TOLERANCES[config.dtype]
        self.scale = config.head_dim**-0.5
        self.gen = torch.Generator().manual_seed(config.seed)
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            from triton.testing import do_bench

            self.time_ms: Callable[[Callable[[], object]], float] = do_bench
        else:
            self.time_ms = _cpu_ms

    def randn(self, *shape: int) -> torch.Tensor:
        import torch

        # NOTE: drawn on the device itself (seeded by torch.manual_seed): the decode cache is
        # 2 x 268 M values, too many to draw on the host and copy over.
        return torch.randn(shape, dtype=self.dtype, device=self.device)

    def paged_cache(self, num_seqs: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        """A cache holding ``num_seqs`` sequences of ``seq_len`` tokens on scattered pages."""
        import torch

        config = self.config
        pages_per_seq = math.ceil(seq_len / config.block_size)
        num_blocks = num_seqs * pages_per_seq
        shape = (num_blocks, config.block_size, config.num_kv_heads, config.head_dim)
        k_cache, v_cache = self.randn(*shape), self.randn(*shape)
        order = torch.randperm(num_blocks, generator=self.gen).to(torch.int32)
        block_tables = order.view(num_seqs, pages_per_seq).to(self.device)
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=self.device)
        return k_cache, v_cache, block_tables, seq_lens

    def copy_bytes_per_s(self) -> float:
        """Bytes/s of a device-to-device copy (read + write): 2 GiB on a GPU."""
        import torch

        numel = 2**30 if self.device.type == "cuda" else 2**20
        src = torch.empty(numel, dtype=torch.int16, device=self.device)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def run(config: KernelBenchConfig) -> dict:
    # NOTE: torch is imported here, not at the top, so that `kvswitch --help` starts fast.
    import torch

    from kvswitch.kernels.layout import interpreting

    if config.device == "cuda" and not torch.cuda.is_available():
        raise BenchmarkUnavailable(
            "bench kernels needs a CUDA GPU: none is visible to torch here. The kernels "
            "are tested on CPU through Triton's interpreter (make test); their speed is measured "
            "on a GPU only."
        )
    if config.device == "cpu" and not interpreting():
        raise BenchmarkUnavailable(
            "bench kernels --device cpu runs the kernels through Triton's interpreter: set "
            "TRITON_INTERPRET=1 and use tiny shapes"
        )
    bench = _Bench(config)
    name = torch.cuda.get_device_name() if config.device == "cuda" else "cpu (interpreter)"
    results: dict[str, Any] = {
        "device": name,
        "dtype": config.dtype,
        "machine": machine_info(),
    }
    results.update(_decode(bench, name))
    results.update(_prefill(bench))
    results.update(_store(bench))
    results.update(_lora(bench))
    return results


def _decode(bench: _Bench, device_name: str) -> dict[str, Any]:
    """paged_decode: memory bound, so bandwidth is the figure."""
    import torch

    from kvswitch.kernels import paged_decode, paged_decode_ref
    from kvswitch.kernels.tiles import Tiles

    config = bench.config
    batch, context = config.decode_batch, config.decode_context
    k_cache, v_cache, block_tables, seq_lens = bench.paged_cache(batch, context)
    query = bench.randn(batch, config.num_q_heads, config.head_dim)
    args = (query, k_cache, v_cache, block_tables, seq_lens, bench.scale)
    check = slice(0, 2)
    ref = paged_decode_ref(
        query[check], k_cache, v_cache, block_tables[check], seq_lens[check], bench.scale
    )
    out = torch.empty_like(query)

    def timed_ms(**options: Any) -> float:
        got = paged_decode(*args, max_seq_len=context, **options)
        torch.testing.assert_close(got[check], ref, **bench.tolerance)
        return bench.time_ms(lambda: paged_decode(*args, max_seq_len=context, out=out, **options))

    kv_bytes = 2 * k_cache.element_size() * batch * context * config.num_kv_heads * config.head_dim
    decode_ms = timed_ms()
    decode_bw = kv_bytes / (decode_ms * 1e-3)
    copy_bw = bench.copy_bytes_per_s()
    peak_bw = next((bw for key, bw in PEAK_BANDWIDTH.items() if key in device_name), None)
    results: dict[str, Any] = {
        "decode_ms": decode_ms,
        "decode_bytes_per_s": decode_bw,
        "copy_bytes_per_s": copy_bw,
        "decode_fraction_of_copy": decode_bw / copy_bw,
        "datasheet_bytes_per_s": peak_bw,
        "decode_fraction_of_peak": decode_bw / peak_bw if peak_bw else None,
    }
    if config.sweep:
        rows = []
        for n, w, s in DECODE_SWEEP:
            tiles = Tiles(block_n=n, num_warps=w, num_stages=s)
            rows.append(
                {"block_n": n, "num_warps": w, "num_stages": s, "ms": timed_ms(tiles=tiles)}
            )
        rows += [{"num_splits": n, "ms": timed_ms(num_splits=n)} for n in DECODE_SPLITS]
        for row in rows:
            row["bytes_per_s"] = kv_bytes / (row["ms"] * 1e-3)
            _progress(f"paged_decode {row}")
        results["decode_sweep"] = rows
    return results


def _prefill(bench: _Bench) -> dict[str, Any]:
    """paged_prefill: compute bound, against SDPA on contiguous K/V of the same shapes."""
    import torch

    from kvswitch.kernels import paged_prefill
    from kvswitch.kernels.tiles import Tiles

    config = bench.config
    batch, tokens = config.prefill_batch, config.prefill_tokens
    heads, head_dim = config.num_q_heads, config.head_dim
    k_cache, v_cache, block_tables, seq_lens = bench.paged_cache(batch, tokens)
    query = bench.randn(batch * tokens, heads, head_dim)
    cu_q_lens = torch.arange(0, batch + 1, dtype=torch.int32, device=bench.device) * tokens
    args = (query, k_cache, v_cache, block_tables, cu_q_lens, seq_lens, bench.scale)
    # Contiguous copies of the same K/V for SDPA: [batch, heads, tokens, head_dim].
    pages = block_tables.long()
    k_dense = k_cache[pages].reshape(batch, -1, config.num_kv_heads, head_dim)[:, :tokens]
    v_dense = v_cache[pages].reshape(batch, -1, config.num_kv_heads, head_dim)[:, :tokens]
    q_sdpa = query.view(batch, tokens, heads, head_dim).transpose(1, 2).contiguous()
    k_sdpa, v_sdpa = k_dense.transpose(1, 2).contiguous(), v_dense.transpose(1, 2).contiguous()

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_sdpa, k_sdpa, v_sdpa, is_causal=True, scale=bench.scale, enable_gqa=True
        )

    expected = sdpa().transpose(1, 2).reshape(batch * tokens, heads, head_dim)
    out = torch.empty_like(query)

    def timed_ms(tiles: Tiles | None = None) -> float:
        got = paged_prefill(*args, max_q_len=tokens, tiles=tiles)
        torch.testing.assert_close(got, expected, **bench.tolerance)
        return bench.time_ms(lambda: paged_prefill(*args, max_q_len=tokens, tiles=tiles, out=out))

    # Causal: each query attends to (position + 1) keys; two matmuls of 2 flops per MAC.
    flops = 4 * batch * heads * head_dim * tokens * (tokens + 1) / 2
    prefill_ms = timed_ms()
    sdpa_ms = bench.time_ms(sdpa)
    results: dict[str, Any] = {
        "prefill_ms": prefill_ms,
        "prefill_tflops": flops / (prefill_ms * 1e-3) / 1e12,
        "sdpa_ms": sdpa_ms,
        "sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
        "prefill_vs_sdpa": sdpa_ms / prefill_ms,
    }
    results.update(_prefix_hit(bench, query, k_cache, v_cache, block_tables, tokens))
    if config.sweep:
        rows = []
        for m, n, w, s in PREFILL_SWEEP:
            ms = timed_ms(Tiles(block_m=m, block_n=n, num_warps=w, num_stages=s))
            row = {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s, "ms": ms}
            row.update(tflops=flops / (ms * 1e-3) / 1e12, vs_sdpa=sdpa_ms / ms)
            _progress(f"paged_prefill {row}")
            rows.append(row)
        results["prefill_sweep"] = rows
    return results


def _prefix_hit(
    bench: _Bench,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tokens: int,
) -> dict[str, Any]:
    """A prompt's last 128 tokens over its cached rest (the warm step of ``bench ttft``): one
    query tile per head, its context split across programs by default, against no split."""
    import torch

    from kvswitch.kernels import paged_prefill
    from kvswitch.kernels.layout import interpreting
    from kvswitch.kernels.paged_decode import num_sms
    from kvswitch.kernels.paged_prefill import choose_prefill_splits
    from kvswitch.kernels.tiles import Tiles, prefill_tiles

    new = min(128, tokens)
    device = bench.device
    cu_q_lens = torch.tensor([0, new], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    args = (query[:new], k_cache, v_cache, block_tables[:1], cu_q_lens, seq_lens, bench.scale)
    tiles = prefill_tiles(new, k_cache.shape[1], k_cache.dtype)
    splits = choose_prefill_splits(
        query.shape[1] * -(-new // tiles.block_m), tokens - new, tiles.block_n, num_sms(device)
    )
    split_out = paged_prefill(*args, max_q_len=new, max_seq_len=tokens)
    whole_out = paged_prefill(*args, max_q_len=new, max_seq_len=tokens, num_splits=1)
    torch.testing.assert_close(split_out, whole_out, **bench.tolerance)
    out = torch.empty_like(split_out)
    split_ms = bench.time_ms(
        lambda: paged_prefill(*args, max_q_len=new, max_seq_len=tokens, out=out)
    )
    whole_ms = bench.time_ms(
        lambda: paged_prefill(*args, max_q_len=new, max_seq_len=tokens, num_splits=1, out=out)
    )
    _progress(f"paged_prefill prefix hit: {splits} splits {split_ms:.3f} ms, one {whole_ms:.3f} ms")
    results: dict[str, Any] = {
        "prefix_hit_new_tokens": new,
        "prefix_hit_splits": splits,
        "prefix_hit_ms": split_ms,
        "prefix_hit_unsplit_ms": whole_ms,
    }
    if bench.config.sweep:
        rows = []
        sweep, split_counts = PREFIX_HIT_SWEEP, PREFIX_HIT_SPLITS
        if interpreting():
            sweep, split_counts = [(tiles.block_m, tiles.block_n, tiles.num_warps)], (2,)
        for (m, n, w), num_splits in itertools.product(sweep, split_counts):
            options = {
                "max_q_len": new,
                "max_seq_len": tokens,
                "num_splits": num_splits,
                "tiles": Tiles(block_m=m, block_n=n, num_warps=w, num_stages=2),
            }
            got = paged_prefill(*args, **options)
            torch.testing.assert_close(got, whole_out, **bench.tolerance)
            ms = bench.time_ms(lambda options=options: paged_prefill(*args, **options, out=out))
            row = {"block_m": m, "block_n": n, "num_warps": w, "num_splits": num_splits, "ms": ms}
            _progress(f"paged_prefill prefix hit {row}")
            rows.append(row)
        results["prefix_hit_sweep"] = rows
    return results


def _store(bench: _Bench) -> dict[str, Any]:
    """store_kv: bytes moved."""
    import torch

    from kvswitch.kernels import store_kv, store_kv_ref

    config = bench.config
    num_tokens = config.store_tokens
    num_blocks = math.ceil(num_tokens / config.block_size) * 2
    shape = (num_blocks, config.block_size, config.num_kv_heads, config.head_dim)
    k_cache = torch.zeros(shape, dtype=bench.dtype, device=bench.device)
    v_cache = torch.zeros_like(k_cache)
    key = bench.randn(num_tokens, config.num_kv_heads, config.head_dim)
    value = bench.randn(num_tokens, config.num_kv_heads, config.head_dim)
    slots = torch.randperm(num_blocks * config.block_size, generator=bench.gen)[:num_tokens]
    slots = slots.to(torch.int32).to(bench.device)
    store_kv(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    store_ms = bench.time_ms(lambda: store_kv(key, value, k_cache, v_cache, slots))
    moved = 2 * 2 * key.numel() * key.element_size()  # K and V, each read once and written once
    return {"store_ms": store_ms, "store_bytes_per_s": moved / (store_ms * 1e-3)}


def _lora(bench: _Bench) -> dict[str, Any]:
    """add_lora: each token's adapter shrunk and expanded (every slot in use); the bytes it
    must move are the adapters' weights, read once, and the rows in and out."""
    import torch

    from kvswitch.kernels.lora import add_lora
    from kvswitch.kernels.reference import add_lora_ref

    config = bench.config
    num_tokens, num_slots, rank = config.lora_tokens, config.lora_slots, config.lora_rank
    width = config.num_q_heads * config.head_dim
    x = bench.randn(num_tokens, width)
    y = bench.randn(num_tokens, width)
    a = bench.randn(num_slots, rank, width) * 0.05
    b_t = bench.randn(num_slots, rank, width) * 0.05
    scaling = torch.full((num_slots,), 2.0, device=bench.device)
    slot_of_token = (torch.arange(num_tokens, device=bench.device) % num_slots).to(torch.int64)
    # NOTE: into a copy of y: in float32 y.float() is y itself, and both add in place.
    want = add_lora_ref(
        y.float().clone(), x.float(), slot_of_token, a.float(), b_t.float(), scaling
    )
    got = add_lora(y.clone(), x, slot_of_token, a, b_t, scaling)
    torch.testing.assert_close(got.float(), want, **bench.tolerance)
    out = y.clone()
    lora_ms = bench.time_ms(lambda: add_lora(out, x, slot_of_token, a, b_t, scaling))
    element = x.element_size()
    moved = (a.numel() + b_t.numel() + 3 * x.numel()) * element  # weights; x; y read + written
    return {"lora_ms": lora_ms, "lora_bytes_per_s": moved / (lora_ms * 1e-3)}
