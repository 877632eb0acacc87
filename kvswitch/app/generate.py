"""``kvswitch generate``: send one prompt to a router and print the output as it streams.

The generated text goes to stdout; where the request went and what it cost (worker, cached
prompt tokens, time to first token, the routing reason) goes to stderr.
"""

from __future__ import annotations

import dataclasses
import sys

from kvswitch.app.cli_args import with_flags
from kvswitch.client import Client, KvswitchError


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    target: str = "127.0.0.1:50051"
    prompt: str = ""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = -1  # -1 = none
    policy: str = ""
    cache_salt: str = ""
    token: str = ""
    timeout_s: float = 0.0  # 0 = no deadline
    tls_ca: str = ""  # a router that listens with TLS: the CA bundle that verifies it

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("give a prompt with --prompt TEXT")
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {self.timeout_s}")


def run(config: GenerateConfig) -> int:
    with Client(
        config.target,
        token=config.token or None,
        tls=config.tls_ca or None,
        timeout_s=config.timeout_s or None,
    ) as c:
        try:
            stream = c.stream(
                config.prompt,
                max_tokens=config.max_tokens,
                temperature=config.temperature,
                top_p=config.top_p,
                seed=None if config.seed < 0 else config.seed,
                cache_salt=config.cache_salt or None,
                policy=config.policy or None,
            )
            for chunk in stream:
                print(chunk.text, end="", flush=True)
            result = stream.result
        except KvswitchError as e:
            print(f"\nkvswitch generate: {e}", file=sys.stderr)
            return 1
        except ValueError as e:  # an option the client refused; nothing was sent
            fields = [f.name for f in dataclasses.fields(config)]
            print(f"kvswitch generate: {with_flags(str(e), fields)}", file=sys.stderr)
            return 1
    print()
    stats = result.stats
    print(
        f"[{result.finish_reason.value}] worker {stats.worker_id}: {stats.num_prompt_tokens} "
        f"prompt tokens ({stats.num_cached_tokens} cached), {stats.num_output_tokens} output "
        f"tokens, ttft {stats.ttft_s * 1000:.1f} ms; {result.route.policy}: {result.route.reason}",
        file=sys.stderr,
    )
    return 0
