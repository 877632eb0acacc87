"""What every ``kvswitch`` command shares: argparse options built from a frozen config dataclass (so
defaults live in one place), tokens from the environment, JSON output, logging."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from kvswitch.logs import configure_logging, log_format_from_env, log_level_from_env

T = TypeVar("T")

_PARSERS = {"int": int, "float": float, "str": str}
STDOUT = Path("-")  # --json -


def add_config_args(
    parser: argparse.ArgumentParser, config_cls: type, helps: dict[str, str]
) -> None:
    """One ``--field-name`` option per field of ``config_cls``, default taken from the field.

    A ``bool`` field becomes a pair, ``--field-name`` / ``--no-field-name``; a ``bool | None``
    one too, left None when neither is given (its help says what None does). A
    ``tuple[str, ...]`` field takes its option as many times as it is given. Every field needs a
    help text in ``helps``: an option nobody explained is no help to a newcomer.
    """
    for field in dataclasses.fields(config_cls):
        type_name = field.type if isinstance(field.type, str) else field.type.__name__
        option = "--" + field.name.replace("_", "-")
        help_text = f"{helps[field.name]} (default: %(default)s)"
        if type_name == "bool | None":
            help_text = helps[field.name]
        if type_name in ("bool", "bool | None"):
            parser.add_argument(
                option,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=help_text,
            )
        elif type_name == "tuple[str, ...]":
            # NOTE: default None, not the field's (), which argparse's append cannot extend.
            parser.add_argument(option, action="append", default=None, help=helps[field.name])
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
    for field in dataclasses.fields(config_cls):
        if field.type in ("tuple[str, ...]", tuple[str, ...]):
            values[field.name] = tuple(values[field.name] or ())
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


def plain_doc(doc: str | None) -> str:
    """A module's docstring as a command's description: ``code`` marks read as noise there."""
    return (doc or "").replace("``", "")


def write_json(result: dict[str, Any], path: Path | None, *, echo: bool = True) -> None:
    """``result`` as JSON on stdout (unless not ``echo``) and in the file ``path``, if given
    (``STDOUT``: on stdout alone)."""
    text = json.dumps(result, indent=2, sort_keys=True)
    if echo or path == STDOUT:
        print(text)
    if path is not None and path != STDOUT:
        path.write_text(text + "\n")
        print(f"wrote {path}", file=sys.stderr)


def tokens_from_env(args: argparse.Namespace) -> argparse.Namespace:
    """Tokens not given as options, from the environment (a command line shows in ps)."""
    from kvswitch.security import API_KEYS_ENV, ENGINE_API_KEY_ENV, FLEET_TOKEN_ENV, TOKEN_ENV

    for name, env in (
        ("token", TOKEN_ENV),
        ("fleet_token", FLEET_TOKEN_ENV),
        ("engine_api_key", ENGINE_API_KEY_ENV),
    ):
        if hasattr(args, name) and not getattr(args, name):
            setattr(args, name, os.environ.get(env, ""))
    # NOTE: API keys only for a router that serves HTTP: a router without --http-port refuses
    # --api-key, and an environment set for the whole fleet must not make it fail.
    if hasattr(args, "api_key") and not args.api_key and args.http_port >= 0:
        args.api_key = os.environ.get(API_KEYS_ENV, "")
    return args


def exit_with(code: int) -> None:
    if code:
        sys.exit(code)


def configure_process_logging(process_fields: dict[str, str] | None = None) -> None:
    try:
        log_format, log_level = log_format_from_env(), log_level_from_env()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    configure_logging(log_level, json=log_format == "json", process_fields=process_fields or {})


def add_report_command(
    commands: argparse._SubParsersAction,
    name: str,
    summary: str,
    description: str,
    config_cls: type,
    helps: dict[str, str],
    run: Callable[[Any], dict[str, Any]],
    table: Callable[[dict[str, Any]], str] | None = None,
) -> None:
    """A command that builds ``config_cls`` from its options, runs it and prints the JSON it
    returns; a file it cannot read or a value it refuses (ValueError) is a one-line message.
    With ``table``, it prints the table ``table`` makes of the result instead, and the JSON only
    with ``--json``: into that file, or ``--json -`` on stdout instead of the table."""

    def command(args: argparse.Namespace) -> None:
        config = config_from_args(config_cls, args)
        try:
            result = run(config)
        except (OSError, ValueError) as e:
            fields = [field.name for field in dataclasses.fields(config_cls)]
            sys.exit(f"kvswitch {name}: {with_flags(str(e), fields)}")
        if table is None:
            write_json(result, args.json)
        elif args.json == STDOUT:
            write_json(result, None)
        else:
            print(table(result))
            write_json(result, args.json, echo=False)

    sub = commands.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, config_cls, helps)
    json_help = (
        "also write the figures here"
        if table is None
        else "write the figures as JSON here; - = on stdout, instead of the table"
    )
    sub.add_argument("--json", type=Path, metavar="OUT", help=json_help)
    sub.set_defaults(func=command)
