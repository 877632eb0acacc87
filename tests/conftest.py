"""Test-wide setup: Triton kernels run through the CPU interpreter where there is no GPU."""

from __future__ import annotations

import os

import torch

# NOTE: Triton reads this when a kernel module is imported, so it must be set before any test
# module imports ``kernels``.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
