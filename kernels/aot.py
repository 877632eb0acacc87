"""Compile the kernels for a GPU architecture on a machine without one, and report what came out.

Triton needs a device only to launch a kernel, not to compile it. ``compile_report`` runs the real
launchers on small CPU tensors of the shapes that matter, catches each launch instead of running
it, and compiles it for the chosen architecture the way the JIT would on that GPU: the same
constexprs, the same integer and pointer specializations, the same default warps and stages. For
each launch it reads off the result:

- registers per thread and local-memory bytes per thread (spills, which ptxas puts in the
  stack frame), as ptxas allocated them in the cubin;
- shared memory per program, and how many programs fit on one multiprocessor at once;
- the widths of the global loads and of the asynchronous copies into shared memory that the
  pipeliner makes of a loop's loads (16-byte accesses are what keep HBM busy);
- which tensor-core instruction the dots became (``wgmma`` on Hopper, ``mma.sync`` before it,
  ``none`` for the fp32 path).

It measures no speed; ``kvswitch bench kernels`` does that on a GPU.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvswitch.kernels.layout import interpreting


class CompileUnavailable(RuntimeError):
    """This process cannot compile the kernels (interpreter on, or a Triton it cannot drive)."""


@dataclass(frozen=True)
class Arch:
    """The per-multiprocessor limits that bound how many programs run at once."""

    capability: int
    name: str
    shared_bytes_per_sm: int
    registers_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_programs_per_sm: int = 32
    # NOTE: the runtime keeps 1 KiB of shared memory per resident program on sm_80 and later.
    reserved_shared_bytes: int = 1024


ARCHS = {
    80: Arch(80, "A100", shared_bytes_per_sm=164 * 1024),
    90: Arch(90, "H100/H200", shared_bytes_per_sm=228 * 1024),
}


@dataclass(frozen=True)
class CompileReportConfig:
    arch: int = 90

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)} (compute capability x10)")


@dataclass(frozen=True)
class Shape:
    """A model's attention shape, as the kernels see it."""

    label: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    # Split counts of decode CUDA graphs whose merge to compile as well. The merge depends on
    # head_dim and the split count alone (and the output's dtype), so one shape per head_dim does.
    graph_splits: tuple[int, ...] = ()


# A decode CUDA graph launches paged_decode for the model's whole context, so its split count is
# the one that fills the multiprocessors four deep (choose_num_splits): on an H100's 132, 66 at
# batch 1 over 8 KV heads, 256 over 2 KV heads at 16K tokens, 528 over one KV head; the merge
# pads them to 128, 256 and 1,024 rows. (The decode kernel compiles as for any split count.)
GRAPH_SPLITS = (66, 256, 528)

# The shape of `kvswitch bench kernels`, the `random:llama-1b` worker model, the GQA extremes
# the tests cover, and the fp32 path (no tensor cores).
SHAPES = (
    Shape("bench 32q/8kv d128 bf16", 32, 8, 128, torch.bfloat16, graph_splits=GRAPH_SPLITS),
    Shape("llama-1b 32q/8kv d64 bf16", 32, 8, 64, torch.bfloat16, graph_splits=GRAPH_SPLITS),
    Shape("mha 32q/32kv d128 fp16", 32, 32, 128, torch.float16),
    Shape("gqa16 64q/4kv d128 bf16", 64, 4, 128, torch.bfloat16),
    Shape("fp32 8q/2kv d64", 8, 2, 64, torch.float32),
)


@dataclass(frozen=True)
class CompiledLaunch:
    case: str
    kernel: str
    arch: int
    grid: tuple[int, ...]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    registers: int
    local_bytes: int
    shared_bytes: int
    programs_per_sm: int
    # Width in bytes -> how many such instructions the PTX holds: loads into registers, and
    # asynchronous copies into shared memory (what the pipeliner turns a loop's loads into).
    global_load_bytes: dict[int, int] = field(default_factory=dict)
    async_copy_bytes: dict[int, int] = field(default_factory=dict)
    mma: str = "none"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("global_load_bytes", "async_copy_bytes"):
            data[key] = {str(k): v for k, v in sorted(data[key].items())}
        data["constexprs"] = {k: _plain(v) for k, v in self.constexprs.items()}
        return data


@dataclass
class _Launch:
    kernel: Any  # triton.runtime.jit.JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@contextmanager
def _caught_launches() -> Iterator[list[_Launch]]:
    """Within the block, ``kernel[grid](...)`` records the launch instead of compiling it."""
    from triton.runtime.jit import JITFunction

    launches: list[_Launch] = []

    def record(self, *args, grid, warmup, **kwargs):  # JITFunction.run's signature
        launches.append(_Launch(self, tuple(grid), args, kwargs))

    original = JITFunction.run
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def _compile(launch: _Launch, arch: Arch, case: str) -> CompiledLaunch:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch.capability, 32)
    backend = make_backend(target)
    fn = launch.kernel
    # The JIT's own binder, so the signature and specializations are the ones a GPU run gets.
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )
    usage = _resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    shared_bytes = compiled.metadata.shared + usage["SHARED"]
    num_warps = compiled.metadata.num_warps
    return CompiledLaunch(
        case=case,
        kernel=fn.__name__,
        arch=arch.capability,
        grid=launch.grid,
        constexprs={fn.arg_names[path[0]]: value for path, value in constexprs.items()},
        num_warps=num_warps,
        num_stages=compiled.metadata.num_stages,
        registers=usage["REG"],
        # NOTE: ptxas spills into the stack frame (STACK); LOCAL counts only local arrays.
        local_bytes=usage["LOCAL"] + usage["STACK"],
        shared_bytes=shared_bytes,
        programs_per_sm=programs_per_sm(arch, usage["REG"], shared_bytes, num_warps),
        global_load_bytes=global_load_widths(ptx),
        async_copy_bytes=async_copy_widths(ptx),
        mma=mma_kind(ptx),
    )


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """ptxas's allocation for the cubin's one function: REG, SHARED, LOCAL, STACK, ..."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    function = text.split("Function", 1)[1]
    return {key: int(value) for key, value in re.findall(r"(\w+):(\d+)", function)}


def global_load_widths(ptx: str) -> dict[int, int]:
    """How many global loads of each width (bytes) the PTX holds."""
    widths: Counter[int] = Counter()
    for vector, bits in re.findall(r"\bld\.global(?:\.[a-z_0-9]+)*?(?:\.v(\d))?\.[bfsu](\d+)", ptx):
        widths[int(vector or 1) * int(bits) // 8] += 1
    return dict(widths)


def async_copy_widths(ptx: str) -> dict[int, int]:
    """How many global-to-shared asynchronous copies of each width (bytes) the PTX holds."""
    sizes = re.findall(r"\bcp\.async\.c[ag]\.shared\.global[^;]*?,\s*(0x[0-9a-f]+|\d+)\s*[,;]", ptx)
    return dict(Counter(int(size, 0) for size in sizes))


def mma_kind(ptx: str) -> str:
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "none"


def programs_per_sm(arch: Arch, registers: int, shared_bytes: int, num_warps: int) -> int:
    """Programs resident on one multiprocessor, as registers, threads and shared memory allow."""
    # NOTE: registers are handed out per warp in units of 256.
    registers_per_warp = -(-registers * 32 // 256) * 256
    by_registers = arch.registers_per_sm // max(registers_per_warp, 1) // num_warps
    by_threads = arch.max_threads_per_sm // (32 * num_warps)
    by_shared = arch.shared_bytes_per_sm // (shared_bytes + arch.reserved_shared_bytes)
    return min(by_registers, by_threads, by_shared, arch.max_programs_per_sm)


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) else str(value)


# -- the launches ---------------------------------------------------------------------------------


def _cache(shape: Shape, max_seq_len: int):
    """A tiny cache with the strides of a real one, and tables that address ``max_seq_len``."""
    num_pages = -(-max_seq_len // shape.block_size)
    dims = (4, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.zeros(dims, dtype=shape.dtype)
    block_tables = torch.zeros((2, num_pages), dtype=torch.int32)
    seq_lens = torch.full((2,), max_seq_len, dtype=torch.int32)
    return k_cache, torch.zeros_like(k_cache), block_tables, seq_lens


def _launch_cases(shape: Shape) -> list[tuple[str, Callable[[], object]]]:
    from kvswitch.kernels import paged_decode, paged_prefill, rms_norm, rotary, store_kv

    scale = shape.head_dim**-0.5
    context = 4096
    k_cache, v_cache, block_tables, seq_lens = _cache(shape, context)
    kv_rows = torch.zeros(8, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
    slots = torch.zeros(8, dtype=torch.int32)
    query = torch.zeros(2, shape.num_q_heads, shape.head_dim, dtype=shape.dtype)
    tokens = torch.zeros(2 * context, shape.num_q_heads, shape.head_dim, dtype=shape.dtype)

    def decode(num_splits: int) -> Callable[[], object]:
        return lambda: paged_decode(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            max_seq_len=context,
            num_splits=num_splits,
        )

    def prefill(q_len: int) -> Callable[[], object]:
        cu_q_lens = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
        return lambda: paged_prefill(
            tokens[: 2 * q_len],
            k_cache,
            v_cache,
            block_tables,
            cu_q_lens,
            seq_lens,
            scale,
            max_q_len=q_len,
        )

    # The rest of a decoder layer, at the hidden size of the attention shape.
    hidden = torch.zeros(8, shape.num_q_heads * shape.head_dim, dtype=shape.dtype)
    norm_weight = torch.ones(hidden.shape[1], dtype=shape.dtype)
    cos = torch.zeros(context, shape.head_dim // 2)  # fp32, as RopeConfig makes them
    positions = torch.zeros(8, dtype=torch.int64)

    graph_splits = [(f"paged_decode {n} splits", decode(n)) for n in shape.graph_splits]

    return [
        ("rms_norm", lambda: rms_norm(hidden, norm_weight, 1e-5)),
        ("rms_norm + residual", lambda: rms_norm(hidden, norm_weight, 1e-5, residual=hidden)),
        ("rotary", lambda: rotary(query.clone(), kv_rows[:2].clone(), cos, cos, positions[:2])),
        ("store_kv", lambda: store_kv(kv_rows, kv_rows, k_cache, v_cache, slots)),
        ("paged_decode", decode(1)),
        ("paged_decode split", decode(4)),
        *graph_splits,
        ("paged_prefill", prefill(context)),
        ("paged_prefill 16-token chunk", prefill(16)),
    ]


def compile_report(
    config: CompileReportConfig,
    shapes: tuple[Shape, ...] = SHAPES,
    progress: Callable[[str], None] | None = None,
) -> list[CompiledLaunch]:
    """Compile every kernel launch of every shape for ``config.arch``."""
    import triton
    from triton.runtime.jit import JITFunction

    if interpreting():
        raise CompileUnavailable(
            "kernels compile needs TRITON_INTERPRET unset: the interpreter replaces the kernels "
            "with Python when they are imported"
        )
    if not hasattr(JITFunction, "_pack_args"):
        raise CompileUnavailable(
            f"kernels compile drives Triton's JIT internals as of Triton 3.6 to 3.9; this is "
            f"Triton {triton.__version__}"
        )
    arch = ARCHS[config.arch]
    compiled = []
    for shape in shapes:
        for name, launch in _launch_cases(shape):
            case = f"{name} [{shape.label}]"
            if progress is not None:
                progress(f"compiling {case} for sm_{arch.capability} ({arch.name})")
            with _caught_launches() as launches:
                launch()
            compiled.extend(_compile(caught, arch, case) for caught in launches)
    return compiled


def format_report(compiled: list[CompiledLaunch]) -> str:
    """One line per compiled launch, for a terminal."""
    header = (
        f"{'case':<54} {'kernel':<22} {'warps':>5} {'stages':>6} {'regs':>4} {'spill':>5} "
        f"{'smem':>6} {'per SM':>6} {'loads B':>9} {'async B':>9}  mma"
    )
    lines = [header]
    for c in compiled:
        lines.append(
            f"{c.case:<54} {c.kernel.strip('_'):<22} {c.num_warps:>5} {c.num_stages:>6} "
            f"{c.registers:>4} {c.local_bytes:>5} {c.shared_bytes:>6} {c.programs_per_sm:>6} "
            f"{_widths(c.global_load_bytes):>9} {_widths(c.async_copy_bytes):>9}  {c.mma}"
        )
    return "\n".join(lines)


def _widths(counts: dict[int, int]) -> str:
    return "/".join(str(width) for width in sorted(counts)) or "-"
