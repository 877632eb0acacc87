"""Repeatable options of the form ``NAME=VALUE`` (``--engine e0=http://...``, ``--lora
sql=/adapters/sql``), read into a dict with every malformed or repeated name refused."""

from __future__ import annotations

from collections.abc import Sequence


def named_values(values: Sequence[str], option: str, form: str) -> dict[str, str]:
    """``values`` as ``{NAME: VALUE}``; ValueError naming ``option`` and the ``form`` it takes
    for one that is not ``NAME=VALUE``, or a name given twice."""
    named: dict[str, str] = {}
    for value in values:
        name, sep, target = value.partition("=")
        if not sep or not name or not target:
            raise ValueError(f"{option} takes {form}, not {value!r}")
        if name in named:
            raise ValueError(f"{option} names {name} twice")
        named[name] = target
    return named
