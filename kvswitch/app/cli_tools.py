"""The commands that talk to a fleet or a trace: ``kvswitch generate``, ``health``, ``index``,
``loadtest`` and ``sim``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvswitch.app.cli_args import (
    add_config_args,
    add_report_command,
    config_from_args,
    exit_with,
    plain_doc,
    tokens_from_env,
    write_json,
)
from kvswitch.app.cli_servers import SECURITY_HELP

INDEX_TOOL_HELP = {
    "index": "the index: redis://HOST:PORT, rediss://... (TLS), redis+cluster://HOST:PORT, or "
    "grpc://ROUTER_HOST:PORT for a router's embedded index",
    "prefix": "key prefix of the deployment (several may share one Redis)",
    **SECURITY_HELP,
}

HEALTH_HELP = {
    "target": "the router or worker, HOST:PORT",
    "service": "the service to ask about: kvswitch.v1.Router, kvswitch.v1.Worker, or empty = "
    "the server as a whole",
    "timeout_s": "seconds to wait for the answer",
    "tls_ca": "a server with TLS: PEM CA bundle that verifies it",
    "tls_cert": "a server with mutual TLS: PEM certificate this probe presents",
    "tls_key": "PEM private key of --tls-cert",
}

SIM_HELP = {
    "trace": "JSON-lines trace to replay (Mooncake format: timestamp ms, input_length, "
    "output_length, hash_ids), or one made up: generated:SHAPE,key=value,... with SHAPE chat "
    "or docs and keys of TraceShape (e.g. generated:chat,num_requests=200); see "
    "docs/SIMULATOR.md",
    "workers": "simulated workers",
    "capacity_blocks": "KV cache blocks per worker, or auto: the fleet holds half the trace's "
    "distinct blocks (at least the largest request's blocks a worker)",
    "block_tokens": "tokens per block: one hash id of the trace names one block",
    "policy": "routing policy to replay: the router's own (cost, prefix, least_loaded, "
    "round_robin, random), another router's rule for comparison (sglang_like, dynamo_like, "
    "llmd_like), or all",
    "rate_scale": "arrivals come this many times as fast as in the trace",
    "target_utilization": "find the rate scale at which round_robin keeps the workers this busy "
    "on average (in (0, 1)), and replay every policy at it; 0 = use --rate-scale",
    "profile": "what a worker's steps cost: gpu (an estimate for an 8B model on an H100) or cpu "
    "(the built-in model, measured); see docs/SIMULATOR.md",
    "load_poll_s": "seconds between the load reports the router polls from each worker; 0 = "
    "the router sees each worker's load as it is",
    "router_replicas": "router replicas: request i is routed by replica i mod this many, each "
    "with its own guesses, heat and tie rotation (docs/SIMULATOR.md)",
    "replica_delay_ms": "router replicas hear each other's routes this late (the replica channel's "
    "delivery time); below 0: never (replicas that share nothing but the index and the workers' "
    "in-flight counts)",
    "pending_ttl_s": "seconds a routed prompt counts as cached on its worker before the index "
    "confirms it",
    "cost_weights": "the cost policy's weights, 'key=value,...' (prefill_weight, decode_weight, "
    "min_match, private_weight, temperature, fetch_token_cost, fetch_latency_tokens, "
    "lora_load_tokens, lora_loaded_weight, lora_free_slot_weight); empty = "
    "its defaults",
    "fetch_tokens_per_s": "peer block fetch: tokens of KV moved a second between two workers; "
    "the cost policy weighs moving a cached prefix against computing it at the profile's "
    "prefill speed; 0 = no peer fetch",
    "fetch_latency_s": "peer block fetch: what one transfer costs besides its bytes, in seconds",
    "max_loras": "LoRA adapter slots per worker, for a trace whose requests name adapters "
    "(generated:...,num_loras=N)",
    "lora_load_s": "what putting a LoRA adapter in a worker's slot adds to its step, in seconds",
    "offload_capacity_blocks": "a host tier of this many KV blocks under each worker's cache (the "
    "worker's --offload-gb): blocks evicted there, loaded back instead of computed; 0 = none",
    "reload_tokens_per_s": "tokens of KV a second a worker loads back from its host tier (the "
    "load adds to the step its request joins)",
    "cpu_block_weight": "what the router counts a matched block only a worker's host tier holds "
    "for (the router's --cpu-block-weight)",
    "seed": "random seed of the policies that sample",
}

LOADTEST_HELP = {
    "target": "the router, HOST:PORT; several routers of one fleet comma-separated (session i "
    "goes through router i mod their number); http://HOST:PORT: its OpenAI-compatible HTTP "
    "API instead, as a fleet of OpenAI-API engines is reached (docs/ENGINES.md)",
    "model": "HTTP targets: the model name requests give; empty = the first the target's "
    "/v1/models lists",
    "workload": "shared_prefix, long_document_qa, multi_turn_chat, no_sharing, scoring (each "
    "prompt scored: its logprobs) or trace",
    "workload_args": "the workload's parameters over its defaults, 'key=value,...' (e.g. "
    "'groups=4,users=8' or 'path=trace.jsonl,block_len=16'); a wrong key lists the known ones",
    "policies": "routing policies the router offers (cost, prefix, least_loaded, round_robin, "
    "random) to run the workload under, one phase each, comma-separated; 'all', or 'default' "
    "for the router's own default",
    "rate": "sessions started per second (open loop); inf = all at once; a trace replays at its "
    "own times unless a rate is given",
    "burstiness": "gamma shape of the gaps between arrivals: 1 = Poisson, < 1 burstier",
    "concurrency": "> 0: a closed loop of this many sessions at a time instead of --rate",
    "warmup": "sessions at the start of each phase left out of the figures",
    "max_requests": "requests per phase at most; 0 = every turn of every session",
    "duration_s": "seconds per phase after which no new request is sent; inf = no bound",
    "timeout_s": "deadline of each request in seconds",
    "vocab_size": "prompts are token ids drawn from [0, VOCAB_SIZE): the served model's "
    "vocabulary (256 for the built-in model)",
    "num_workers": "the fleet's size, so that workers that got no request count in the "
    "imbalance; 0 = the workers seen",
    "slo_ttft_ms": "goodput: time to first token at most this (ms); 0 = not checked",
    "slo_tpot_ms": "goodput: time per output token at most this (ms); 0 = not checked",
    "slo_e2el_ms": "goodput: end-to-end latency at most this (ms); 0 = not checked",
    "seed": "random seed of the prompts and arrivals",
    "plots": "folder to write ttft_cdf.png, hit_rate.png and worker_load.png into; empty = none",
    "progress": "show a progress bar on stderr",
}

GENERATE_HELP = {
    "target": "the router, HOST:PORT",
    "prompt": "the prompt text",
    "prompt_file": "read the prompt text from this file; - reads stdin",
    "prompt_token_ids": "the prompt as comma-separated token ids (1,2,3), sent untokenized",
    "max_tokens": "most tokens to generate",
    "stop_token_ids": "comma-separated token ids that end generation besides the model's EOS",
    "lora": "LoRA adapter to apply; empty = the base model",
    "temperature": "sampling temperature; 0 = greedy",
    "top_p": "nucleus sampling mass in (0, 1]",
    "seed": "sampling seed; -1 = none",
    "policy": "routing policy for this request; empty = the router's default",
    "cache_salt": "isolates prefix-cache reuse (e.g. per tenant); empty = none",
    "token": "bearer token, if the router requires one; or set KVSWITCH_TOKEN",
    "timeout_s": "deadline in seconds; 0 = none",
    "tls_ca": "a router that listens with TLS: PEM CA bundle that verifies it",
}


def _index_command(report: Callable) -> Callable:
    def command(args: argparse.Namespace) -> None:
        import asyncio

        from kvswitch.cache_index.audit import IndexToolConfig

        config = config_from_args(IndexToolConfig, tokens_from_env(args))
        try:
            result = asyncio.run(report(config))
        except (ValueError, ConnectionError) as e:
            sys.exit(f"kvswitch index {args.index_tool}: {e}")
        write_json(result, None)

    return command


def _add_exit_status_command(
    commands: argparse._SubParsersAction, name: str, summary: str, module, config_cls, helps
) -> None:
    """A command whose ``module.run(config)`` returns the process's exit status."""
    sub = commands.add_parser(
        name,
        help=summary,
        description=plain_doc(module.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, config_cls, helps)
    sub.set_defaults(
        func=lambda args: exit_with(module.run(config_from_args(config_cls, tokens_from_env(args))))
    )


def add_generate(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.app import generate

    _add_exit_status_command(
        commands, name, summary, generate, generate.GenerateConfig, GENERATE_HELP
    )


def add_health(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.app import health

    _add_exit_status_command(commands, name, summary, health, health.HealthConfig, HEALTH_HELP)


def add_index(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.cache_index import audit as index_audit

    index_parser = commands.add_parser(
        name, help=summary, description="Tools for the global block-hash index. Each prints JSON."
    )
    index_tools = index_parser.add_subparsers(
        dest="index_tool", metavar="TOOL", required=True, help="what to do"
    )
    for tool, report, tool_summary in [
        ("stats", index_audit.stats_report, "live workers, entries and memory of the index"),
        (
            "audit",
            index_audit.audit_report,
            "compare the index with every live worker's own snapshot: stale and missing entries",
        ),
    ]:
        sub = index_tools.add_parser(
            tool,
            help=tool_summary,
            description=plain_doc(index_audit.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_config_args(sub, index_audit.IndexToolConfig, INDEX_TOOL_HELP)
        sub.set_defaults(func=_index_command(report))


def add_sim(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.loadtest import sim, sim_report

    description = plain_doc(sim_report.__doc__) + "\n" + plain_doc(sim.__doc__)
    add_report_command(
        commands, name, summary, description, sim.SimConfig, SIM_HELP, sim_report.run
    )

    def capacity_blocks(text: str) -> int:
        if text == "auto":
            return 0  # SimConfig's "derive it from the trace"
        if not text.strip().isdecimal() or int(text) < 1:
            raise argparse.ArgumentTypeError(
                f"must be a number of KV blocks >= 1, or auto (derived from the trace), "
                f"got {text!r}"
            )
        return int(text)

    # NOTE: left out (or auto), the capacity is derived from the trace; a number given must be
    # one a worker can hold something in, so 0 is refused here although SimConfig reads it as
    # "derive".
    option = commands.choices[name]._option_string_actions["--capacity-blocks"]
    option.type, option.default = capacity_blocks, "auto"


def add_loadtest(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.loadtest import live, workloads
    from kvswitch.loadtest.report_table import report_table

    description = plain_doc(live.__doc__) + "\n" + plain_doc(workloads.__doc__)
    add_report_command(
        commands,
        name,
        summary,
        description,
        live.LoadTestConfig,
        LOADTEST_HELP,
        live.run,
        table=report_table,
    )
