"""Triton paged-attention kernels, each beside its launcher, and their torch references.

``store_kv`` writes new K/V rows into pages, ``paged_decode`` attends one query token per
sequence over its pages, ``paged_prefill`` attends a varlen batch of new tokens over their cached
prefix and causally over themselves. ``kernels.reference`` holds the pure-torch versions, which are
also the CPU execution path. Set ``TRITON_INTERPRET=1`` before importing this package to run the
kernels on CPU through Triton's interpreter (tiny shapes only).
"""

from kvswitch.kernels.paged_decode import paged_decode
from kvswitch.kernels.paged_prefill import paged_prefill
from kvswitch.kernels.reference import paged_decode_ref, paged_prefill_ref, store_kv_ref
from kvswitch.kernels.store_kv import store_kv

__all__ = [
    "paged_decode",
    "paged_decode_ref",
    "paged_prefill",
    "paged_prefill_ref",
    "store_kv",
    "store_kv_ref",
]
