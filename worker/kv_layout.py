"""How a KV block is laid out as bytes when it moves between workers (``kv_transfer``).

No torch here: the serving process, which never loads torch, sends and checks layouts too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SHM_DIR = "/dev/shm"  # where workers on one host hand each other blocks (kv_transfer.shared_file)
SHM_PREFIX = "kvswitch-blocks-"  # the names of those files: a worker writes into no others
# A CPU worker's KV cache itself, when it lives in shared memory (``--kv-cache-shm``), is
# "kvswitch-cache-<pid of its engine core>-<random>": a peer on the host copies blocks straight
# out of it.
CACHE_PREFIX = "kvswitch-cache-"

_ELEMENT_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a torch dtype's name: "float32", "bfloat16", ...

    @property
    def bytes_per_block(self) -> int:
        element_size = _ELEMENT_SIZES[self.dtype]
        per_tensor = self.block_size * self.num_kv_heads * self.head_dim * element_size
        return 2 * self.num_layers * per_tensor

    def check_same(self, other: KVLayout) -> None:
        """ValueError, naming the difference, unless ``other`` is this layout."""
        if other != self:
            diff = {
                name: (value, getattr(self, name))
                for name, value in asdict(other).items()
                if value != getattr(self, name)
            }
            raise ValueError(f"KV blocks of another layout (theirs, ours): {diff}")
