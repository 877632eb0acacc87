"""``kvswitch generate``: send one prompt to a router and print the output as it streams.

The prompt is text (``--prompt``), a file of text (``--prompt-file``; ``-`` reads stdin) or
token ids (``--prompt-token-ids 1,2,3``). The generated text goes to stdout; where the request
went and what it cost (worker, cached prompt tokens, time to first token, the routing reason)
goes to stderr (with, for a prompt prefilled on another worker, that worker and the number of KV
blocks moved).
"""

from __future__ import annotations

import dataclasses
import sys

from kvswitch.app.cli_args import with_flags
from kvswitch.client import Client, KvswitchError, Stats


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    target: str = "127.0.0.1:50051"
    prompt: str = ""
    prompt_file: str = ""  # the prompt text from this file; "-" = stdin
    prompt_token_ids: str = ""  # comma-separated token ids
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = -1  # -1 = none
    stop_token_ids: str = ""  # comma-separated token ids
    lora: str = ""
    policy: str = ""
    cache_salt: str = ""
    token: str = ""
    timeout_s: float = 0.0  # 0 = no deadline
    tls_ca: str = ""  # a router that listens with TLS: the CA bundle that verifies it

    def __post_init__(self) -> None:
        num_prompts = sum(map(bool, (self.prompt, self.prompt_file, self.prompt_token_ids)))
        if num_prompts != 1:
            raise ValueError(
                "give the prompt once: prompt TEXT, prompt_file PATH (- for stdin) or "
                "prompt_token_ids 1,2,3"
            )
        self.token_ids("prompt_token_ids")
        self.token_ids("stop_token_ids")
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {self.timeout_s}")

    def token_ids(self, field: str) -> list[int]:
        """The comma-separated ids of ``field``; ValueError naming it if one is no integer."""
        text = getattr(self, field)
        try:
            return [int(part) for part in text.split(",")] if text else []
        except ValueError:
            raise ValueError(
                f"{field} must be comma-separated integers (1,2,3), got {text!r}"
            ) from None

    def prompt_text(self) -> str | None:
        """The text prompt, read from ``prompt_file`` if that names it; None for token ids.
        OSError or ValueError saying what could not be read."""
        if not self.prompt_file:
            return self.prompt or None
        try:
            if self.prompt_file == "-":
                return sys.stdin.buffer.read().decode("utf-8")
            with open(self.prompt_file, "rb") as f:
                return f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"prompt_file {self.prompt_file}: not UTF-8 text (byte {e.start})"
            ) from None
        except OSError as e:
            raise ValueError(f"prompt_file {self.prompt_file}: {e.strerror}") from None


def run(config: GenerateConfig) -> int:
    with Client(
        config.target,
        token=config.token or None,
        tls=config.tls_ca or None,
        timeout_s=config.timeout_s or None,
    ) as c:
        try:
            stream = c.stream(
                config.prompt_text(),
                prompt_token_ids=config.token_ids("prompt_token_ids") or None,
                stop_token_ids=config.token_ids("stop_token_ids"),
                lora=config.lora or None,
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
        f"[{result.finish_reason.value}] {_served_by(stats)}: {stats.num_prompt_tokens} "
        f"prompt tokens ({stats.num_cached_tokens} cached), {stats.num_output_tokens} output "
        f"tokens, ttft {stats.ttft_s * 1000:.1f} ms; {result.route.policy}: {result.route.reason}",
        file=sys.stderr,
    )
    return 0


def _served_by(stats: Stats) -> str:
    """The worker that served the request; where another prefilled its prompt, that one too,
    and how many KV blocks moved to the first (also when they came from a peer's cache)."""
    served_by = f"worker {stats.worker_id}"
    moved = f"{stats.num_transferred_blocks} KV blocks moved"
    if stats.prefill_worker_id != stats.worker_id:
        return f"{served_by} (prefill on {stats.prefill_worker_id}, {moved})"
    if stats.num_transferred_blocks:
        return f"{served_by} ({moved})"
    return served_by
