"""A load client for the multi-host test, run inside its network namespace (``ip netns exec``):
``python tests/deploy/netns_client.py SPEC OUT``.

SPEC is a JSON file: ``{"routers": ["HOST:PORT", ...], "requests": [{"prompt": [ids],
"max_tokens": n, "router": i, "at_s": t}, ...]}``; each request is sent through router ``i`` at
``t`` seconds after the start, streams to its end, and its outcome is written to OUT as JSON:
``{"start_s": monotonic start, "results": [{"sent_s", "done_s", "token_ids", "worker_id",
"num_cached_tokens", "reason", "error"}, ...]}`` in the order of the requests. Times are
``time.monotonic()``, which the test process shares (one clock per machine).

``python tests/deploy/netns_client.py --wait-busy WORKER_ADDRESS`` returns once that worker runs
a request (its GetLoad says so), or fails after 30 s.

``python tests/deploy/netns_client.py --check-quiet INDEX_URL ID=ADDRESS ...`` writes, as JSON on
stdout, each quiet worker's leaked KV blocks and whether the index agrees with every worker
(``kvswitch.loadtest.fleet_checks``).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvswitch.client import Client, KvswitchError


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as file:
        spec = json.load(file)
    clients = [Client(address, timeout_s=60, max_retries=0) for address in spec["routers"]]
    start_s = time.monotonic()

    def send(request: dict[str, Any]) -> dict[str, Any]:
        time.sleep(max(start_s + request["at_s"] - time.monotonic(), 0.0))
        sent_s = time.monotonic()
        try:
            result = clients[request["router"]].generate(
                prompt_token_ids=request["prompt"], max_tokens=request["max_tokens"]
            )
        except KvswitchError as e:
            return {"sent_s": sent_s, "done_s": time.monotonic(), "error": str(e)}
        return {
            "sent_s": sent_s,
            "done_s": time.monotonic(),
            "token_ids": list(result.token_ids),
            "worker_id": result.stats.worker_id,
            "num_cached_tokens": result.stats.num_cached_tokens,
            "reason": result.route.reason,
            "error": "",
        }

    with ThreadPoolExecutor(max(len(spec["requests"]), 1)) as pool:
        results = list(pool.map(send, spec["requests"]))
    for client in clients:
        client.close()
    with open(out_path, "w") as file:
        json.dump({"start_s": start_s, "results": results}, file)


def wait_busy(address: str) -> None:
    import grpc

    from kvswitch.v1 import worker_pb2, worker_pb2_grpc

    deadline = time.monotonic() + 30
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        while stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5).num_running_requests == 0:
            if time.monotonic() > deadline:
                sys.exit(f"{address} ran no request for 30 s")
            time.sleep(0.005)


def check_quiet(index_url: str, workers: dict[str, str]) -> None:
    from kvswitch.loadtest.fleet_checks import leaked_blocks, wait_for_index

    leaks = {worker_id: leaked_blocks(address) for worker_id, address in workers.items()}
    seconds, check = wait_for_index(index_url, lambda: workers, timeout_s=15)
    report = {"leaked_blocks": leaks, "index_clean": seconds is not None}
    print(json.dumps({**report, "index": check.to_json() if check else None}))


if __name__ == "__main__":
    if sys.argv[1] == "--wait-busy":
        wait_busy(sys.argv[2])
    elif sys.argv[1] == "--check-quiet":
        check_quiet(sys.argv[2], dict(arg.split("=", 1) for arg in sys.argv[3:]))
    else:
        main(sys.argv[1], sys.argv[2])
