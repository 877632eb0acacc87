"""Triton kernels of the model's forward, each beside its launcher, and their torch references.

Paged attention: ``store_kv`` writes new K/V rows into pages, ``paged_decode`` attends one query
token per sequence over its pages, ``paged_prefill`` attends a varlen batch of new tokens over
their cached prefix and causally over themselves. The rest of a decoder layer: ``rms_norm``
normalizes each token's row (optionally adding the residual stream first, in the same launch),
``rotary`` rotates queries and keys by their positions in place. ``kernels.reference`` holds the
pure-torch versions, which are also the CPU execution path. Set ``TRITON_INTERPRET=1`` before
importing this package to run the kernels on CPU through Triton's interpreter (tiny shapes only).
"""

from kvswitch.kernels.paged_decode import paged_decode
from kvswitch.kernels.paged_prefill import paged_prefill
from kvswitch.kernels.reference import (
    paged_decode_ref,
    paged_prefill_ref,
    rms_norm_ref,
    rotary_ref,
    store_kv_ref,
)
from kvswitch.kernels.rms_norm import rms_norm
from kvswitch.kernels.rotary import rotary
from kvswitch.kernels.store_kv import store_kv

__all__ = [
    "paged_decode",
    "paged_decode_ref",
    "paged_prefill",
    "paged_prefill_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary",
    "rotary_ref",
    "store_kv",
    "store_kv_ref",
]
