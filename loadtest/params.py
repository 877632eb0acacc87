"""Parameters written as "key=value,key=value" over a frozen dataclass: how a command line names a
workload (``--workload-args``) or a generated trace (``--trace generated:...``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, TypeVar

T = TypeVar("T")


def with_params(base: T, text: str, what: str, exclude: Collection[str] = ()) -> T:
    """``base`` with the values ``text`` gives its fields, each read as the type of ``base``'s
    value. ValueError, its message starting with ``what``, names a key that is no field (or is
    in ``exclude``), listing the known ones with ``base``'s values, or a value of the wrong
    kind, or a value the dataclass's own checks refuse."""
    current = {
        f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name not in exclude
    }
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in current:
            known = ", ".join(f"{k}={v!r}" for k, v in current.items())
            raise ValueError(f"{what}: bad parameter {item!r}; known (defaults): {known}")
        convert: Callable[[str], Any] = type(current[key])
        try:
            values[key] = convert(value.strip())
        except ValueError:
            raise ValueError(
                f"{what}: {key} must be a {convert.__name__}, got {value.strip()!r}"
            ) from None
    try:
        return dataclasses.replace(base, **values)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
