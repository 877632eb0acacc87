"""The kernels compile for A100 and H100 as the launchers would launch them, without a GPU.

The compile runs in a child process: this one imported the kernels under the interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvswitch.app.cli import main
from kvswitch.kernels.aot import (
    ARCHS,
    SHAPES,
    Shape,
    async_copy_widths,
    global_load_widths,
    mma_kind,
    programs_per_sm,
)
from kvswitch.kernels.layout import interpreting

PTX = """
    ld.global.b32 { %r46 }, [ %rd7 + 0 ];
    @%p19 ld.global.v4.b32 { %r47, %r48, %r49, %r50 }, [ %rd8 + 0 ];
    @%p1 ld.global.nc.v2.b16 { %rs1, %rs2 }, [ %rd9 + 0 ];
    @%p2 cp.async.ca.shared.global [ %r62 + 0 ], [ %rd10 + 0 ], 0x4, %r55;
    cp.async.cg.shared.global [ %r56 + 0 ], [ %rd11 + 0 ], 0x10, %r59;
    cp.async.cg.shared.global [ %r57 + 0 ], [ %rd12 + 0 ], 0x10, %r61;
    cp.async.commit_group;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {...};
"""


def test_ptx_is_read_for_load_widths_and_tensor_cores() -> None:
    assert global_load_widths(PTX) == {4: 2, 16: 1}
    assert async_copy_widths(PTX) == {4: 1, 16: 2}
    assert mma_kind(PTX) == "mma.sync"
    assert mma_kind("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16") == "wgmma"
    assert mma_kind("fma.rn.f32") == "none"


def test_programs_per_sm_takes_the_tightest_limit() -> None:
    h100 = ARCHS[90]
    # 64 registers x 128 threads: 8 programs by registers; 2048 threads allow 16.
    assert programs_per_sm(h100, registers=64, shared_bytes=0, num_warps=4) == 8
    # 65 registers round up to 72 per thread (256 per warp).
    assert programs_per_sm(h100, registers=65, shared_bytes=0, num_warps=4) == 7
    # 100 KiB of shared memory each (plus 1 KiB reserved): two fit in 228 KiB.
    assert programs_per_sm(h100, registers=32, shared_bytes=100 * 1024, num_warps=4) == 2
    assert programs_per_sm(ARCHS[80], registers=32, shared_bytes=100 * 1024, num_warps=4) == 1
    # Small programs are capped by threads, then by the 32-program limit.
    assert programs_per_sm(h100, registers=16, shared_bytes=0, num_warps=4) == 16
    assert programs_per_sm(h100, registers=16, shared_bytes=0, num_warps=1) == 32


@pytest.mark.skipif(not interpreting(), reason="this process runs compiled kernels")
def test_compile_refuses_to_run_under_the_interpreter(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernels", "compile"]) == 1
    assert "TRITON_INTERPRET unset" in capsys.readouterr().err


@dataclasses.dataclass
class _Compile:
    process: subprocess.Popen[str]
    out: Path

    def report(self) -> list[dict]:
        stdout, stderr = self.process.communicate(timeout=600)
        assert self.process.returncode == 0, stderr
        assert "paged_prefill_kernel" in stdout  # the table
        return json.loads(self.out.read_text())


@pytest.fixture(scope="module")
def compiles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, _Compile]]:
    """``kvswitch kernels compile`` for each architecture, all started at once: each is a
    single-threaded minute of compiling, and the machine has more than one core."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    started = {}
    for arch in (80, 90):
        tmp_path = tmp_path_factory.mktemp(f"sm{arch}")
        out = tmp_path / f"sm{arch}.json"
        command = ["kernels", "compile", "--arch", str(arch), "--json", str(out)]
        process = subprocess.Popen(
            [sys.executable, "-m", "kvswitch", *command],
            env={**env, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started[arch] = _Compile(process, out)
    try:
        yield started
    finally:
        for compile_ in started.values():
            if compile_.process.poll() is None:  # a test failed before it waited for this one
                compile_.process.kill()
                compile_.process.communicate()


def _kernels(shape: Shape) -> list[str]:
    """The kernels ``kernels compile`` compiles for one shape, in its order."""
    split = ["_paged_decode_kernel", "_merge_splits_kernel"]
    return [
        "_rms_norm_kernel",
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_store_kv_kernel",
        "_paged_decode_kernel",
        *split,
        *split * len(shape.graph_splits),
        "_paged_prefill_kernel",
        "_paged_prefill_kernel",
    ]


def _spills_today(entry: dict, arch: int) -> bool:
    """The launches that spill with Triton 3.9, each a kernel to fix (docs/BENCHMARKS.md)."""
    constexprs = entry["constexprs"]
    if arch == 80 and entry["kernel"] == "_paged_prefill_kernel":
        return constexprs["BLOCK_M"] == 128  # 128 x 128 tiles at the 255-register cap
    if arch == 80 and entry["kernel"] == "_paged_decode_kernel":
        return constexprs["DOT_FP32"] and not constexprs["SPLIT"]  # one 8-byte spill
    return False


@pytest.mark.parametrize("arch", [80, 90])
def test_every_kernel_compiles_and_fits_and_only_the_known_launches_spill(
    arch: int, compiles: dict[int, _Compile]
) -> None:
    report = compiles[arch].report()
    assert [entry["kernel"] for entry in report] == [k for s in SHAPES for k in _kernels(s)]
    merges = [e["constexprs"] for e in report if e["kernel"] == "_merge_splits_kernel"]
    # 4 splits, then a decode graph's 66, 256 and 528 for each head_dim (taken 16 at a time);
    # 4 for the other shapes.
    assert [c["SPLIT_CHUNK"] for c in merges] == [4, 16, 16, 16] * 2 + [4] * 3
    for entry in report:
        label = f"{entry['case']} {entry['kernel']}"
        assert entry["arch"] == arch
        if _spills_today(entry, arch):
            assert entry["local_bytes"] > 0, f"{label} no longer spills: update _spills_today"
        else:
            assert entry["local_bytes"] == 0, f"{label} spills registers"
        assert entry["programs_per_sm"] >= 1, f"{label} does not fit on a multiprocessor"
        if entry["kernel"] == "_rms_norm_kernel":
            # A row (and the residual's) is read 16 bytes at a time, nothing narrower.
            assert set(entry["global_load_bytes"]) == {"16"}, label
        if entry["kernel"] in ("_paged_decode_kernel", "_paged_prefill_kernel"):
            # K/V tiles stream into shared memory 16 bytes per copy.
            assert "16" in entry["async_copy_bytes"], label
            fp32 = entry["constexprs"]["DOT_FP32"]
            if fp32:
                assert entry["mma"] == "none", label
            elif entry["constexprs"].get("BLOCK_M", 0) >= 64 and arch == 90:
                # Hopper's warp-group MMA takes 64 rows per warp group.
                assert entry["mma"] == "wgmma", label
            else:
                assert entry["mma"] == "mma.sync", label
    split = [e for e in report if e["kernel"] == "_paged_decode_kernel"]
    assert {e["constexprs"]["SPLIT"] for e in split} == {True, False}
