"""A worker's start: what its engine core imports, the phases it logs, and ``kvswitch bench
startup``'s figures."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from kvswitch.app.cli import main
from kvswitch.worker.startup import process_age_s


def test_a_cpu_engine_core_builds_its_model_without_importing_triton() -> None:
    # Triton's import took 0.4 s of every CPU worker's start (and 2 s on a busy machine), for
    # kernels only a GPU runs.
    code = (
        "import sys\n"
        "from kvswitch.worker.engine import LLMEngine\n"
        "from kvswitch.worker.engine_config import EngineConfig\n"
        "engine = LLMEngine(EngineConfig(kv_cache_bytes=1 << 20))\n"
        "print('triton' in sys.modules)\n"
    )
    assert _python_prints(code) == "False"


def test_the_kernels_package_hands_out_each_launcher_whichever_import_comes_first() -> None:
    # The launchers load on first use; importing a launcher's module first must not leave the
    # module where the package's name for the launcher was.
    code = (
        "import kvswitch.kernels.rotary\n"
        "from kvswitch.kernels import paged_decode, rotary\n"
        "from kvswitch.kernels.paged_decode import paged_decode as launcher\n"
        "print(callable(rotary), paged_decode is launcher)\n"
    )
    assert _python_prints(code) == "True True"


def test_process_age_counts_from_the_process_start() -> None:
    started_s = time.monotonic()
    age_s = float(_python_prints("from kvswitch.worker.startup import process_age_s\n"
                                 "print(process_age_s())"))  # fmt: skip
    assert 0 < age_s <= time.monotonic() - started_s + 0.02  # ticks of 10 ms
    own_age_s = process_age_s()
    assert own_age_s is not None and own_age_s >= age_s


def test_bench_startup_times_a_worker_from_its_start_to_its_first_routed_request(
    tmp_path: Path,
) -> None:
    out = tmp_path / "startup.json"
    main(["bench", "startup", "--num-runs", "0", "--repeat", "1", "--no-restart",
          "--json", str(out)])  # fmt: skip
    figures = json.loads(out.read_text())
    assert len(figures["runs"]) == 1 and "restart_runs" not in figures
    assert "median_s" not in figures  # --num-runs 0: no command timed
    # In the order they happen, each within the worker's whole start.
    order = ["import_s", "listening_s", "registered_s", "worker_ready_s"]
    assert 0 < figures["import_s"] < figures["listening_s"]
    assert [figures[key] for key in order] == sorted(figures[key] for key in order)
    core = ["core_spawn_s", "core_import_s", "model_load_s"]
    assert all(figures[key] > 0 for key in core)
    assert sum(figures[key] for key in core) <= figures["engine_core_start_s"]
    # The worker's own figures count in ticks of 10 ms.
    assert figures["import_s"] + figures["engine_core_start_s"] <= figures["listening_s"] + 0.05
    assert figures["worker_ready_s"] < 120


def _python_prints(code: str) -> str:
    """What a fresh Python running ``code`` prints, stripped."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()
