"""Triton kernels of the model's forward, each beside its launcher, and their torch references.

Paged attention: ``store_kv`` writes new K/V rows into pages, ``paged_decode`` attends one query
token per sequence over its pages, ``paged_prefill`` attends a varlen batch of new tokens over
their cached prefix and causally over themselves. The rest of a decoder layer: ``rms_norm``
normalizes each token's row (optionally adding the residual stream first, in the same launch),
``rotary`` rotates queries and keys by their positions in place. ``kernels.reference`` holds the
pure-torch versions, which are also the CPU execution path. Set ``TRITON_INTERPRET=1`` before
importing this package to run the kernels on CPU through Triton's interpreter (tiny shapes only).
"""

import importlib
import sys
import types

from kvswitch.kernels.reference import (
    paged_decode_ref,
    paged_prefill_ref,
    rms_norm_ref,
    rotary_ref,
    store_kv_ref,
)

# NOTE: imported on first use, each from the module of its name: they import Triton (0.4 s),
# which a CPU worker never runs.
_LAUNCHERS = ("paged_decode", "paged_prefill", "rms_norm", "rotary", "store_kv")


class _Kernels(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        # Importing a launcher's module binds the module here: bind the launcher instead.
        if name in _LAUNCHERS and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


def __getattr__(name: str) -> object:
    if name in _LAUNCHERS:
        return getattr(importlib.import_module(f"{__name__}.{name}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


sys.modules[__name__].__class__ = _Kernels

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
