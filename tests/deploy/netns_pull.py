"""The client side of the multi-host NIXL test, run inside its network namespace (``ip netns
exec``): ``python tests/deploy/netns_pull.py HOLDER TAKER SPEC``.

SPEC is JSON: ``{"small": [prompt ids], "large": [prompt ids], "small_hashes": [hex],
"large_hashes": [hex], "timeout_s": t}``. Each step writes one JSON line to stdout; a step that
waits for the test reads a line from stdin first::

    {"step": "small", ...}     the small prompt computed on HOLDER, pulled by TAKER over NIXL,
                               then served by TAKER: the pull's reply and both workers' tokens
    {"step": "held"}           the large prompt computed on HOLDER, its blocks held 60 s
    <- stdin                   (the test slows HOLDER's link)
    {"step": "large", ...}     TAKER's pull of it over NIXL: the reply, or the error's code
    <- stdin                   (the test has restored the link)
    {"step": "after", ...}     how many of the large prompt's blocks TAKER caches, its free
                               blocks of its total, and the small prompt served again
"""

from __future__ import annotations

import json
import sys

import grpc

from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def generate(stub: worker_pb2_grpc.WorkerStub, prompt: list[int], **options: int) -> dict:
    request = worker_pb2.WorkerGenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
        **options,
    )
    responses = list(stub.Generate(request, timeout=60))
    final = responses[-1].final
    return {
        "tokens": [t for r in responses[:-1] for t in r.chunk.token_ids],
        "num_cached_tokens": final.stats.num_cached_tokens,
    }


def pull(stub: worker_pb2_grpc.WorkerStub, holder: str, hashes: list[str], timeout_s: float):
    request = worker_pb2.PullBlocksRequest(
        request_id="netns-pull",
        peer_address=holder,
        block_hashes=[bytes.fromhex(h) for h in hashes],
        transport="nixl",
    )
    try:
        reply = stub.PullBlocks(request, timeout=timeout_s)
    except grpc.RpcError as e:
        return {"error": e.code().name, "details": e.details()}
    return {
        "transport": reply.transport,
        "num_transferred_blocks": reply.num_transferred_blocks,
        "num_cached_blocks": reply.num_cached_blocks,
    }


def main(holder_address: str, taker_address: str, spec_path: str) -> None:
    with open(spec_path) as file:
        spec = json.load(file)
    with (
        grpc.insecure_channel(holder_address) as holder_channel,
        grpc.insecure_channel(taker_address) as taker_channel,
    ):
        holder = worker_pb2_grpc.WorkerStub(holder_channel)
        taker = worker_pb2_grpc.WorkerStub(taker_channel)
        computed = generate(holder, spec["small"])
        pulled = pull(taker, holder_address, spec["small_hashes"], 30)
        served = generate(taker, spec["small"])
        say(step="small", computed=computed, pulled=pulled, served=served)

        generate(holder, spec["large"], hold_blocks_ms=60_000)
        say(step="held")
        sys.stdin.readline()
        say(
            step="large",
            pulled=pull(taker, holder_address, spec["large_hashes"], spec["timeout_s"]),
        )
        sys.stdin.readline()
        snapshot = taker.Snapshot(worker_pb2.SnapshotRequest(), timeout=30)
        cached = {h.hex() for chunk in snapshot for h in chunk.block_hashes}
        load = taker.GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
        say(
            step="after",
            num_large_cached=len(cached & set(spec["large_hashes"])),
            free=[load.num_free_blocks, load.num_total_blocks],
            served=generate(taker, spec["small"]),
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
