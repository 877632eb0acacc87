"""A step's input arrays on their way to the device: one pinned host buffer, one copy.

Every array a step needs (token ids, positions, the slot mapping, block tables, ...) is small;
copied one by one, each is a transfer of its own, and from pageable memory a synchronous one.
``UploadBuffer`` is a pair of byte buffers, one in pinned host memory and one on the device,
allocated once and reused every step; arrays are written into the host side and its used prefix
reaches the device in one non-blocking copy::

    host (pinned)  | input_ids | positions | slots | ... |  -- one copy -->  device | same bytes |
                   ^ each array starts on a 16-byte boundary

The host side is written only once the device has finished the previous copy out of it (a CUDA
event); the device side needs no such wait: copies and kernels run in order on the stream, so a
new copy lands only after every kernel queued before it has read the old bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN_BYTES = 16

NUMPY_TO_TORCH = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
}


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


class UploadBuffer:
    """Host bytes (pinned on CUDA) mirrored by device bytes; ``upload`` copies a prefix across."""

    def __init__(self, device: torch.device, num_bytes: int) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.num_bytes = aligned(max(num_bytes, ALIGN_BYTES))
        self.host = torch.empty(self.num_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.host_array = self.host.numpy()
        self.device_bytes = torch.empty(self.num_bytes, dtype=torch.uint8, device=device)
        # Recorded after each upload; one event for the buffer's life, not one per upload.
        self._copied = torch.cuda.Event() if self.pinned else None
        self._in_flight = False

    def wait_writable(self) -> None:
        """Block until the last upload has left the host buffer (at once if it has)."""
        if self._in_flight:
            self._copied.synchronize()
            self._in_flight = False

    def host_view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The host bytes at ``offset`` as an array; call ``wait_writable`` before writing."""
        dtype = np.dtype(dtype)
        num_bytes = int(np.prod(shape)) * dtype.itemsize
        return self.host_array[offset : offset + num_bytes].view(dtype).reshape(shape)

    def device_view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The device bytes at ``offset`` as a tensor (valid after an upload that covers them)."""
        dtype = np.dtype(dtype)
        num_bytes = int(np.prod(shape)) * dtype.itemsize
        window = self.device_bytes[offset : offset + num_bytes]
        return window.view(NUMPY_TO_TORCH[dtype]).view(shape)

    def upload(self, num_bytes: int) -> None:
        """Copy the first ``num_bytes`` of the host buffer to the device, without waiting."""
        self.device_bytes[:num_bytes].copy_(self.host[:num_bytes], non_blocking=self.pinned)
        if self.pinned:
            self._copied.record(torch.cuda.current_stream(self.device))
            self._in_flight = True


class InputStager:
    """Moves any set of arrays to the device in one copy; the buffers grow (doubling) as steps
    need more. Off CUDA there is nothing to copy and ``stage`` wraps the arrays as they are,
    unless ``pack`` asks for the CUDA path's packing anyway (for tests)."""

    def __init__(self, device: torch.device, *, pack: bool | None = None) -> None:
        self.device = device
        self.pack = device.type == "cuda" if pack is None else pack
        self._buffer: UploadBuffer | None = None

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Each array as a tensor on the device, with its dtype and shape. A tensor stays valid
        until the next ``stage``: the engine's next step, by which time the device has read it."""
        if not self.pack:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, end = [], 0
        for array in arrays:
            offsets.append(end)
            end += aligned(array.nbytes)
        buffer = self._buffer
        if buffer is None or end > buffer.num_bytes:
            buffer = self._buffer = UploadBuffer(
                self.device, max(end, 2 * buffer.num_bytes if buffer else 1 << 16)
            )
        buffer.wait_writable()
        for array, offset in zip(arrays, offsets, strict=True):
            buffer.host_view(offset, array.dtype, array.shape)[...] = array
        buffer.upload(end)
        return [
            buffer.device_view(offset, array.dtype, array.shape)
            for array, offset in zip(arrays, offsets, strict=True)
        ]
