"""Naming a router's OpenAI-API engines: the options, the fleet file, and what is refused."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from kvswitch.app.cli import main
from kvswitch.cache_index.engine_feed import EngineEndpoints
from kvswitch.cache_index.index import BlockIndex
from kvswitch.router.engines import parse_engines
from kvswitch.router.server import RouterConfig

ENGINE = {"namespace": "m", "http_port": 0}


def test_each_engine_has_its_url_events_and_replay() -> None:
    engines = parse_engines(
        ["a=http://10.0.0.5:8000/v1", "b=https://b.internal:8000/"],
        ["a=tcp://10.0.0.5:5557", "b=tcp://b.internal:5557"],
        ["a=tcp://10.0.0.5:5558"],
        topic="kv",
    )
    assert engines == [
        # The base URL: requests go to its /v1/... paths, polls to /metrics and /health.
        EngineEndpoints(
            "a", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv"
        ),
        EngineEndpoints("b", "https://b.internal:8000", "tcp://b.internal:5557", "", "kv"),
    ]


@pytest.mark.parametrize(
    ("engines", "events", "replays", "message"),
    [
        (["a=http://h:1"], [], [], "none for a: the router would route it blind"),
        (["a=http://h:1"], ["a=tcp://h:2", "b=tcp://h:3"], [], "engine_events names b"),
        (["a=http://h:1"], ["a=tcp://h:2"], ["c=tcp://h:4"], "engine_replay names c"),
        (["a=h:1"], ["a=tcp://h:2"], [], "no http:// or https:// URL"),
        (["a=http://h:1", "a=http://h:2"], ["a=tcp://h:2"], [], "names a twice"),
        (["http://h:1"], [], [], "takes NAME=http://HOST:8000"),
    ],
)
def test_what_names_an_engine_wrong_is_refused(
    engines: list[str], events: list[str], replays: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_engines(engines, events, replays)


def test_a_router_with_engines_needs_their_model_and_its_http_api() -> None:
    named = {"engine": ("a=http://h:1",), "engine_events": ("a=tcp://h:2",)}
    with pytest.raises(ValueError, match="give --namespace too"):
        RouterConfig(**named, http_port=0)
    with pytest.raises(ValueError, match="serve --http-port too"):
        RouterConfig(**named, namespace="m")
    with pytest.raises(ValueError, match="block_size must be positive"):
        RouterConfig(**named, **ENGINE, block_size=0)
    assert [e.name for e in RouterConfig(**named, **ENGINE).engines()] == ["a"]


def test_a_fleet_file_names_engines_beside_the_options(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(
        json.dumps(
            {
                "engines": [
                    {"name": "b", "url": "http://b:8000", "events": "tcp://b:5557"},
                    {
                        "name": "c",
                        "url": "http://c:8000",
                        "events": "tcp://c:5557",
                        "replay": "tcp://c:5558",
                    },
                ]
            }
        )
    )
    config = RouterConfig(
        engine=("a=http://a:8000",),
        engine_events=("a=tcp://a:5557",),
        engine_fleet=str(fleet),
        **ENGINE,
    )
    assert [(e.name, e.replay) for e in config.engines()] == [
        ("a", ""),
        ("b", ""),
        ("c", "tcp://c:5558"),
    ]
    # The same engine twice, once in each, is refused as twice on the command line.
    fleet.write_text(json.dumps([{"name": "a", "url": "http://a:9", "events": "tcp://a:9"}]))
    with pytest.raises(ValueError, match="names a twice"):
        config.engines()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not JSON"),
        ('{"workers": []}', "holds no list of engines"),
        ('[{"name": "a", "url": "http://a:1"}]', "lacks \\['events'\\]"),
        ('[{"name": "a", "url": "http://a:1", "events": "e", "port": 1}]', "unknown fields"),
        ('[{"name": "a", "url": "http://a:1", "events": 5}]', "must be strings"),
    ],
)
def test_a_wrong_fleet_file_is_refused_saying_why(tmp_path: Path, text: str, message: str) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(text)
    with pytest.raises(ValueError, match=message):
        RouterConfig(engine_fleet=str(fleet), **ENGINE)
    with pytest.raises(ValueError, match="cannot read"):
        RouterConfig(engine_fleet=str(tmp_path / "missing.json"), **ENGINE)


def test_the_options_repeat_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "router",
                "--http-port",
                "0",
                "--engine",
                "a=http://h:1",
                "--engine",
                "b=http://h:2",
                "--engine-events",
                "a=tcp://h:3",
            ]
        )
    assert exit_info.value.code == 2
    # Both --engine options reached the config: b lacks its events.
    assert "none for b" in capsys.readouterr().err


def test_a_feed_whose_index_went_away_follows_its_engine_again() -> None:
    """The router's Redis restarts (empty) under a feed: the feed fails, starts again, and
    rebuilds the engine's entries from its replay, the batches that went by meanwhile too."""
    from kvswitch.cache_index.connect import connect_index
    from kvswitch.cache_index.hashing import XXH3_NAMING
    from kvswitch.cache_index.local_redis import LocalRedis
    from kvswitch.router.engines import EngineFeeds
    from tests.cache_index.test_engine_feed import ENGINE as FEED_ENGINE
    from tests.cache_index.test_engine_feed import MODEL as FEED_MODEL
    from tests.cache_index.test_engine_feed import B as FEED_B
    from tests.cache_index.test_engine_feed import Engine, matched, stored, until

    async def main(redis_server: LocalRedis) -> None:
        engine = Engine()
        index = await connect_index(redis_server.url)
        feeds = EngineFeeds.of([engine.endpoints], index, FEED_MODEL, FEED_B, XXH3_NAMING)
        [feed] = feeds.feeds
        feeds.start()
        try:
            await asyncio.wait_for(feed.wait_subscribed(), 30)
            assert await asyncio.to_thread(engine.publisher.wait_subscribed)
            engine.publisher.publish([stored(1, 100)])
            await until(lambda: feed.status.num_batches == 1, feed)
            redis_server.stop()
            engine.publisher.publish([stored(2, 200)])  # its apply fails: the feed stops
            # NOTE: down longer than the index client retries (about 0.4 s): the feed fails.
            await asyncio.sleep(3)
            await asyncio.to_thread(redis_server.restart)  # empty
            deadline = time.monotonic() + 60
            while [await _matched_or_0(index, tag) for tag in (1, 2)] != [3, 3]:
                assert time.monotonic() < deadline, feed.status
                await asyncio.sleep(0.05)
            assert [w.worker_id for w in await index.live_workers()] == [FEED_ENGINE]
        finally:
            await feeds.stop()
            engine.publisher.close()
            await index.close()

    async def _matched_or_0(index: BlockIndex, tag: int) -> int:
        try:
            return await matched(index, tag)
        except index.unavailable_errors:
            return 0

    with LocalRedis() as redis_server:
        asyncio.run(main(redis_server))


def test_a_prefix_only_the_cpu_holds_counts_below_one_on_the_gpu() -> None:
    """Two engines hold one prompt: x on its GPU, y only in its CPU tier (offloaded, then let
    go by the GPU). Followed into the index, y's GPU-tier entry tells them apart: x's three
    blocks count three, y's two (3 x 0.8, rounded down), and the router picks x."""
    import dataclasses

    from kvswitch.cache_index.hashing import XXH3_NAMING
    from kvswitch.cache_index.memory_index import MemoryIndex
    from kvswitch.cache_index.vllm_events import EngineBlockRemoved, EngineBlockStored
    from kvswitch.router.engines import EngineFeeds
    from kvswitch.router.router import Router, TierWeights
    from kvswitch.router.workers import WorkerDirectory
    from tests.cache_index.test_engine_feed import MODEL as FEED_MODEL
    from tests.cache_index.test_engine_feed import B as FEED_B
    from tests.cache_index.test_engine_feed import Engine, prompt, stored, until

    async def main() -> None:
        index = MemoryIndex()
        x, y = Engine(), Engine()
        endpoints = [
            dataclasses.replace(x.endpoints, name="x", address="http://x:8000"),
            dataclasses.replace(y.endpoints, name="y", address="http://y:8000"),
        ]
        feeds = EngineFeeds.of(endpoints, index, FEED_MODEL, FEED_B, XXH3_NAMING)
        feeds.start()
        try:
            for feed in feeds.feeds:
                await asyncio.wait_for(feed.wait_subscribed(), 30)
            for engine in (x, y):
                assert await asyncio.to_thread(engine.publisher.wait_subscribed)
            x.publisher.publish([stored(1, 100)])
            y.publisher.publish([stored(1, 100)])
            y.publisher.publish([EngineBlockStored((100, 101, 102), None, (), 0, medium="CPU")])
            y.publisher.publish([EngineBlockRemoved((100, 101, 102), "GPU")])
            fx, fy = feeds.feeds
            await until(lambda: (fx.status.num_batches, fy.status.num_batches) == (1, 3))
            live = {w.worker_id: w.role for w in await index.live_workers()}
            assert live == {"x": "both", "y": "both", "y#gpu": "tier"}
            directory = WorkerDirectory(index)
            await directory.refresh()
            assert directory.gpu_tiers == {"y": "y#gpu"}
            router = Router(index, directory, None, namespace=FEED_MODEL, policy="prefix")
            plan = router.plan(token_ids=prompt(1))
            first = (await router.route(plan, engines=True)).decision
            assert (first.worker_id, first.num_matched_blocks) == ("x", 3)
            other = (await router.route(plan, exclude={"x"}, engines=True)).decision
            assert (other.worker_id, other.num_matched_blocks) == ("y", 2)
            # A CPU hit counted as a GPU one: the two hold as much.
            router.tier_weights = TierWeights(cpu=1.0)
            other = (await router.route(plan, exclude={"x"}, engines=True)).decision
            assert other.num_matched_blocks == 3
            await directory.stop()
        finally:
            await feeds.stop()
            x.publisher.close()
            y.publisher.close()

    asyncio.run(main())
