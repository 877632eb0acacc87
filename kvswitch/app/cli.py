"""The ``kvswitch`` command line: the command list and ``main``; each group of commands is built
in a module of its own (``cli_servers``, ``cli_tools``, ``cli_bench``)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

from kvswitch import __version__
from kvswitch.app.cli_args import ConfigError
from kvswitch.app.cli_bench import add_bench, add_kernels
from kvswitch.app.cli_servers import add_demo, add_router, add_up, add_worker
from kvswitch.app.cli_tools import add_generate, add_health, add_index, add_loadtest, add_sim
from kvswitch.benchmarks.timing import BenchmarkUnavailable

DESCRIPTION = """\
kvswitch routes LLM requests to the GPU worker that already holds the KV cache of their prompt.

A prompt is cut into blocks of tokens; each block is named by a hash chained over everything
before it, so two prompts with the same prefix share block names. Workers cache computed blocks
and report them to a global block-hash index; the router sends each request where the longest
prefix of its prompt is already cached, weighing load.
"""

EPILOG = """\
examples:
  kvswitch demo                       cache-aware routing on a local two-worker cluster
  kvswitch up --workers 2 --port 50051
                                      a local cluster: a router and two CPU workers
  kvswitch generate --target 127.0.0.1:50051 --prompt 'Hello'
                                      one request through the router, streamed
  kvswitch router --port 50051        the router, with the embedded index
  kvswitch worker --port 50061        serve the built-in model on CPU over gRPC
  kvswitch worker --model DIR --device cuda --port 50062
                                      serve a Hugging Face checkpoint on a GPU
  kvswitch bench pool --json out.json block operations per second of the block pool
  kvswitch bench hash                 block-hashing throughput
  kvswitch index audit --index redis://127.0.0.1:6380
                                      the index against the workers' own caches
  kvswitch bench kernels              paged-attention kernels (needs a CUDA GPU)
  kvswitch kernels compile --arch 90  compile the kernels for H100 here: registers, spills, ...
  kvswitch loadtest --target 127.0.0.1:50051 --policies cost,round_robin
                                      the same prompts under two routing policies: TTFT, hit rate
  kvswitch sim --trace trace.jsonl --workers 16 --capacity-blocks 4096 --target-utilization 0.8
                                      replay a trace through every policy on a simulated fleet
  kvswitch bench routing              every policy on simulated fleets of 4, 8, 16 workers, goals

run 'kvswitch COMMAND --help' for the options of a command.
"""


def build_parser(command: str | None = None, *, summaries: bool = False) -> argparse.ArgumentParser:
    """The whole CLI; or, given a ``command`` it knows, that command alone; or, with
    ``summaries``, each command's name and summary only (``kvswitch --help``). Building a
    command imports what it runs, so a router or worker started by name does not load (say) the
    kernels' torch for commands it will never run, and ``kvswitch --help`` loads none of them."""
    if command not in {name for name, *_ in COMMANDS}:
        command = None
    parser = argparse.ArgumentParser(
        prog="kvswitch",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvswitch {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, help="what to run"
    )
    for name, extra, summary, add in COMMANDS:
        if command is not None and name != command:
            continue
        if summaries:
            # NOTE: never run: a command named on the command line is built in full instead.
            missing = _missing_module(extra)
            if missing is None:
                commands.add_parser(name, help=summary, add_help=False)
            else:
                _add_unavailable(commands, name, summary, str(extra), missing)
            continue
        try:
            add(commands, name, summary)
        except ModuleNotFoundError as e:
            if extra is None or not e.name or e.name.partition(".")[0] == "kvswitch":
                raise
            _add_unavailable(commands, name, summary, extra, e.name)
    return parser


# Modules each extra brings, looked for (not imported) to mark the command list.
EXTRA_MODULES = {
    "router": ("grpc_health", "redis", "numpy"),
    "worker": ("grpc_health", "torch", "zmq"),
    "loadtest": ("numpy", "tqdm"),
    "all": ("grpc_health", "torch", "zmq", "tqdm"),
}


def _missing_module(extra: str | None) -> str | None:
    """A module of ``extra`` that this installation lacks, or None."""
    for module in EXTRA_MODULES.get(extra or "", ()):
        try:
            found = importlib.util.find_spec(module) is not None
        except ValueError:  # in sys.modules without a spec
            found = True
        if not found:
            return module
    return None


class _Unavailable:
    """A command whose extra is not installed: it says what to install, whatever its arguments."""

    def __init__(self, name: str, extra: str, missing: str) -> None:
        self.message = (
            f"kvswitch {name} needs kvswitch[{extra}], and this installation lacks the "
            f"{missing!r} module: pip install 'kvswitch[{extra}]'"
        )

    def __call__(self, args: argparse.Namespace) -> None:
        sys.exit(self.message)


def _add_unavailable(
    commands: argparse._SubParsersAction, name: str, summary: str, extra: str, missing: str
) -> None:
    sub = commands.add_parser(name, help=f"{summary} [needs kvswitch[{extra}]]", add_help=False)
    sub.set_defaults(func=_Unavailable(name, extra, missing))


# (name, the extra it needs, summary, adder), in the order `kvswitch --help` lists them. A
# command whose extra is not installed is listed still, and says what to install when run; one
# that needs no extra (None) runs on the client's dependencies alone.
COMMANDS: list[
    tuple[str, str | None, str, Callable[[argparse._SubParsersAction, str, str], None]]
] = [
    (
        "demo",
        "all",
        "cache-aware routing on a local cluster of two CPU workers, cost vs round_robin",
        add_demo,
    ),
    (
        "router",
        "router",
        "run the router: sends each request where its prompt's KV cache is",
        add_router,
    ),
    ("up", "all", "run a local cluster in the foreground: N workers and a router", add_up),
    ("generate", None, "send one prompt to a router and stream the output", add_generate),
    ("worker", "worker", "run a GPU (or CPU) worker: the model behind a gRPC server", add_worker),
    (
        "health",
        "router",
        "ask a router or worker whether it serves (gRPC health check): exit 0 if it does",
        add_health,
    ),
    (
        "index",
        "router",
        "inspect a block-hash index: its size, and whether it agrees with the workers",
        add_index,
    ),
    ("kernels", "worker", "the Triton kernels: compile them for a GPU without one", add_kernels),
    ("bench", "all", "measure a component; prints JSON and can write it to a file", add_bench),
    (
        "loadtest",
        "loadtest",
        "load-test a live router: a workload under several routing policies, vllm-style figures",
        add_loadtest,
    ),
    (
        "sim",
        "router",
        "replay a request trace through the routing policies on a simulated fleet",
        add_sim,
    ),
]


# What ``kvswitch`` takes before a command: anything else there is a mistake.
TOP_LEVEL_OPTIONS = ("-h", "--help", "--version")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    names = [name for name, *_ in COMMANDS]
    parser = build_parser(command, summaries=command not in names)
    if command is None or (command.startswith("-") and command not in TOP_LEVEL_OPTIONS):
        said = "no command" if command is None else f"unrecognized option {command}"
        parser.error(
            f"{said}: give a command first, one of {', '.join(names)}; 'kvswitch --help' says "
            "what each does, 'kvswitch COMMAND --help' lists its options"
        )
    args, unknown = parser.parse_known_args(argv)
    # NOTE: a command's own mistakes are told with its own usage line, not kvswitch's.
    parser = _command_parser(parser, args)
    if unknown and not isinstance(args.func, _Unavailable):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        args.func(args)
    except ModuleNotFoundError as e:
        # A dependency imported only once the command runs (torch, inside the worker's engine).
        extra = next((extra for name, extra, *_ in COMMANDS if name == args.command), None)
        if extra is None or not e.name or e.name.partition(".")[0] == "kvswitch":
            raise
        _Unavailable(args.command, extra, e.name)(args)
    except KeyboardInterrupt:
        # Ctrl-C: what was running (a stream, a benchmark) is given up, without a traceback;
        # a stream's call is cancelled as its channel closes, so the worker stops it too.
        print(f"\nkvswitch {args.command}: interrupted", file=sys.stderr)
        return 130
    except ConfigError as e:
        parser.error(str(e))
    except BenchmarkUnavailable as e:
        print(f"kvswitch: {e}", file=sys.stderr)
        return 1
    return 0


def _command_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` name: ``kvswitch index stats``'s, say."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            return parser if chosen is None else _command_parser(chosen, args)
    return parser


if __name__ == "__main__":
    sys.exit(main())
