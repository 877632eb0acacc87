"""Tests for the kvswitch.v1 gRPC contracts.

* Drift: the committed generated code in kvswitch/v1/ must equal what
  proto/codegen.py produces from proto/kvswitch/v1/*.proto, byte for byte.
* Round trip: a real gRPC server on 127.0.0.1 serving Worker, Router and
  grpc.health.v1 to a real client channel.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvswitch.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

GENERATED_DIR = REPO_ROOT / "kvswitch" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
REGEN_HINT = "generated code is out of date with proto/; run `make proto` (python proto/codegen.py)"


CODEGEN = REPO_ROOT / "proto" / "codegen.py"
# Runs proto/codegen.py's generate() (proto/ is not an installed package): argv is the output
# folder, and a proto root to read instead of the repository's, if any. Prints the files written,
# or the CodegenError.
_GENERATE = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("codegen", sys.argv[1])
codegen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(codegen)
if len(sys.argv) > 3:
    codegen.PROTO_ROOT = Path(sys.argv[3])
try:
    print("\\n".join(str(path) for path in codegen.generate(Path(sys.argv[2]))))
except codegen.CodegenError as e:
    sys.exit(f"CodegenError: {e}")
"""


def generate(out_dir: Path, proto_root: Path | None = None) -> subprocess.CompletedProcess[str]:
    """proto/codegen.py's ``generate``, in a process of its own: protoc brings a protobuf runtime
    of its own, which once crashed a test process that had loaded grpc's and torch's."""
    argv = [sys.executable, "-c", _GENERATE, str(CODEGEN), str(out_dir)]
    argv += [str(proto_root)] if proto_root is not None else []
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- drift


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    done = generate(tmp_path)
    assert done.returncode == 0, done.stderr
    written = [Path(line) for line in done.stdout.splitlines()]
    assert written, "codegen.generate wrote no files"

    problems = []
    fresh_names = set()
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        fresh_names.add(rel.name)
        committed = REPO_ROOT / rel
        if not committed.is_file():
            problems.append(f"missing committed file {rel}")
        elif committed.read_bytes() != fresh.read_bytes():
            problems.append(f"{rel} differs from freshly generated code")

    committed_generated = {
        p.name for suffix in GENERATED_SUFFIXES for p in GENERATED_DIR.glob("*" + suffix)
    }
    for orphan in sorted(committed_generated - fresh_names):
        problems.append(f"kvswitch/v1/{orphan} has no source .proto")

    assert not problems, REGEN_HINT + ":\n  " + "\n  ".join(problems)


def test_codegen_reports_protoc_failure(tmp_path: Path) -> None:
    bad_root = tmp_path / "proto"
    (bad_root / "kvswitch" / "v1").mkdir(parents=True)
    (bad_root / "kvswitch" / "v1" / "broken.proto").write_text(
        'syntax = "proto3";\npackage kvswitch.v1;\nmessage Broken { nope x = 1; }\n'
    )
    done = generate(tmp_path / "out", bad_root)
    assert done.returncode == 1
    assert "CodegenError: grpc_tools.protoc exited with status 1" in done.stderr, done.stderr


# ---------------------------------------------------------------------- round trip

HASHES = [bytes([i]) * 16 for i in range(5)]
SNAPSHOT_SPLIT = 3  # first chunk carries HASHES[:3], second HASHES[3:]


class _FakeWorker(worker_pb2_grpc.WorkerServicer):
    def GetLoad(self, request, context):
        return worker_pb2.WorkerLoad(
            worker_id="w0",
            num_running_requests=3,
            num_waiting_requests=2,
            num_queued_prefill_tokens=4096,
            num_free_blocks=100,
            num_total_blocks=1000,
            block_size=16,
        )

    def Snapshot(self, request, context):
        for part in (HASHES[:SNAPSHOT_SPLIT], HASHES[SNAPSHOT_SPLIT:]):
            yield worker_pb2.SnapshotChunk(
                worker_id="w0", model="m", block_size=16, event_seq=42, block_hashes=part
            )


class _FakeRouter(router_pb2_grpc.RouterServicer):
    def Generate(self, request, context):
        assert request.WhichOneof("prompt") == "token_ids"
        n = len(request.token_ids.ids)
        yield router_pb2.GenerateResponse(chunk=common_pb2.TokenChunk(token_ids=[7], text="a"))
        yield router_pb2.GenerateResponse(chunk=common_pb2.TokenChunk(token_ids=[8, 9], text="bc"))
        yield router_pb2.GenerateResponse(
            final=router_pb2.GenerateFinal(
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                stats=common_pb2.RequestStats(
                    worker_id="w0",
                    num_prompt_tokens=n,
                    num_cached_tokens=16,
                    ttft_s=0.25,
                    num_output_tokens=3,
                ),
                route=router_pb2.RouteDecision(
                    worker_id="w0",
                    policy=request.routing.policy or "cache_aware",
                    reason="longest prefix match",
                    num_matched_blocks=1,
                    score=0.5,
                ),
            )
        )


@pytest.fixture
def server_port():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(_FakeWorker(), server)
    router_pb2_grpc.add_RouterServicer_to_server(_FakeRouter(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("kvswitch.v1.Router", "kvswitch.v1.Worker"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port != 0
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=0.5).wait()


def test_grpc_round_trip(server_port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server_port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=5)

        health_stub = health_pb2_grpc.HealthStub(channel)
        for name in ("kvswitch.v1.Router", "kvswitch.v1.Worker"):
            resp = health_stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name

        worker = worker_pb2_grpc.WorkerStub(channel)
        load = worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert load == worker_pb2.WorkerLoad(
            worker_id="w0",
            num_running_requests=3,
            num_waiting_requests=2,
            num_queued_prefill_tokens=4096,
            num_free_blocks=100,
            num_total_blocks=1000,
            block_size=16,
        )

        chunks = list(worker.Snapshot(worker_pb2.SnapshotRequest(), timeout=5))
        assert len(chunks) == 2
        assert all(
            (c.worker_id, c.model, c.block_size, c.event_seq) == ("w0", "m", 16, 42) for c in chunks
        )
        assert [h for c in chunks for h in c.block_hashes] == HASHES

        router = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            request_id="r1",
            token_ids=router_pb2.TokenIds(ids=list(range(20))),
            sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0, seed=1),
            routing=router_pb2.RoutingOverrides(policy="cache_aware", weights={"cache": 1.0}),
        )
        responses = list(router.Generate(request, timeout=5))
        assert [r.WhichOneof("kind") for r in responses] == ["chunk", "chunk", "final"]
        assert [list(r.chunk.token_ids) for r in responses[:2]] == [[7], [8, 9]]
        assert "".join(r.chunk.text for r in responses[:2]) == "abc"
        final = responses[-1].final
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.stats == common_pb2.RequestStats(
            worker_id="w0",
            num_prompt_tokens=20,
            num_cached_tokens=16,
            ttft_s=0.25,
            num_output_tokens=3,
        )
        assert final.route == router_pb2.RouteDecision(
            worker_id="w0",
            policy="cache_aware",
            reason="longest prefix match",
            num_matched_blocks=1,
            score=0.5,
        )


def test_message_semantics() -> None:
    """Presence / oneof behaviour the router and workers rely on."""
    params = common_pb2.SamplingParams()
    assert not params.HasField("seed")
    params.seed = 0
    assert params.HasField("seed")  # explicit seed 0 is distinguishable from unset

    req = router_pb2.GenerateRequest(text="hi")
    assert req.WhichOneof("prompt") == "text"
    req.token_ids.ids.append(1)
    assert req.WhichOneof("prompt") == "token_ids"

    roundtrip = router_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert roundtrip == req
    assert common_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
