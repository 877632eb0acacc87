"""KV blocks over NIXL between two hosts: a prefill worker and a decode worker, each in a network
namespace of its own (``tests/deploy/netns.py``), UCX restricted to TCP (``UCX_TLS=tcp``: on
one machine it would otherwise copy through shared memory), and a client in a third.

- A prompt's blocks pulled over NIXL across the hosts serve the prompt on the decode worker as
  on the prefill worker.
- The prefill worker's link cut in the middle of a read (slowed to 4 MB/s, cut once a third of
  the bytes went out): the read fails at its limit, no block of it is cached, none is held,
  and once the link is back the decode worker serves as before.

Skips, saying why, where network namespaces cannot be made (not root) or NIXL is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.serving import start_server_process
from kvswitch.worker.weights import model_namespace
from tests.deploy.netns import NetnsHosts, hosts_or_skip
from tests.worker.test_nixl_kv import needs_nixl

pytestmark = needs_nixl

CLIENT = Path(__file__).with_name("netns_pull.py")
BLOCK_SIZE = 16
BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
SMALL = [256, *b"A document both hosts will hold, block after block. " * 6][:288]  # 18 blocks
LARGE = [256, *b"A longer one, read over a slow link and cut midway. " * 40][:2048]  # 128 blocks
RATE = "32mbit"  # 4 MB/s: the large prompt's 4 MiB take about a second
# The pull's deadline: past the read's own limit (10 s), so that the read's failure is what
# answers it.
PULL_TIMEOUT_S = 15.0


def tx_bytes(hosts: NetnsHosts, name: str) -> int:
    done = hosts.run(name, "cat", "/sys/class/net/eth0/statistics/tx_bytes")
    return int(done.stdout)


def test_blocks_read_over_nixl_across_hosts_and_a_link_cut_midway(tmp_path: Path) -> None:
    hosts = hosts_or_skip()
    processes: list[subprocess.Popen] = []
    try:
        addresses = {name: hosts.add(name, octet) for name, octet in (("p", 31), ("d", 32))}
        hosts.add("client", 99)
        workers = {}
        for name, address in addresses.items():
            process, _ = start_server_process(
                [
                    "worker", "--host", address, "--port", "50061", "--worker-id", name,
                    "--kv-cache-bytes", str(256 * BLOCK_BYTES), "--grace-s", "0",
                    "--cpu-threads", "1", "--allow-pull-blocks", "--check-integrity",
                    # NOTE: beyond loopback and open: the client calls them without credentials.
                    "--insecure",
                ],
                prefix=[*hosts.prefix_for(name), "env", "UCX_TLS=tcp"],
            )  # fmt: skip
            processes.append(process)
            workers[name] = f"{address}:50061"
        namespace = model_namespace(None)
        spec = tmp_path / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "small": SMALL,
                    "large": LARGE,
                    "small_hashes": [h.hex() for h in hash_prompt_blocks(SMALL, 16, namespace)],
                    "large_hashes": [h.hex() for h in hash_prompt_blocks(LARGE, 16, namespace)],
                    "timeout_s": PULL_TIMEOUT_S,
                }
            )
        )
        client = hosts.popen(
            "client",
            sys.executable,
            str(CLIENT),
            workers["p"],
            workers["d"],
            str(spec),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(client)

        def step(name: str) -> dict:
            line = client.stdout.readline()
            assert line, client.stderr.read()[-3000:]
            said = json.loads(line)
            assert said["step"] == name, said
            return said

        small = step("small")
        assert small["pulled"] == {
            "transport": "nixl",
            "num_transferred_blocks": 18,
            "num_cached_blocks": 18,
        }
        assert small["served"]["tokens"] == small["computed"]["tokens"]
        # The prompt ends on its 18th block: the last one is computed for its last token.
        assert small["served"]["num_cached_tokens"] == 17 * BLOCK_SIZE

        step("held")
        subprocess.run(
            [*hosts.prefix_for("p"), "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
             "rate", RATE, "burst", "32kbit", "latency", "400ms"],
            check=True,
        )  # fmt: skip
        before = tx_bytes(hosts, "p")
        client.stdin.write("go\n")
        client.stdin.flush()
        deadline = time.monotonic() + 30
        while tx_bytes(hosts, "p") - before < 128 * BLOCK_BYTES // 3:
            assert time.monotonic() < deadline, "the read never got going"
            time.sleep(0.01)
        hosts.cut("p")
        large = step("large")["pulled"]
        assert large.get("error") == "FAILED_PRECONDITION", large
        assert "NIXL read" in large["details"]
        hosts.restore("p")
        subprocess.run([*hosts.prefix_for("p"), "tc", "qdisc", "del", "dev", "eth0", "root"])
        client.stdin.write("go\n")
        client.stdin.flush()
        after = step("after")
        assert after["num_large_cached"] == 0  # nothing half-read is cached
        assert after["free"][0] == after["free"][1]  # nothing held
        assert after["served"]["tokens"] == small["computed"]["tokens"]
        assert client.wait(timeout=30) == 0
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait(timeout=30)
        hosts.close()
