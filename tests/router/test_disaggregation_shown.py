"""Where a disaggregated request ran, as seen outside the SDK: the HTTP API's headers and the
line ``kvswitch generate`` prints name the prefill worker beside the decode worker, and the
number of KV blocks moved between them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kvswitch.app.cli import main
from tests.router.harness import BackgroundCluster
from tests.router.test_disaggregation import MAX_TOKENS, prompt_of
from tests.router.test_openai_http import ROUTER, WORKER, openai_client


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    with BackgroundCluster(0, dataclasses.replace(ROUTER, kv_transport="grpc"), WORKER) as cluster:
        cluster.add_worker("p0", role="prefill")
        cluster.add_worker("d0", role="decode")
        yield cluster


def test_http_headers_name_the_prefill_worker_and_the_blocks_moved(
    cluster: BackgroundCluster,
) -> None:
    prompt = prompt_of(11)  # 296 tokens: 18 full blocks, all uncached on d0
    with openai_client(cluster, api_key="unused") as client:
        raw = client.completions.with_raw_response.create(
            model="kvswitch-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert raw.headers["x-kvswitch-worker"] == "d0"
        assert raw.headers["x-kvswitch-prefill-worker"] == "p0"
        assert raw.headers["x-kvswitch-kv-blocks-moved"] == "18"
        # The decode worker holds the prompt now: it prefills the little that is new itself.
        again = client.completions.with_raw_response.create(
            model="kvswitch-tiny", prompt=[*prompt, *b" Why?"], max_tokens=2, temperature=0
        )
    assert again.headers["x-kvswitch-worker"] == "d0"
    assert "x-kvswitch-prefill-worker" not in again.headers
    assert "x-kvswitch-kv-blocks-moved" not in again.headers


def test_kvswitch_generate_names_the_prefill_worker_and_the_blocks_moved(
    cluster: BackgroundCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = ",".join(map(str, prompt_of(12)))
    argv = ["generate", "--target", cluster.address, "--max-tokens", str(MAX_TOKENS)]
    main([*argv, "--prompt-token-ids", prompt])
    err = capsys.readouterr().err
    assert err.startswith("[length] worker d0 (prefill on p0, 18 KV blocks moved): 296 prompt"), err
    main([*argv, "--prompt-token-ids", f"{prompt},63"])
    err = capsys.readouterr().err
    assert err.startswith("[length] worker d0: 297 prompt tokens (288 cached)"), err
