"""``kvswitch loadtest`` against a live router and two CPU workers over real gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import Iterator

import pytest

from kvswitch.app.cli import main
from kvswitch.client import AsyncClient
from kvswitch.loadtest import live
from kvswitch.loadtest.openai_target import OpenAITarget
from kvswitch.loadtest.runner import PhasePlan, run_phase
from kvswitch.loadtest.workloads import MultiTurnChat, Scoring
from tests.router.harness import BLOCK_SIZE, ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster

CHAT = MultiTurnChat(conversations=3, turns=3, system_len=40, message_len=20, output_len=4)


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    cluster = BackgroundCluster(num_workers=2)
    try:
        yield cluster
    finally:
        cluster.close()


def _phase(address: str, salt: str, policy: str = "cost"):
    async def go():
        async with AsyncClient(address, max_retries=0) as client:
            plan = PhasePlan(policy, salt, concurrency=1)  # one session after another
            return await run_phase([client], CHAT.sessions(256, 0), plan)

    records, _, _ = asyncio.run(go())
    return records


def test_a_chat_turn_reuses_the_conversation_so_far_and_salts_keep_phases_apart(cluster) -> None:
    first = _phase(cluster.address, "salt-a")
    assert [(r.session, r.turn) for r in first] == [(s, t) for s in range(3) for t in range(3)]
    assert all(r.ok and r.num_output_tokens == 4 for r in first)
    prompt_lens = [r.num_prompt_tokens for r in first]
    # Each turn is the last prompt, its 4-token answer and a 20-token message.
    assert prompt_lens[:3] == [60, 84, 108]
    assert first[0].num_cached_tokens == 0
    for before, after in itertools.pairwise(first):
        if after.turn:  # the conversation so far is cached on the worker it was routed to
            assert after.worker_id == before.worker_id
            assert after.num_cached_tokens >= before.num_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    # The same salt again finds the first prompt cached; another salt finds nothing.
    again = _phase(cluster.address, "salt-a")[0]
    assert again.num_cached_tokens == (60 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert _phase(cluster.address, "salt-b")[0].num_cached_tokens == 0


def test_loadtest_command_reports_every_policy_and_draws_its_plots(cluster, tmp_path) -> None:
    out, plots = tmp_path / "report.json", tmp_path / "plots"
    args = ["loadtest", "--target", cluster.address, "--workload", "multi_turn_chat"]
    args += [
        "--workload-args",
        "conversations=3,turns=3,system_len=160,message_len=80,output_len=4",
    ]
    args += ["--policies", "cost,round_robin", "--warmup", "1", "--rate", "20", "--num-workers"]
    args += ["3", "--slo-ttft-ms", "60000", "--plots", str(plots), "--no-progress"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["policies"]) == ["cost", "round_robin"]
    assert report["workload"]["conversations"] == 3 and report["num_sessions"] == 3
    for figures in report["policies"].values():
        assert (figures["completed"], figures["failed"]) == (6, 0)  # 2 sessions x 3 turns
        assert figures["goodput"] == pytest.approx(figures["request_throughput"])
        workers = figures["per_worker"]
        assert sum(w["requests"] for w in workers.values()) == 6
        assert len(workers) == 3 and workers["(idle 0)"]["requests"] == 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(figures[key]) == {"mean", "median", "p90", "p99"}
            assert figures[key]["mean"] > 0
    # Cost keeps each conversation where its cache is; nothing was cached under another salt.
    # A session hits 240 + 320 of its 240 + 324 + 408 prompt tokens (0.576) from its own turns,
    # and 160 more (0.74) where its first turn joins the worker holding the shared system
    # prompt; on a loaded machine that worker may be busy enough for an idle one to win.
    assert report["policies"]["cost"]["token_hit_rate"] > 0.57
    for name in ("ttft_cdf.png", "hit_rate.png", "worker_load.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_scoring_workload_is_scored_from_the_hidden_state_cache() -> None:
    """Continuations of one context, scored over gRPC and over the HTTP API: after the first,
    each finds the context cached with its hidden states."""
    router = dataclasses.replace(ROUTER_CONFIG, http_port=0)
    worker = dataclasses.replace(WORKER_CONFIG, cache_hidden_states=True)
    scoring = Scoring(contexts=1, context_len=4 * BLOCK_SIZE, choices=3, choice_len=5)
    with BackgroundCluster(1, router, worker) as scored:
        front = scored.router.http_front
        assert front is not None

        async def go(make_target):
            async with make_target() as client:
                if isinstance(client, OpenAITarget):
                    await client.wait_until_connected(10)
                plan = PhasePlan("cost", client.target, concurrency=1)
                return await run_phase([client], scoring.sessions(256, 0), plan)

        for make_target in (
            lambda: AsyncClient(scored.address, max_retries=0),
            lambda: OpenAITarget(front.url),
        ):
            records, _, _ = asyncio.run(go(make_target))
            assert all(r.ok and r.num_output_tokens == 1 for r in records), records
            cached = [r.num_cached_tokens for r in records]
            assert cached == [0, 4 * BLOCK_SIZE, 4 * BLOCK_SIZE]


def test_loadtest_refuses_what_it_cannot_run(capsys) -> None:
    with pytest.raises(SystemExit, match="unknown workload 'chat'"):
        main(["loadtest", "--workload", "chat", "--no-progress"])
    with pytest.raises(SystemExit):
        main(["loadtest", "--policies", "cost,fastest"])
    assert "unknown policies ['fastest']" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"no-such\.jsonl"):
        main(["loadtest", "--workload", "trace", "--workload-args", "path=no-such.jsonl"])


def test_config_refuses_bad_numbers() -> None:
    with pytest.raises(ValueError, match="rate must be positive"):
        live.LoadTestConfig(rate=0)
    with pytest.raises(ValueError, match="an SLO must be"):
        live.LoadTestConfig(slo_ttft_ms=-1)


def test_two_routers_on_one_redis_index_serve_one_fleet_with_its_hits() -> None:
    from kvswitch.deploy.local import ClusterConfig, running

    with running(ClusterConfig(workers=2, port=0, redis="local", grace_s=1.0)) as cluster:
        first, second = cluster.address, cluster.add_router()
        cluster.wait_for_registration()
        config = live.LoadTestConfig(
            target=f"{first},{second}",
            workload="long_document_qa",
            workload_args="documents=3,document_len=256,questions=4,output_len=8",
            policies="cost",
            concurrency=1,  # one question after another: the blocks reach the index meanwhile
            progress=False,
        )
        figures = live.run(config)["policies"]["cost"]
    assert (figures["completed"], figures["failed"]) == (12, 0)
    assert figures["per_router"] == {first: 6, second: 6}
    # Each document is computed once, wherever its first question went; every later question,
    # through either router, hits its 256 tokens: 9 of 12 prompts of 288 tokens.
    assert figures["token_hit_rate"] == pytest.approx(9 * 256 / (12 * 288))
