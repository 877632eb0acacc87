"""The ``kvswitch`` command line: help texts, the benchmarks' JSON and the demo."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvswitch.app.cli import build_parser, main
from kvswitch.app.cli_args import with_flags
from kvswitch.benchmarks import admission as admission_bench
from kvswitch.client import Client
from tests.router.harness import BackgroundCluster

COMMANDS = [
    [],
    ["demo"],
    ["router"],
    ["up"],
    ["generate"],
    ["worker"],
    ["health"],
    ["bench"],
    ["bench", "pool"],
    ["bench", "hash"],
    ["bench", "kernels"],
    ["bench", "ttft"],
    ["bench", "score"],
    ["bench", "decode"],
    ["bench", "index"],
    ["bench", "router"],
    ["bench", "relay"],
    ["bench", "routers"],
    ["bench", "polls"],
    ["bench", "hops"],
    ["bench", "serve"],
    ["bench", "lookup"],
    ["bench", "step"],
    ["bench", "admission"],
    ["bench", "transfer"],
    ["bench", "holder"],
    ["bench", "pd"],
    ["bench", "overload"],
    ["bench", "routing"],
    ["bench", "http"],
    ["bench", "engines"],
    ["bench", "startup"],
    ["index"],
    ["index", "stats"],
    ["index", "audit"],
    ["kernels"],
    ["kernels", "compile"],
    ["sim"],
    ["loadtest"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "kvswitch")
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvswitch")
    assert "``" not in out  # docstring markup, noise on a terminal


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _all_parsers(sub)
    return found


def test_every_option_and_command_is_explained() -> None:
    parsers = _all_parsers(build_parser())
    assert len(parsers) == len(COMMANDS)
    for parser in parsers:
        assert parser.description, f"{parser.prog} has no description"
        for action in parser._actions:
            assert action.help, f"{parser.prog} {action.option_strings or action.dest}: no help"
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, f"{parser.prog} {choice.dest}: no help"


def test_console_script_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvswitch.app.cli", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert result.stdout.startswith("kvswitch ")


def test_option_defaults_come_from_config() -> None:
    from kvswitch.benchmarks.pool import PoolBenchConfig

    args = build_parser().parse_args(["bench", "pool"])
    assert args.num_blocks == PoolBenchConfig.num_blocks
    assert args.duration_s == PoolBenchConfig.duration_s


def test_invalid_config_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "pool", "--num-blocks", "8"])
    assert exit_info.value.code == 2
    assert "do not fit in 8 blocks" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["worker", "--block-size", "0"], "--block-size must be positive, got 0"),
        (["up", "--workers", "0"], "--workers must be in [1, 64], got 0"),
        (["router", "--pending-ttl-s", "0"], "--pending-ttl-s must be positive, got 0.0"),
        (["worker", "--gpu-memory-fraction", "0.5"], "--gpu-memory-fraction sizes a GPU's"),
        (["loadtest", "--rate", "0"], "--rate must be positive"),
        (["worker", "--bogus"], "unrecognized arguments: --bogus"),
        (["index", "stats", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_option_is_named_as_it_is_typed_under_its_commands_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    command = " ".join(a for a in argv[:2] if not a.startswith("-"))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvswitch {command} [-h]"), err
    assert f"kvswitch {command}: error: {message}" in err


@pytest.mark.parametrize("command", ["up", "worker", "demo", "generate", "loadtest"])
def test_every_option_a_help_names_is_one_the_command_takes(command: str) -> None:
    parser = next(p for p in _all_parsers(build_parser(command)) if p.prog == f"kvswitch {command}")
    # NOTE: argparse wraps help text at a hyphen: "--max-num-" at a line's end, "seqs" next.
    text = re.sub(r"-\n\s+", "-", parser.format_help())
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", text))
    assert len(named) > 5
    assert sorted(named - set(parser._option_string_actions)) == []


def test_up_passes_max_num_seqs_to_its_workers() -> None:
    from kvswitch.deploy.local import ClusterConfig, LocalCluster

    args = build_parser("up").parse_args(["up", "--max-num-seqs", "8", "--workers", "1"])
    assert args.max_num_seqs == 8
    cluster = LocalCluster(ClusterConfig(max_num_seqs=8), inherit_logs=True)
    argv = cluster._worker_argv("worker-0", "both")
    worker_args = build_parser("worker").parse_args(argv[argv.index("worker") :])
    assert worker_args.max_num_seqs == 8


def test_an_option_before_any_command_is_named_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--bogus"], ["--bogus", "worker"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "kvswitch: error: unrecognized option --bogus: give a command first" in err
        assert "demo, router, up, generate, worker" in err and "'kvswitch --help'" in err


def test_index_tools_without_an_index_name_the_one_kvswitch_up_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["index", "stats"])
    err = capsys.readouterr().err
    assert "--index grpc://ROUTER_HOST:PORT for a router's embedded index" in err
    assert "kvswitch up prints" in err and "--index redis://HOST:PORT" in err


def test_generate_names_an_option_the_client_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--top-p", "0"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "kvswitch generate: --top-p must be in (0, 1], got 0.0\n"


def test_with_flags_leaves_prose_alone() -> None:
    fields = ["index", "workers", "kv_cache_bytes", "port"]
    assert with_flags("workers must be in [1, 64]", fields) == "--workers must be in [1, 64]"
    assert with_flags("kv_cache_bytes too small", fields) == "--kv-cache-bytes too small"
    assert with_flags("give the index to look at", fields) == "give the index to look at"
    assert with_flags("port-forward the port", fields) == "port-forward the port"


def test_an_index_that_does_not_answer_is_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(SystemExit) as exit_info:
        main(["index", "stats", "--index", f"redis://user:s3cret@127.0.0.1:{port}"])
    message = str(exit_info.value.code)
    assert message.startswith("kvswitch index stats: cannot use the Redis at redis://user:***@")
    assert "s3cret" not in message


def test_bench_pool_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pool.json"
    main(["bench", "pool", "--duration-s", "0.2", "--num-requests", "64", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures == json.loads(capsys.readouterr().out)
    assert figures["block_ops_per_s"] > 0
    assert 0.5 < figures["hit_block_fraction"] < 1.0
    assert 16 < figures["event_bytes_per_stored_block"] < 40  # a 16-byte hash and framing


def test_json_dash_is_stdout_not_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    main(["bench", "hash", "--duration-s", "0.05", "--json", "-"])
    assert json.loads(capsys.readouterr().out)["tokens_per_s"] > 0
    assert list(tmp_path.iterdir()) == []


def test_bench_hash_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "hash.json"
    main(["bench", "hash", "--duration-s", "0.1", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["tokens_per_s"] > 0
    assert figures["tokens_per_s_list_input"] > 0
    assert figures["tokens_per_s_blake2b_keyed"] > 0
    assert figures["tokens_per_s_blake2b_keyed_list_input"] > 0
    assert figures["blocks_per_s_blake2b_keyed"] == figures["tokens_per_s_blake2b_keyed"] / 16
    assert figures["num_tokens"] == 8192


def test_demo_routes_questions_to_their_documents(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo is what ``make demo`` runs: a real local cluster, requests through the SDK."""
    from kvswitch.app import demo

    figures = demo.run(demo.DemoConfig())
    out, err = capsys.readouterr()
    assert "doc 1 q2" in out and "chat 2 t3" in out
    # The logs are where it says they are, once it is over too.
    log_dir = Path(err.rsplit("logs are kept in ", 1)[1].strip())
    try:
        assert f"logs in {log_dir}" in err
        assert {p.name for p in log_dir.iterdir()} == {"router.log", "worker-0.log", "worker-1.log"}
        assert "router listening on" in (log_dir / "router.log").read_text()
    finally:
        shutil.rmtree(log_dir)
    # Each document stays on one worker: every later question reuses it.
    assert figures["cost_hit_rate"] > 0.6
    # Round robin asks every worker to hold every document, more than fits: few reuses.
    assert figures["round_robin_hit_rate"] < figures["cost_hit_rate"] - 0.25


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this runs the real benchmark")
def test_bench_kernels_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kernels"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "needs a CUDA GPU" in captured.err


def test_bench_kernels_runs_every_step_through_the_interpreter(tmp_path: Path) -> None:
    """The GPU benchmark's own steps, sweep included, on tiny shapes on CPU."""
    from kvswitch.benchmarks.kernels import (
        DECODE_SPLITS,
        DECODE_SWEEP,
        PREFILL_SWEEP,
        PREFIX_HIT_SPLITS,
        PREFIX_HIT_SWEEP,
    )

    out = tmp_path / "kernels.json"
    tiny = "--decode-batch 2 --decode-context 40 --prefill-batch 2 --prefill-tokens 24 "
    tiny += "--num-q-heads 4 --num-kv-heads 2 --head-dim 16 --block-size 4 --store-tokens 8 "
    tiny += "--lora-tokens 5 --lora-slots 2 --lora-rank 4"
    args = ["bench", "kernels", "--device", "cpu", "--dtype", "float32", "--sweep"]
    assert main([*args, *tiny.split(), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu (interpreter)"
    assert figures["datasheet_bytes_per_s"] is None
    figures_per_s = ("decode_bytes_per_s", "prefill_tflops", "sdpa_tflops", "store_bytes_per_s")
    for key in (*figures_per_s, "lora_bytes_per_s"):
        assert figures[key] > 0
    assert figures["prefix_hit_ms"] > 0 and figures["prefix_hit_unsplit_ms"] > 0
    decode_rows = figures["decode_sweep"]
    assert len(decode_rows) == len(DECODE_SWEEP) + len(DECODE_SPLITS)
    assert [r["block_n"] for r in decode_rows[: len(DECODE_SWEEP)]] == [
        n for n, _, _ in DECODE_SWEEP
    ]
    assert len(figures["prefill_sweep"]) == len(PREFILL_SWEEP)
    hit_rows = figures["prefix_hit_sweep"]
    # (The interpreter times one row: every tile and split count would take it minutes.)
    assert len(hit_rows) == 1 and hit_rows[0]["num_splits"] == 2
    assert len(PREFIX_HIT_SWEEP) * len(PREFIX_HIT_SPLITS) == 15
    assert all(r["ms"] > 0 for r in decode_rows + figures["prefill_sweep"] + hit_rows)


def test_bench_ttft_and_decode_write_json(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    args = ["--num-prompt-tokens", "256", "--num-cached-tokens", "192", "--num-trials", "1"]
    main(["bench", "ttft", *args, "--profile", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["cold_ttft_s"] > 0 and figures["warm_ttft_s"] > 0
    for case in ("warm", "cold"):
        profile = figures["profile"][case]
        assert profile["host_ms"] > 0 and profile["num_torch_ops"] > 100  # per-layer ops, 2 layers
    assert figures["speedup"] == pytest.approx(figures["cold_ttft_s"] / figures["warm_ttft_s"])
    out = tmp_path / "decode.json"
    main(
        ["bench", "decode", "--batch-sizes", "1,2", "--num-output-tokens", "4", "--json", str(out)]
    )
    figures = json.loads(out.read_text())
    assert figures["decode_tokens_per_s_batch_1"] > 0
    assert figures["decode_tokens_per_s_batch_2"] > 0


def test_bench_ttft_and_score_measure_the_host_tier_and_scoring(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    args = ["--num-prompt-tokens", "256", "--num-cached-tokens", "192", "--num-trials", "1"]
    main(["bench", "ttft", *args, "--offload-gb", "0.01", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["reloaded_ttft_s"] > 0 and figures["num_loaded_blocks"] > 0
    assert figures["load_gb_per_s"] > 0 and figures["copy_gb_per_s"] > 0
    out = tmp_path / "score.json"
    main(["bench", "score", *args, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["score_cold_s"] > 0 and figures["embed_warm_s"] > 0
    assert figures["hidden_bytes_per_block"] == 16 * 256 * 4


def test_bench_relay_counts_tokens_through_a_router_and_its_cpu(tmp_path: Path) -> None:
    out = tmp_path / "relay.json"
    args = ["--routers", "1", "--duration-s", "0.5", "--concurrency", "2", "--num-clients", "1"]
    main(["bench", "relay", *args, "--num-output-tokens", "256", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["direct_tokens_per_s"] > 0
    routed = figures["routers_1"]
    assert routed["tokens_per_s"] > 0 and routed["router_cpu_s"] > 0
    assert figures["tokens_per_s_per_core"] == routed["tokens_per_s_per_core"] > 0


def test_bench_relay_paced_streams_a_token_a_step(tmp_path: Path) -> None:
    """With --step-ms, a stream gets one token a step: two streams at 5 ms steps read at most
    400 tokens a second (as fast as read, they would be thousands)."""
    out = tmp_path / "relay.json"
    args = ["--routers", "1", "--duration-s", "0.5", "--concurrency", "2", "--num-clients", "1"]
    main(
        ["bench", "relay", *args, "--step-ms", "5", "--num-output-tokens", "64", "--json", str(out)]
    )
    figures = json.loads(out.read_text())
    for tokens_per_s in (figures["direct_tokens_per_s"], figures["routers_1"]["tokens_per_s"]):
        assert 0 < tokens_per_s <= 400 * 1.2
    assert figures["routers_1"]["tokens_per_message_read"] >= 1.0
    # Each message's time from the stub's send to the client's read, straight and through.
    direct, routed = figures["direct_message_delay_us"], figures["routers_1"]["message_delay_us"]
    assert 0 < direct["p50"] <= direct["p99"] and 0 < routed["p50"] <= routed["p99"]
    assert figures["routers_1"]["added_delay_us"]["p50"] == routed["p50"] - direct["p50"]


def test_bench_relay_reads_the_http_api_as_its_clients(tmp_path: Path) -> None:
    """With --api http the clients read streamed completions from the router's HTTP API: the
    same pacing holds (a token a step a stream), counted by the text."""
    out = tmp_path / "relay.json"
    args = ["--routers", "1", "--duration-s", "0.5", "--concurrency", "2", "--num-clients", "1"]
    paced = ["--step-ms", "5", "--num-output-tokens", "64", "--api", "http"]
    main(["bench", "relay", *args, *paced, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["api"] == "http"
    routed = figures["routers_1"]
    assert 0 < routed["tokens_per_s"] <= 400 * 1.2 and routed["router_cpu_s"] > 0
    assert routed["tokens_per_message_read"] >= 1.0
    assert "message_delay_us" not in routed  # NOTE: the text carries no stamps


def test_bench_routers_times_the_paced_events_through_engine_mode(tmp_path: Path) -> None:
    """kvswitch's engine mode before the HTTP stubs: whole completions, streams, and paced
    streams whose events carry the stub's send time (a token every 5 ms)."""
    out = tmp_path / "routers.json"
    args = ["--routers", "kvswitch-engines", "--num-requests", "100", "--duration-s", "0.5"]
    main(["bench", "routers", *args, "--step-ms", "5", "--paced-tokens", "6", "--json", str(out)])
    figures = json.loads(out.read_text())
    direct, routed = figures["direct_event_delay_us"], figures["routers"]["kvswitch-engines"]
    assert 0 < direct["p50"] <= direct["p99"]
    delay = routed["event_delay_us"]
    assert 0 < delay["p50"] <= delay["p99"]
    assert routed["added_event_delay_us"]["p50"] == delay["p50"] - direct["p50"]
    assert routed["tokens_per_s"] > 0 and routed["cpu_us_per_request"] > 0  # 150 requests


def test_bench_lookup_times_a_requests_work_on_the_loop(tmp_path: Path) -> None:
    out = tmp_path / "lookup.json"
    sizes = ["--num-workers", "8", "--num-guesses", "50", "--prefix-blocks", "64"]
    sizes += ["--prompt-tokens", "2000", "--repeats", "3"]
    main(["bench", "lookup", *sizes, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["num_workers"] == 8
    timed = ("pending_match_ms", "embedded_match_ms", "candidate_states_us", "engine_page_parse_us")
    for name in timed:
        assert figures[name] > 0, name


def test_bench_hops_times_a_message_across_each_transport(tmp_path: Path) -> None:
    out = tmp_path / "hops.json"
    args = ["--num-streams", "3", "--num-messages", "30", "--step-ms", "2"]
    main(["bench", "hops", *args, "--json", str(out)])
    figures = json.loads(out.read_text())
    for transport in ("tcp", "grpc-stream", "grpc-bidi"):
        delay_us = figures[transport]["delay_us"]
        assert 0 < delay_us["p50"] <= delay_us["p99"], transport
    with pytest.raises(SystemExit):
        main(["bench", "hops", "--transports", "tcp,udp"])


def test_bench_polls_has_a_router_poll_each_engine_and_worker(tmp_path: Path) -> None:
    """Three stub engines, polled every 0.05 s: the router reads each one's page; then two gRPC
    stub workers' GetLoad (whether it keeps up is the machine's speed, not asserted)."""
    out = tmp_path / "polls.json"
    args = ["--num-engines", "3", "--load-poll-s", "0.05", "--duration-s", "1"]
    main(["bench", "polls", *args, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["polls_per_s_asked"] == 60
    assert figures["metrics_page_bytes"] > 40_000  # a vLLM server's page, not a few gauges
    assert figures["polls_per_s"] > 0
    # NOTE: CPU time is counted in 10 ms ticks: a quick machine may spend under one here.
    assert figures["cpu_us_per_poll"] * figures["polls_per_s"] == pytest.approx(
        figures["router_cores"] * 1e6
    )

    args = ["--kind", "workers", "--num-engines", "2", "--duration-s", "0.5"]
    main(["bench", "polls", *args, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["config"]["kind"] == "workers" and "metrics_page_bytes" not in figures
    assert figures["polls_per_s"] > 0 and figures["polls_per_s_asked"] == 20


def test_bench_step_takes_the_forward_out_of_the_step(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    args = ["--num-seqs", "8", "--context-len", "128", "--num-steps", "3"]
    main(["bench", "step", *args, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert 0 < figures["host_step_ms_min"] <= figures["host_step_ms"] < figures["step_ms"]
    # NOTE: each step's host time is its time less its forward's; the medians of the three
    # need not add up (one slow step on a busy machine moves one median, not the others).
    assert 0 < figures["forward_ms"] < figures["step_ms"]
    assert "parts_ms" not in figures


def test_bench_step_parts_add_up_to_the_host_work(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    args = ["--num-seqs", "8", "--context-len", "128", "--num-steps", "3", "--parts"]
    main(["bench", "step", *args, "--json", str(out)])
    figures = json.loads(out.read_text())
    parts = figures["parts_ms"]
    assert set(parts) == {"schedule", "batch", "runner_inputs", "sample", "hand_out"}
    assert all(ms > 0 for ms in parts.values()), parts
    # Medians of parts need not add up exactly; they are the host work, not the forward.
    assert sum(parts.values()) == pytest.approx(figures["host_step_ms"], rel=0.5)


def test_bench_transfer_moves_every_block_between_worker_processes(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    main(["bench", "transfer", "--num-prompts", "2", "--prompt-tokens", "100", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["num_blocks"] == 2 * 6  # 100 tokens: 6 full blocks a prompt
    assert figures["num_bytes"] == 12 * (32 << 10)
    assert figures["grpc_gbps"] > 0 and figures["blocks_per_s"] > 0
    assert figures["shm_gbps"] > 0 and figures["shm_blocks_per_s"] > 0
    assert figures["copy_gbps"] > max(figures["grpc_gbps"], figures["shm_gbps"])


def test_bench_holder_times_the_holders_decodes_with_and_without_pulls(tmp_path: Path) -> None:
    """Each phase's streams decode on the holder; a pulling phase moves every block of a
    prompt each pull (the taker holds one prompt), over the transport it names."""
    out = tmp_path / "holder.json"
    args = ["--transports", "grpc,mapped", "--num-streams", "1", "--output-tokens", "8"]
    args += ["--num-prompts", "2", "--prompt-tokens", "64", "--duration-s", "1"]
    main(["bench", "holder", *args, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert sorted(figures["phases"]) == ["grpc", "mapped", "none"]  # JSON sorts its keys
    assert figures["prompt_bytes"] == 4 * (32 << 10)
    for phase in figures["phases"].values():
        assert 0 < phase["itl_ms"]["p50"] <= phase["itl_ms"]["p99"]
        assert phase["decode_tokens_per_s"] > 0
    for transport in ("grpc", "mapped"):
        assert figures["phases"][transport]["num_pulls"] >= 1
        assert figures["phases"][transport]["pull_gbps"] > 0
    assert "num_pulls" not in figures["phases"]["none"]
    with pytest.raises(SystemExit):
        main(["bench", "holder", "--transports", "grpc,carrier-pigeon"])


def test_bench_admission_times_the_gaps_between_the_cores_steps(tmp_path: Path) -> None:
    out = tmp_path / "admission.json"
    args = ["--num-decodes", "4", "--prompt-len", "8192", "--steps-before", "5", "--cpu-threads"]
    main(["bench", "admission", *args, "1", "--steps-after", "5", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["prompt_len"] == 8192 and figures["num_decodes"] == 4
    assert figures["cpu_threads"] == 1
    config = admission_bench.AdmissionBenchConfig(cpu_threads=1)
    assert admission_bench.engine_config(config).cpu_threads == 1  # what the core is started with
    assert 0 < figures["baseline_median_step_gap_ms"] <= figures["baseline_max_step_gap_ms"]
    assert figures["max_step_gap_ms"] > 0 and figures["admit_ms"] > 0
    assert 0 < figures["admit_core_ms"] <= figures["max_step_gap_ms"]
    assert figures["arrival_delay_ms"] == pytest.approx(
        figures["max_step_gap_ms"] - figures["baseline_median_step_gap_ms"]
    )


def test_bench_http_sends_the_same_requests_through_both_apis(tmp_path: Path) -> None:
    out = tmp_path / "http.json"
    main(["bench", "http", "--num-requests", "5", "--num-output-tokens", "4", "--json", str(out)])
    figures = json.loads(out.read_text())
    for door in ("grpc", "http"):
        for kind in ("one_token_ms", "whole_ms", "first_token_ms"):
            assert 0 < figures[door][kind]["median"] <= figures[door][kind]["p99"]
    assert set(figures["http_overhead_ms"]) == {"one_token_ms", "whole_ms", "first_token_ms"}


def test_bench_engines_runs_the_workload_through_both_fleets(tmp_path: Path) -> None:
    out = tmp_path / "engines.json"
    args = ["--num-engines", "1", "--documents", "2", "--questions", "2", "--document-len", "64"]
    main(["bench", "engines", *args, "--concurrency", "1", "--json", str(out)])
    fleets = json.loads(out.read_text())["fleets"]
    for fleet in ("engines", "workers"):
        for policy in ("cost", "round_robin"):
            figures = fleets[fleet][policy]
            assert figures["completed"] == 4 and figures["failed"] == 0, (fleet, policy)
        # One request at a time: each document's second question finds it cached.
        assert fleets[fleet]["cost"]["token_hit_rate"] > 0.3


def test_bench_startup_times_every_command_it_lists(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    main(["bench", "startup", "--num-runs", "1", "--repeat", "0", "--json", str(out)])
    seconds = json.loads(out.read_text())["median_s"]
    assert {"--help", "worker --help"} <= set(seconds)
    assert all(s > 0 for s in seconds.values())


def test_bench_index_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "index.json"
    main(["bench", "index", "--num-lookups", "20", "--num-event-batches", "10", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["backend"] == "memory"
    assert 0 < figures["lookup_p50_ms"] <= figures["lookup_p99_ms"]
    assert figures["events_per_s"] > 0
    assert figures["bytes_per_entry"] >= 16
    assert figures["workers_dropped"] == 0 and figures["busy_errors"] == 0


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_bench_index_times_lookups_while_a_worker_resyncs(tmp_path: Path, backend: str) -> None:
    out = tmp_path / "index.json"
    fleet = ["--num-workers", "4", "--num-other-blocks", "1000", "--resync-blocks", "20000"]
    counts = ["--num-lookups", "20", "--num-event-batches", "10"]
    main(["bench", "index", "--backend", backend, *fleet, *counts, "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["config"]["resync_blocks"] == 20_000
    # 4 workers' prefixes and their 1,000 other blocks, and the resynced worker's snapshot
    assert figures["num_entries"] == sum(128 * (k + 1) for k in range(4)) + 1000 + 20_000
    assert figures["resync_s"] > 0 and figures["num_lookups_during_resync"] >= 1
    assert figures["lookup_p50_during_resync_ms"] <= figures["lookup_p99_during_resync_ms"]
    assert figures["workers_dropped"] == 0 and figures["busy_errors"] == 0


def test_bench_index_fails_at_once_when_its_resyncing_process_dies_before_its_turn() -> None:
    """The resyncing process cannot reach the index (its URL names a port nobody listens on) and
    exits: the bench says so, instead of waiting for ever for it to say it is ready."""
    import asyncio

    from kvswitch.benchmarks import index as index_bench
    from kvswitch.cache_index.connect import connect_index
    from kvswitch.cache_index.local_redis import LocalRedis, free_port

    config = index_bench.IndexBenchConfig(backend="redis", num_workers=1, resync_blocks=100)

    async def body(url: str) -> None:
        index = await connect_index(url, prefix="bench-dies")
        try:
            fleet = index_bench._Fleet(config, [])
            nowhere = f"redis://127.0.0.1:{free_port()}"
            with pytest.raises(RuntimeError, match=r"the resyncing process ended \(1\)"):
                await index_bench._during_resync(index, config, nowhere, fleet, [])
        finally:
            await index.close()

    with LocalRedis() as server:
        asyncio.run(body(server.url))


def test_bench_serve_checks_a_local_cluster_against_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    args = ["--num-prompts", "2", "--num-prompt-tokens", "48", "--num-shared-tokens", "32"]
    assert main(["bench", "serve", *args, "--max-tokens", "4", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["ok"] and figures["max_logit_gap"] == 0.0
    assert figures["num_requests"] == 4 and figures["num_tokens"] == 16
    # The second prompt reuses the 32 shared tokens; in the second pass each prompt hits all its
    # blocks but the last (the last prompt token is always computed): 32 of 48 again.
    assert figures["cached_tokens"] == {"cold": 32, "cached": 64}


def test_bench_serve_flags_a_token_the_reference_would_not_choose() -> None:
    from kvswitch.benchmarks.serve import ServeBenchConfig, _reference_gaps
    from kvswitch.worker.engine import EngineConfig, LLMEngine
    from kvswitch.worker.request import SamplingParams

    config = ServeBenchConfig(num_prompts=1, num_prompt_tokens=20, num_shared_tokens=0)
    prompt = [256, *b"the reference decides"][:20]
    # The engine's own greedy continuation has no gap anywhere.
    output = LLMEngine(EngineConfig()).generate([prompt], SamplingParams(max_tokens=6))[0]
    greedy = [{"prompt": 0, "token_ids": output}]
    _reference_gaps(config, greedy, [prompt])
    assert greedy[0]["gaps"] == [0.0] * 6
    # Swap the fourth token for another: only that position is flagged, well past tolerance.
    wrong = list(greedy[0]["token_ids"])
    wrong[3] = (wrong[3] + 1) % 257
    records = [{"prompt": 0, "token_ids": wrong}]
    _reference_gaps(config, records, [prompt])
    gaps = records[0]["gaps"]
    assert gaps[:3] == [0.0] * 3 and gaps[3] > config.logit_tolerance


def test_ctrl_c_stops_generate_and_its_request_without_a_traceback() -> None:
    cluster = BackgroundCluster(num_workers=1)
    (worker,) = cluster.workers
    # Python's own Ctrl-C handler, even where this test runs with SIGINT ignored.
    code = (
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from kvswitch.app.cli import main\n"
        "sys.exit(main())\n"
    )
    argv = ["generate", "--target", cluster.address, "--prompt", "go on", "--max-tokens", "4000"]
    process = subprocess.Popen(
        [sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while worker.engine.load.num_running_requests == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=15)
        assert process.returncode == 130
        assert err.decode().strip().endswith("kvswitch generate: interrupted")
        assert b"Traceback" not in err
        # The stream's call was cancelled: the worker stopped computing it.
        while worker.engine.load.num_running_requests:
            assert time.monotonic() < deadline + 15, "the worker kept running the request"
            time.sleep(0.02)
    finally:
        process.kill()
        process.wait()
        cluster.close()


def test_loadtest_prints_a_table_and_json_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def loadtest(*args: str) -> str:
        argv = ["loadtest", "--target", cluster.address, "--workload", "no_sharing"]
        argv += ["--workload-args", "requests=2,prompt_len=32,output_len=2", "--no-progress"]
        assert main([*argv, "--policies", "cost,round_robin", *args]) == 0
        return capsys.readouterr().out

    with BackgroundCluster(1) as cluster:
        table = loadtest().splitlines()
        assert table[0].split() == ["policy", "cost", "round_robin"]
        assert table[2].split() == ["Successful", "requests", "2", "2"]
        for label in ("Request throughput (req/s)", "TTFT P99 (ms)", "Prompt tokens from cache"):
            assert any(line.startswith(label) for line in table), label
        # --json FILE: the file, as before, and the table
        out = loadtest("--json", str(tmp_path / "report.json")).splitlines()
        assert out[0].split() == table[0].split() and len(out) == len(table)
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["policies"]["cost"]["completed"] == 2
        # --json -: the JSON on stdout, no table
        report = json.loads(loadtest("--json", "-"))
        assert list(report["policies"]) == ["cost", "round_robin"]
    assert not (Path.cwd() / "-").exists()


def test_starting_a_router_or_worker_by_name_does_not_load_torch() -> None:
    # Only the worker's engine core needs torch; a serving process that loads it anyway spends
    # seconds and hundreds of MB on it, at every restart.
    code = (
        "import sys\n"
        "from kvswitch.app.cli import build_parser\n"
        "for command in ('router', 'worker', 'up', 'generate'):\n"
        "    build_parser(command).parse_known_args([command])\n"
        "print('torch' in sys.modules)\n"
    )
    assert python_prints(code) == "False"


def python_prints(code: str) -> str:
    """What a fresh Python running ``code`` prints, stripped."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The commands configure the root logger; leave it as it was for the tests after."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = saved


def broken_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory whose tokenizer.json is not JSON."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "tokenizer.json").write_text("{not json")
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["index", "stats", "--index", "foo://x"],
            "kvswitch index stats: unknown index URL scheme 'foo': use memory://, redis://",
        ),
        (
            ["index", "audit", "--index", "redis://127.0.0.1:notaport"],
            "kvswitch index audit: index URL redis://127.0.0.1:notaport: Port could not be cast",
        ),
        (
            ["worker", "--port", "0", "--model", "/nonexistent/checkpoint"],
            "kvswitch worker: cannot load the model: --model /nonexistent/checkpoint: no such "
            "checkpoint directory",
        ),
        (
            ["worker", "--port", "0", "--model", "{broken}"],
            "kvswitch worker: cannot load the model: {broken}/tokenizer.json cannot be read:",
        ),
        (
            ["router", "--port", "0", "--model", "{broken}"],
            "kvswitch router: {broken}/tokenizer.json cannot be read:",
        ),
        (
            ["generate", "--target", "127.0.0.1:1", "--prompt-file", "/nonexistent/prompt.txt"],
            "kvswitch generate: --prompt-file /nonexistent/prompt.txt: No such file or directory",
        ),
    ],
)
def test_bad_input_ends_in_one_line_and_a_failing_exit_status(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    root_logging: None,
) -> None:
    broken = str(broken_checkpoint(tmp_path))
    argv = [arg.replace("{broken}", broken) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    code = exit_info.value.code
    # sys.exit(message) for servers and tools; generate prints its line and returns 1
    said = code if isinstance(code, str) else capsys.readouterr().err.strip()
    assert code not in (0, None)
    assert said.startswith(message.replace("{broken}", broken)), said
    assert "\n" not in said and "Traceback" not in capsys.readouterr().err


def test_the_command_list_and_version_load_no_command() -> None:
    # kvswitch --help took 3 s when it built every command, the kernels' torch included.
    code = (
        "import contextlib, io, sys\n"
        "from kvswitch.app.cli import main\n"
        "for argv in (['--help'], ['--version'], []):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()):\n"
        "        main(argv)\n"
        "heavy = ('torch', 'grpc', 'numpy', 'kvswitch.router.server', 'kvswitch.benchmarks.pool')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    assert python_prints(code) == "[]"


def test_generate_takes_the_prompt_as_ids_from_a_file_or_stdin_with_stops_and_lora(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def generate(*args: str) -> tuple[int, str, str]:
        try:
            main(["generate", "--target", cluster.address, "--max-tokens", "6", *args])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    with BackgroundCluster(1) as cluster, Client(cluster.address) as client:
        expected = client.generate("Hi there", max_tokens=6)
        assert generate("--prompt", "Hi there")[1] == expected.text + "\n"
        (tmp_path / "prompt.txt").write_text("Hi there")
        assert generate("--prompt-file", str(tmp_path / "prompt.txt"))[1] == expected.text + "\n"
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hi there")))
        assert generate("--prompt-file", "-")[1] == expected.text + "\n"
        ids = client.generate(prompt_token_ids=[256, 72, 105], max_tokens=6)
        code, out, _ = generate("--prompt-token-ids", "256,72,105")
        assert (code, out) == (0, ids.text + "\n")
        # stopped where the third token it generates first comes (its EOS or a stop token
        # is kept), finish reason stop; the other stop id never comes
        stop, unused = ids.token_ids[2], next(i for i in range(257) if i not in ids.token_ids)
        num_tokens = ids.token_ids.index(stop) + 1
        code, _, err = generate(
            "--prompt-token-ids", "256,72,105", "--stop-token-ids", f"{unused},{stop}"
        )
        assert code == 0 and err.startswith("[stop]"), err
        assert f" {num_tokens} output tokens" in err
        code, _, err = generate("--prompt", "Hi", "--lora", "no-such-adapter")
        assert code == 1 and "NOT_FOUND: lora: no live worker serves the adapter" in err


def test_an_unset_bool_or_none_option_stays_none() -> None:
    """``bool | None`` fields (a default that depends on other options, as --cuda-graphs on
    the device) parse to None unless --field or --no-field is given."""
    import argparse
    import dataclasses

    from kvswitch.app.cli_args import add_config_args, config_from_args

    @dataclasses.dataclass
    class Options:
        graphs: bool | None = None

    parser = argparse.ArgumentParser()
    add_config_args(parser, Options, {"graphs": "replay graphs; default: on a GPU"})
    for argv, want in (([], None), (["--graphs"], True), (["--no-graphs"], False)):
        assert config_from_args(Options, parser.parse_args(argv)).graphs is want
    assert "(default" not in parser.format_help()
