"""Build argparse options from a frozen config dataclass, so defaults live in one place."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")

_PARSERS = {"int": int, "float": float, "str": str}


def add_config_args(
    parser: argparse.ArgumentParser, config_cls: type, helps: dict[str, str]
) -> None:
    """One ``--field-name`` option per field of ``config_cls``, default taken from the field.

    A ``bool`` field becomes a pair, ``--field-name`` / ``--no-field-name``. Every field needs a
    help text in ``helps``: an option nobody explained is no help to a newcomer.
    """
    for field in dataclasses.fields(config_cls):
        type_name = field.type if isinstance(field.type, str) else field.type.__name__
        option = "--" + field.name.replace("_", "-")
        help_text = f"{helps[field.name]} (default: %(default)s)"
        if type_name == "bool":
            parser.add_argument(
                option,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=help_text,
            )
        elif type_name in _PARSERS:
            parser.add_argument(
                option, type=_PARSERS[type_name], default=field.default, help=help_text
            )
        else:
            raise TypeError(f"{config_cls.__name__}.{field.name}: unsupported type {type_name}")


class ConfigError(ValueError):
    """The options given on the command line make an invalid config."""


def config_from_args(config_cls: type[T], args: argparse.Namespace) -> T:
    """The config built from the options that ``add_config_args`` added."""
    values: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)}
    try:
        return config_cls(**values)
    except ValueError as e:
        raise ConfigError(with_flags(str(e), values)) from None


def with_flags(message: str, field_names: Iterable[str]) -> str:
    """A config's error, its field names spelled as the options that set them: "block_size must
    be positive" becomes "--block-size must be positive". A name with an underscore is replaced
    wherever it stands; a one-word name ("workers", "policy", which prose uses too) only where
    the message starts with it."""
    for name in sorted(field_names, key=len, reverse=True):
        option = "--" + name.replace("_", "-")
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){name}(?!\w)", option, message)
        elif re.match(rf"{name}\b(?!-)", message):
            message = option + message[len(name) :]
    return message
