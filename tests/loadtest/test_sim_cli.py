"""``kvswitch sim``: the JSON it writes, the messages it gives, and what it needs installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvswitch.app.cli import main
from kvswitch.loadtest.policies import ALL_POLICIES
from kvswitch.loadtest.trace import write_trace
from tests.loadtest.helpers import chat_trace
from tests.test_extras import CLI, _run

FIGURES = {"token_hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "load_imbalance"}
FIGURES |= {"utilization", "fetched_token_share", "lora_loads_per_minute", "offload_hit_rate"}


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    write_trace(path, chat_trace(200))
    return path


def sim(trace: Path, *options: str) -> list[str]:
    return ["sim", "--trace", str(trace), "--workers", "4", "--capacity-blocks", "100", *options]


def test_sim_writes_exactly_the_figures_as_json(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    main(sim(trace, "--profile", "cpu", "--json", str(out)))
    figures = json.loads(out.read_text())
    assert figures == json.loads(capsys.readouterr().out)
    assert set(figures) == {"policies", "global_cache", "infinite_cache", "rate_scale", "capacity"}
    assert set(figures["policies"]) == set(ALL_POLICIES)
    assert all(set(f) == FIGURES for f in figures["policies"].values())
    assert set(figures["global_cache"]) == set(figures["infinite_cache"]) == {"token_hit_rate"}
    assert figures["rate_scale"] == 1.0
    bound = figures["infinite_cache"]["token_hit_rate"]
    assert figures["global_cache"]["token_hit_rate"] <= bound
    for f in figures["policies"].values():
        assert 0 <= f["token_hit_rate"] <= bound
        assert 0 < f["ttft_p50_s"] <= f["ttft_p99_s"]
        assert f["load_imbalance"] >= 1 and 0 < f["utilization"] <= 1


def test_sim_replays_every_policy_at_the_rate_found_for_round_robin(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(sim(trace, "--policy", "cost", "--target-utilization", "0.5", "--profile", "cpu"))
    captured = capsys.readouterr()
    figures = json.loads(captured.out)
    assert list(figures["policies"]) == ["cost"]
    assert figures["rate_scale"] != 1.0
    assert f"rate scale {figures['rate_scale']:.4g}: round_robin utilization 0.5" in captured.err


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "{"], ":2: "),
        (['{"timestamp": 0, "input_length": 9000, "output_length": 1, "hash_ids": [0]}'], ":1: 1 "),
    ],
)
def test_a_bad_trace_is_a_message_naming_the_line(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(sim(path))
    assert str(exit_info.value.code).startswith(f"kvswitch sim: {path}{message}")


def test_a_trace_that_does_not_fit_is_a_message(trace: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*sim(trace)[:-1], "3"])
    assert "--capacity-blocks 3 cannot hold the trace's largest request" in str(
        exit_info.value.code
    )


def test_rate_and_target_together_are_a_usage_error(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(sim(trace, "--rate-scale", "2", "--target-utilization", "0.5"))
    assert exit_info.value.code == 2
    assert "error: give --rate-scale or --target-utilization, not both" in capsys.readouterr().err


def test_sim_runs_with_the_router_extra_alone(trace: Path) -> None:
    result = _run(("router",), CLI, *sim(trace, "--policy", "cost"))
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["policies"]) == {"cost"}


def test_sim_with_host_tiers_reports_their_hits_and_bound(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(sim(trace, "--policy", "cost", "--profile", "cpu", "--offload-capacity-blocks", "400"))
    figures = json.loads(capsys.readouterr().out)
    cost = figures["policies"]["cost"]
    assert 0 < cost["offload_hit_rate"] <= cost["token_hit_rate"]
    with_host = figures["global_cache_with_host"]["token_hit_rate"]
    assert figures["global_cache"]["token_hit_rate"] <= with_host
    assert with_host <= figures["infinite_cache"]["token_hit_rate"]
