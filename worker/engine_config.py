"""How an engine is built: its model, device, KV cache size and batch limits. Torch-free, so the
serving process can check a configuration without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass

from kvswitch.cache_index.hashing import XXH3_NAMING, BlockNaming
from kvswitch.options import named_values


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a Hugging Face checkpoint directory; None = built-in tiny model
    served_model_name: str = ""  # the block-hash namespace; empty = derived from the model
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20
    # On CUDA, a fraction in (0, 1) sizes the KV cache from the GPU memory free after loading
    # the model instead of kv_cache_bytes.
    gpu_memory_fraction: float = 0.0
    enable_prefix_caching: bool = True
    # CPU: keep the KV cache in a file of this host's shared memory, where same-host peers copy
    # blocks straight out of it (one copy, the fastest block transfer between two workers).
    kv_cache_shm: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # CUDA: replay steps from CUDA graphs captured when the engine starts (worker/cuda_graphs.py):
    # decode steps whole, one graph per batch size up to max_num_seqs, and steps of up to 512
    # tokens all but attention. None: on for a CUDA device, off elsewhere.
    cuda_graphs: bool | None = None
    # CPU: threads torch computes a step with; 0 = torch's default (one per core). Several CPU
    # workers on one host must share the cores: each taking them all, their thread pools spin
    # against each other and every step slows many times over.
    cpu_threads: int = 0
    # Check the KV cache's invariants (block_pool.check_integrity) each time the engine falls
    # idle; a broken one stops the engine core, loudly. For tests and fault drills: it walks
    # every block.
    check_integrity: bool = False
    # How the engine names its blocks (with the key, for blake2b-keyed); the routers' must match.
    block_naming: BlockNaming = XXH3_NAMING
    # Stored cache events carry their blocks' tokens (what vLLM-format events need).
    record_block_tokens: bool = False
    # LoRA adapters served beside the base model, each "NAME=PATH" (a PEFT adapter's folder); a
    # request names one by its NAME (worker/lora.py). max_loras: adapters one step may use (the
    # device slots); max_lora_rank: the largest rank taken; max_cpu_loras: adapters kept read in
    # host memory (0: every adapter served). enable_lora: the slots are made without a lora
    # too, for adapters loaded at run time (LLMEngine.load_lora).
    lora: tuple[str, ...] = ()
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int = 0
    # Keep every full block's final hidden states in host memory beside its KV
    # (worker/hidden_cache.py), so that prompt logprobs and embeddings of a cached prefix are
    # not recomputed. hidden_cache_bytes caps it (0: a row for every KV block). Every step then
    # runs without CUDA graphs (they give no hidden states).
    cache_hidden_states: bool = False
    hidden_cache_bytes: int = 0
    # GiB of host memory for a second tier of KV blocks under the device's (worker/offload.py):
    # blocks the device evicts are kept there and loaded back instead of computed; 0: none.
    offload_gb: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 <= self.gpu_memory_fraction < 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in [0, 1), got {self.gpu_memory_fraction}"
            )
        if self.cpu_threads < 0:
            raise ValueError(
                f"cpu_threads must be >= 0 (0: torch's default), got {self.cpu_threads}"
            )
        if self.kv_cache_shm and self.device != "cpu":
            raise ValueError(
                "kv_cache_shm puts a CPU worker's KV cache in shared memory: use it with device cpu"
            )
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError("cuda_graphs captures steps on a GPU: use it with a cuda device")
        if not 0 <= self.offload_gb < float("inf"):
            raise ValueError(
                f"offload_gb must be a size in GiB >= 0 (0: none), got {self.offload_gb}"
            )
        if self.offload_gb and not self.enable_prefix_caching:
            raise ValueError("offload_gb keeps cached blocks: it needs prefix caching on")
        if self.hidden_cache_bytes < 0:
            raise ValueError(
                f"hidden_cache_bytes must be >= 0 (0: no cap), got {self.hidden_cache_bytes}"
            )
        if self.cache_hidden_states and self.cuda_graphs:
            raise ValueError(
                "cache_hidden_states needs every step's hidden states, which CUDA graphs do not "
                "give: turn cuda_graphs off to cache them"
            )
        if self.cuda_graphs is None:
            on_gpu = self.device.startswith("cuda")
            object.__setattr__(self, "cuda_graphs", on_gpu and not self.cache_hidden_states)
        lora_paths(self.lora)  # refuses a malformed or repeated name
        if self.max_loras <= 0 or self.max_lora_rank <= 0 or self.max_cpu_loras < 0:
            raise ValueError(
                f"max_loras and max_lora_rank must be positive and max_cpu_loras >= 0, got "
                f"{self.max_loras}, {self.max_lora_rank}, {self.max_cpu_loras}"
            )
        if self.gpu_memory_fraction and not self.device.startswith("cuda"):
            raise ValueError(
                "gpu_memory_fraction sizes a GPU's KV cache: use it with a cuda device"
            )


def lora_paths(specs: tuple[str, ...]) -> dict[str, str]:
    """``lora``'s ``NAME=PATH`` specs as ``{NAME: PATH}``; ValueError for a malformed one or a
    name given twice."""
    return named_values(specs, "lora", "NAME=PATH (a PEFT adapter's folder)")


def check_lora_name(lora: str | None, served: list[str] | tuple[str, ...]) -> None:
    """ValueError, naming the adapters served, unless ``lora`` is None or one of ``served``."""
    if lora is None or lora in served:
        return
    raise ValueError(
        f"lora: unknown adapter {lora!r}; this worker serves "
        + (f"these: {', '.join(sorted(served))}" if served else "none")
    )
