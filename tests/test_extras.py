"""What each install needs, held to pyproject.toml: the client SDK and ``kvswitch generate`` run
on grpcio and protobuf alone, the router without torch or triton, and a command whose extra is
missing says what to install.

Each runs in a child Python in which the modules of the other extras cannot be imported, as on
a machine where they were never installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvswitch.deploy.processes import Child

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# The module a distribution installs; a dependency missing here fails the first test.
IMPORT_NAMES = {
    "grpcio": "grpc",
    "protobuf": "google.protobuf",
    "grpcio-health-checking": "grpc_health",
    "uvloop": "uvloop",
    "numpy": "numpy",
    "xxhash": "xxhash",
    "redis": "redis",
    "hiredis": "hiredis",
    "prometheus-client": "prometheus_client",
    "tokenizers": "tokenizers",
    "sentencepiece": "sentencepiece",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httptools": "httptools",
    "jinja2": "jinja2",
    "httpx2": "httpx2",
    "safetensors": "safetensors",
    "torch": "torch",
    "triton": "triton",
    "pyzmq": "zmq",
    "msgpack": "msgpack",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
}


def _distributions(requirements: list[str]) -> set[str]:
    """Distribution names, extras of kvswitch itself followed, other extras as distributions."""
    names = set()
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", requirement)
        assert match, requirement
        name, extras = match.group(1).lower(), (match.group(2) or "").split(",")
        if name == "kvswitch":
            for extra in filter(None, extras):
                names |= _distributions(PROJECT["optional-dependencies"][extra.strip()])
        else:
            names.add(name)
            names |= {extra.strip().lower() for extra in extras if extra.strip()}
    return names


def _installed_with(*extras: str) -> set[str]:
    names = _distributions(PROJECT["dependencies"])
    for extra in extras:
        names |= _distributions(PROJECT["optional-dependencies"][extra])
    return names


def _python_without(*extras: str) -> list[str]:
    """A Python command line in which only the base and ``extras`` can be imported: run code
    with ``-c`` after it."""
    missing = sorted(_installed_with("all") - _installed_with(*extras))
    blocked = [IMPORT_NAMES[name] for name in missing]
    prelude = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
    return [sys.executable, "-c", prelude + "{code}"]


def _run(extras: tuple[str, ...], code: str, *args: str) -> subprocess.CompletedProcess:
    argv = [part.replace("{code}", code) for part in _python_without(*extras)]
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )


CLI = "from kvswitch.app.cli import main\nsys.exit(main())"


def test_the_base_install_is_grpc_and_protobuf_and_every_dependency_is_known():
    assert _distributions(PROJECT["dependencies"]) == {"grpcio", "protobuf"}
    assert _installed_with("all") <= set(IMPORT_NAMES)
    assert {"torch", "triton"} - _installed_with("router") == {"torch", "triton"}
    assert {"torch", "triton", "safetensors"} <= _installed_with("worker")


def test_the_blocking_works():
    result = _run((), "import torch")
    assert result.returncode == 1
    assert "ModuleNotFoundError" in result.stderr


@pytest.fixture(scope="module")
def light_router(tmp_path_factory) -> Iterator[str]:
    """A router in a Python without torch, triton or safetensors, and one ordinary worker."""
    logs = tmp_path_factory.mktemp("logs")
    argv = [part.replace("{code}", CLI) for part in _python_without("router")]
    router = Child(
        "router",
        [*argv, "router", "--port", "0", "--refresh-s", "0.1"],
        env=None,
        log_path=logs / "router.log",
    )
    router.launch()
    worker = None
    try:
        address = router.wait_ready(60)
        index = f"grpc://{address}"
        worker = Child(
            "worker",
            [sys.executable, "-m", "kvswitch", "worker", "--port", "0", "--index", index],
            env=None,
            log_path=logs / "worker.log",
        )
        worker.launch()
        worker.wait_ready(120)
        yield address
    finally:
        for child in (worker, router):
            if child is not None:
                child.terminate()
                child.wait(10)


def test_the_client_runs_on_grpc_and_protobuf_alone_through_a_router_without_torch(light_router):
    code = (
        "from kvswitch.client import Client\n"
        f"result = Client({light_router!r}, timeout_s=60).generate(prompt='hello', max_tokens=4)\n"
        "print(len(result.token_ids), result.finish_reason)\n"
    )
    result = _run((), code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "4"


def test_kvswitch_generate_runs_on_grpc_and_protobuf_alone(light_router):
    result = _run((), CLI, "generate", "--target", light_router, "--prompt", "hi")
    assert result.returncode == 0, result.stderr
    help_text = _run((), CLI, "generate", "--help")
    assert help_text.returncode == 0 and "--target" in help_text.stdout


@pytest.mark.parametrize(
    ("installed", "command", "extra"),
    [
        ((), ["router", "--port", "0"], "router"),
        ((), ["up", "--workers", "2"], "all"),
        ((), ["index", "stats", "--index", "redis://127.0.0.1:1"], "router"),
        (("router",), ["worker", "--port", "0"], "worker"),
        (("router",), ["bench", "ttft"], "all"),
        (("router",), ["kernels", "compile", "--arch", "90"], "worker"),
        (("router",), ["loadtest", "--target", "127.0.0.1:1"], "loadtest"),
    ],
)
def test_a_command_without_its_extra_says_what_to_install(installed, command, extra):
    result = _run(installed, CLI, *command)
    assert result.returncode == 1
    assert f"kvswitch {command[0]} needs kvswitch[{extra}]" in result.stderr
    assert f"pip install 'kvswitch[{extra}]'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("installed", "unavailable", "available"),
    [
        ((), {"router": "router", "up": "all", "demo": "all"}, ["generate"]),
        (("router",), {"kernels": "worker", "demo": "all"}, ["router", "generate", "index"]),
    ],
)
def test_the_listing_marks_what_cannot_run(installed, unavailable, available):
    listing = _run(installed, CLI, "--help")
    assert listing.returncode == 0
    # "    NAME  summary" lines, a summary going on over indented lines.
    summaries = {
        name: " ".join(text.split())
        for name, text in re.findall(r"\n {4}(\w+) +(.*?)(?=\n {4}\w|\n\n)", listing.stdout, re.S)
    }
    for command, extra in unavailable.items():
        assert summaries[command].endswith(f"[needs kvswitch[{extra}]]")
    for command in available:
        assert "needs" not in summaries[command]
