"""``kvswitch bench`` (every benchmark) and ``kvswitch kernels``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvswitch.app.cli_args import (
    add_config_args,
    config_from_args,
    plain_doc,
    write_json,
)
from kvswitch.benchmarks.timing import BenchmarkUnavailable

POOL_HELP = {
    "num_blocks": "KV blocks in the pool",
    "block_size": "tokens per block",
    "num_documents": "distinct shared document prefixes",
    "document_blocks": "blocks per document prefix",
    "question_blocks": "blocks per request after its document (the last one partial)",
    "num_requests": "requests per pass over the workload",
    "num_running": "requests holding blocks at once; the oldest is freed as a new one arrives",
    "duration_s": "seconds to measure for",
    "seed": "random seed of the workload",
}

KERNEL_COMPILE_HELP = {"arch": "GPU architecture to compile for: 80 (A100) or 90 (H100, H200)"}

KERNEL_HELP = {
    "decode_batch": "paged_decode: sequences in the batch",
    "decode_context": "paged_decode: context tokens per sequence",
    "prefill_batch": "paged_prefill: sequences in the batch",
    "prefill_tokens": "paged_prefill: new tokens per sequence (causal, no cached prefix)",
    "num_q_heads": "query heads",
    "num_kv_heads": "KV heads (query heads share them in groups)",
    "head_dim": "dimension of each head",
    "block_size": "tokens per KV page",
    "store_tokens": "store_kv: tokens written per call",
    "lora_tokens": "add_lora: tokens of one call (a decode batch), each of one adapter",
    "lora_slots": "add_lora: adapters in use, the tokens spread over them in turn",
    "lora_rank": "add_lora: the adapters' rank",
    "dtype": "bfloat16, float16 or float32",
    "device": "cuda; or cpu, through Triton's interpreter (TRITON_INTERPRET=1, tiny shapes): "
    "checks the benchmark's steps, times nothing worth reading",
    "seed": "random seed of the data",
    "sweep": "also time decode and prefill under other tile sizes, warps, stages and splits",
}

SCORE_HELP = {
    "model": "Hugging Face checkpoint directory; empty = the built-in tiny model",
    "device": "cpu or cuda",
    "dtype": "float32, float16 or bfloat16",
    "num_prompt_tokens": "prompt length in tokens",
    "num_cached_tokens": "leading prompt tokens already cached in the warm case",
    "logprobs": "alternatives per prompt token scored (echo with logprobs: K)",
    "num_trials": "cold/warm pairs to take the median of",
    "seed": "random seed of the prompts",
}

TTFT_HELP = {
    "model": "Hugging Face checkpoint directory; empty = the built-in tiny model",
    "device": "cpu or cuda",
    "dtype": "float32, float16 or bfloat16",
    "num_prompt_tokens": "prompt length in tokens",
    "num_cached_tokens": "leading prompt tokens already cached in the warm case",
    "num_trials": "cold/warm pairs to take the median of",
    "profile": "also profile one warm and one cold request with torch's profiler: host time, "
    "device time, torch ops",
    "cuda_graphs": "GPU: steps replayed from CUDA graphs (the worker's --cuda-graphs, on by "
    "default with --device cuda; --no-cuda-graphs for the plain path): a warm prompt's tail runs "
    "all but attention from graphs",
    "cache_hidden_states": "the worker's --cache-hidden-states: every step also keeps its final "
    "hidden states (what that costs a request that asks for none)",
    "offload_gb": "the worker's --offload-gb: the cached prefix is also measured loaded back from "
    "the host tier (the device cache then holds two prompts, and two more evict it), with the "
    "load's GB/s beside this machine's plain copy",
    "seed": "random seed of the prompts",
}

DECODE_HELP = {
    "model": TTFT_HELP["model"],
    "device": TTFT_HELP["device"],
    "dtype": TTFT_HELP["dtype"],
    "batch_sizes": "comma-separated batch sizes to measure",
    "num_prompt_tokens": "prompt length of every request",
    "num_output_tokens": "tokens each request decodes",
    "cuda_graphs": TTFT_HELP["cuda_graphs"],
    "loras": "also run each batch spread over this many LoRA adapters of random weights (every "
    "module), and report their tokens/s beside the base alone's (loras_vs_base_batch_N) and "
    "how long an adapter takes to load; 0 = the base alone",
    "lora_rank": "the adapters' rank",
    "cache_hidden_states": TTFT_HELP["cache_hidden_states"],
    "seed": "random seed of the prompts",
}

INDEX_HELP = {
    "backend": "memory (embedded), redis (starts a local redis-server) or redis-cluster (3 local "
    "nodes; 'cluster' is the same)",
    "num_workers": "workers holding overlapping prefixes of the prompt",
    "num_prompt_tokens": "prompt length in tokens (its chain is what every lookup matches)",
    "block_size": "tokens per block",
    "num_other_blocks": "unrelated blocks the workers also hold, over the whole fleet",
    "resync_blocks": "if > 0, one more worker holding this many blocks resyncs as many (half "
    "new) while lookups are timed (lookup_p99_during_resync_ms)",
    "heartbeat_s": "seconds between each worker's heartbeats while lookups are timed",
    "ttl_s": "a worker whose heartbeat is this late lapses (counted in workers_dropped)",
    "num_lookups": "match calls timed",
    "num_event_batches": "event batches applied to time ingestion (128 block events each)",
    "seed": "random seed",
}

RELAY_HELP = {
    "routers": "router processes to measure with, comma-separated (a run for each count)",
    "num_workers": "stub workers (no model: they stream tokens as fast as they are read)",
    "concurrency": "streams open at once, over every client process",
    "num_clients": "client processes",
    "num_output_tokens": "tokens each request streams",
    "tokens_per_message": "tokens a stub sends in one streamed message",
    "step_ms": "0: stubs stream as fast as they are read; above 0: every stream gets one token a "
    "step of this many ms, and a stub sends what its reader has not taken yet in one message, "
    "as a worker does",
    "duration_s": "seconds each window measures",
    "api": "what the clients call the routers by: grpc (the Router service, as the SDK) or http "
    "(the OpenAI-compatible API's streamed completions)",
}

ROUTERS_HELP = {
    "routers": "which to measure, comma-separated: kvswitch-engines (engine mode, HTTP), "
    "kvswitch-http and kvswitch-grpc (before kvswitch workers), sglang-router, vllm-router",
    "num_engines": "stub engines behind each router",
    "num_requests": "non-streamed completions per router, one after another",
    "prompt_chars": "characters of each non-streamed completion's prompt",
    "num_output_tokens": "tokens each non-streamed completion answers with",
    "stream_tokens": "tokens of each streamed completion (one event a token)",
    "concurrency": "streams open at once while the router's CPU is measured",
    "duration_s": "seconds of streaming per router",
    "step_ms": "paced streams (HTTP routers): an event every step_ms, each stamped by the stub, "
    "read by concurrency clients for duration_s; 0: none",
    "paced_tokens": "tokens of each paced stream",
    "sglang_router": "the sglang-router executable (pip install sglang-router==0.3.2)",
    "vllm_router": "the vllm-router executable (pip install vllm-router==0.1.17)",
}

POLLS_HELP = {
    "kind": "engines (OpenAI-API engines: /health and a vLLM-sized /metrics page a poll) or "
    "workers (kvswitch workers: a GetLoad call a poll)",
    "num_engines": "stub engines or workers the router follows (one process serves them all)",
    "load_poll_s": "how often the router asks each engine for its load (its --load-poll-s)",
    "duration_s": "seconds measured, once every engine has been polled",
}

HOPS_HELP = {
    "transports": "comma-separated, of tcp (a plain asyncio stream), grpc-stream (a grpc.aio "
    "server stream) and grpc-bidi (a grpc.aio bidirectional stream)",
    "num_streams": "streams read at once, each with a message every step_ms",
    "num_messages": "messages a stream (the first 10 left out)",
    "step_ms": "milliseconds between a stream's messages",
}

ROUTER_BENCH_HELP = {
    "num_prompt_tokens": "prompt length in tokens, sent as token ids",
    "block_size": "tokens per block",
    "num_workers": "stub workers, each holding a different-length prefix of the prompt",
    "num_pairs": "direct/routed request pairs timed for the overhead",
    "concurrency": "client threads sending requests for the decisions-per-second figure",
    "duration_s": "seconds to measure decisions per second for",
    "seed": "random seed of the prompt",
}

SERVE_HELP = {
    "model": "Hugging Face checkpoint directory or random:NAME; empty = the built-in tiny model",
    "device": "cpu or cuda (on cpu both sides take the torch references: no kernel is checked)",
    "dtype": TTFT_HELP["dtype"],
    "workers": "workers in the local cluster",
    "num_prompts": "distinct prompts, each sent twice (cold, then cached)",
    "num_prompt_tokens": "prompt length in tokens, sent as token ids",
    "num_shared_tokens": "leading tokens every prompt shares",
    "max_tokens": "greedy tokens generated per request",
    "kv_cache_bytes": "KV cache memory per worker, in bytes",
    "max_logit_gap": "most a served token's reference logit may sit below the reference's best; "
    "< 0 = 1e-3 for float32, 0.25 (eight bf16 steps at a logit of 4) for 16-bit dtypes",
    "cuda_graphs": "the workers' --cuda-graphs (on by default with --device cuda; "
    "--no-cuda-graphs checks the plain path)",
    "seed": "random seed of the prompts",
}

HASH_HELP = {
    "num_tokens": "prompt length in tokens",
    "block_size": "tokens per block",
    "duration_s": "seconds to measure each input kind for",
    "seed": "random seed of the prompt",
}

LOOKUP_HELP = {
    "num_guesses": "live pending guesses, all on one document",
    "document_blocks": "blocks of that document",
    "num_workers": "workers (guesses are spread over them; each holds the whole prefix)",
    "prefix_blocks": "blocks of the prefix every worker holds in the embedded index",
    "prompt_tokens": "tokens of the text prompt whose tokenizing may stall the loop",
    "repeats": "timed runs per figure (the median is reported)",
    "seed": "random seed",
}

ADMISSION_HELP = {
    "num_decodes": "requests decoding when the long prompt arrives",
    "prompt_len": "tokens in the long prompt",
    "steps_before": "engine steps measured before it arrives",
    "steps_after": "engine steps measured after it arrives (then it is aborted)",
    "seed": "random seed of the prompts",
    "cpu_threads": "the engine core's torch threads (as kvswitch worker --cpu-threads); 0 = one "
    "per core",
}

STEP_HELP = {
    "model": "checkpoint directory; empty = the built-in tiny model",
    "device": "torch device: cpu or cuda",
    "dtype": "float32, float16 or bfloat16",
    "num_seqs": "requests decoding together",
    "context_len": "tokens of context each request decodes at",
    "num_steps": "timed steps (the median is reported)",
    "cuda_graphs": "GPU: decode steps replayed from CUDA graphs (the worker's --cuda-graphs, "
    "on by default with --device cuda); the replay is then the forward taken out",
    "parts": "also time each part of the host work on its own (parts_ms)",
    "seed": "random seed of the prompts",
}

TRANSFER_HELP = {
    "num_prompts": "prompts the holder computes; the taker pulls each one's blocks in one call "
    "(with --transport nixl: reads timed per prompt length)",
    "prompt_tokens": "tokens per prompt (16 a block)",
    "seed": "random seed of the prompts",
    "transport": "nixl: read blocks from a holder process over NIXL (kvswitch[nixl]); empty: "
    "workers pull over grpc, shm and mapped",
    "nixl_prompt_tokens": "--transport nixl: comma-separated prompt lengths in tokens",
    "nixl_kv_layout": "--transport nixl: the KV cache's LAYERSxKV_HEADSxHEAD_DIM:DTYPE (the "
    "default is Llama 3.2 1B's, 32 KiB a token)",
    "across_hosts": "--transport nixl: the holder on a host of its own (a network namespace "
    "wired to this one through a bridge; root), UCX over TCP, as between two machines",
}

HOLDER_HELP = {
    "transports": "comma-separated: the phases after the first (streams alone), each with pulls "
    "over one of grpc, shm, mapped, nixl",
    "num_streams": "decode streams on the holder, each sending short prompts one after another",
    "output_tokens": "tokens each of the streams' requests generates",
    "num_prompts": "prompts the holder computes and the other worker pulls, round and round",
    "prompt_tokens": "tokens per pulled prompt (16 a block, 32 KiB each)",
    "duration_s": "seconds of each phase",
    "seed": "random seed of the prompts",
}

ENGINES_HELP = {
    "num_engines": "CPU workers in each fleet: OpenAI-API engines behind a router in engine "
    "mode, then the same as gRPC workers",
    "kv_cache_blocks": "KV cache blocks per worker (16 tokens each)",
    "documents": "long_document_qa: documents asked about",
    "document_len": "tokens per document",
    "questions": "questions per document",
    "concurrency": "sessions at a time (a closed loop)",
    "policies": "routing policies, one phase each, comma-separated",
}

PD_HELP = {
    "num_workers": "workers per cluster: all of role both, then one prefill worker and the rest "
    "decode workers",
    "num_streams": "decode streams, each sending short prompts with long answers one after another",
    "short_prompt_tokens": "tokens in a decode stream's prompts",
    "short_output_tokens": "tokens a decode stream's requests generate",
    "long_prompt_tokens": "tokens in each long prompt",
    "long_output_tokens": "tokens each long prompt generates",
    "long_per_s": "long prompts arriving a second (Poisson)",
    "duration_s": "seconds of load per cluster",
    "kv_cache_bytes": "KV cache memory per worker, in bytes",
    "kv_transport": "how the disaggregated cluster moves KV blocks: auto, nixl, mapped, shm or "
    "grpc (the router's --kv-transport)",
    "seed": "random seed of the prompts and arrivals",
}

OVERLOAD_HELP = {
    "num_workers": "CPU workers in the fleet",
    "max_num_seqs": "requests each worker runs at once",
    "max_waiting_requests": "requests each worker queues beyond those; past them it refuses",
    "prompt_tokens": "random prompt length of every request, in tokens",
    "output_tokens": "tokens each request generates",
    "duration_s": "seconds of each phase (capacity, then overload)",
    "overload": "arrival rate of the overload phase, as a multiple of the measured capacity",
    "seed": "random seed of the prompts and arrivals",
}

ROUTING_STUDY_HELP = {
    "fleet_sizes": "comma-separated worker counts, each with a generated trace of its own",
    "num_requests": "requests in each generated trace",
    "trace": "also replay this trace (Mooncake format); empty = none",
    "trace_workers": "workers that replay --trace",
    "capacity_fraction": "the fleet's caches together hold this fraction of a trace's distinct "
    "blocks",
    "target_utilization": "arrivals scaled so that round_robin keeps workers this busy",
    "profile": "worker step costs: gpu or cpu (docs/SIMULATOR.md)",
    "cost_weights": "the cost policy's weights, 'key=value,...'; empty = its defaults",
    "hit_goal": "goal: token hit rate at least this fraction of the global cache's",
    "imbalance_goal": "goal: load imbalance at most this",
    "ttft_goal": "goal: mean TTFT at least this many times lower than round_robin's",
    "plots": "folder for one PNG per fleet (hits against balance, TTFT); empty = none",
}

HTTP_BENCH_HELP = {
    "num_requests": "requests per API and kind (one token, whole, streamed), alternating APIs",
    "num_output_tokens": "tokens a whole or streamed request generates",
    "prompt_words": "words in each prompt (a new prompt per pair of requests)",
}

STARTUP_HELP = {
    "num_runs": "fresh processes per command; the median is reported; 0 = none",
    "repeat": "worker starts timed (a router, then a tiny-model CPU worker), and as many "
    "restarts; 0 = none",
    "restart": "also kill a worker under kvswitch up's supervisor and time until it serves again",
}


def _bench_command(run: Callable[[Any], dict[str, Any]], config_cls: type) -> Callable:
    def command(args: argparse.Namespace) -> None:
        config = config_from_args(config_cls, args)
        result = run(config)
        write_json(result, args.json)
        if result.get("ok") is False:  # a benchmark that also checks, and found a difference
            sys.exit(1)

    return command


def _kernels_compile_command(args: argparse.Namespace) -> None:
    from kvswitch.kernels import aot

    config = config_from_args(aot.CompileReportConfig, args)
    try:
        compiled = aot.compile_report(config, progress=lambda line: print(line, file=sys.stderr))
    except aot.CompileUnavailable as e:
        raise BenchmarkUnavailable(str(e)) from e
    print(aot.format_report(compiled))
    if args.json is not None:
        args.json.write_text(json.dumps([c.to_json() for c in compiled], indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


def add_kernels(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.kernels import aot

    kernels_parser = commands.add_parser(
        name, help=summary, description="Tools for the paged-attention kernels."
    )
    kernel_tools = kernels_parser.add_subparsers(
        dest="kernel_tool", metavar="TOOL", required=True, help="what to do"
    )
    compile_parser = kernel_tools.add_parser(
        "compile",
        help="compile every kernel for a GPU architecture (no GPU needed): registers, spills, "
        "shared memory, load widths",
        description=plain_doc(aot.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(compile_parser, aot.CompileReportConfig, KERNEL_COMPILE_HELP)
    compile_parser.add_argument(
        "--json", type=Path, metavar="OUT", help="also write the report here"
    )
    compile_parser.set_defaults(func=_kernels_compile_command)


def add_bench(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.benchmarks import admission as admission_bench
    from kvswitch.benchmarks import engine as engine_bench
    from kvswitch.benchmarks import engine_polls as polls_bench
    from kvswitch.benchmarks import engines as engines_bench
    from kvswitch.benchmarks import hashing as hash_bench
    from kvswitch.benchmarks import holder as holder_bench
    from kvswitch.benchmarks import hops as hops_bench
    from kvswitch.benchmarks import http_front as http_bench
    from kvswitch.benchmarks import index as index_bench
    from kvswitch.benchmarks import kernels as kernel_bench
    from kvswitch.benchmarks import lookup as lookup_bench
    from kvswitch.benchmarks import overload as overload_bench
    from kvswitch.benchmarks import pd as pd_bench
    from kvswitch.benchmarks import pool as pool_bench
    from kvswitch.benchmarks import relay as relay_bench
    from kvswitch.benchmarks import router as router_bench
    from kvswitch.benchmarks import routers as routers_bench
    from kvswitch.benchmarks import scoring as score_bench
    from kvswitch.benchmarks import serve as serve_bench
    from kvswitch.benchmarks import startup as startup_bench
    from kvswitch.benchmarks import step as step_bench
    from kvswitch.benchmarks import transfer as transfer_bench
    from kvswitch.loadtest import study as routing_study

    bench = commands.add_parser(
        name,
        help=summary,
        description="Benchmarks. Each prints its figures as JSON (progress goes to stderr).",
    )
    benches = bench.add_subparsers(
        dest="bench", metavar="BENCH", required=True, help="what to measure"
    )
    for bench_name, run, config_cls, helps, bench_summary in [
        (
            "pool",
            pool_bench.run,
            pool_bench.PoolBenchConfig,
            POOL_HELP,
            "block operations per second of the block pool and KV cache manager",
        ),
        (
            "kernels",
            kernel_bench.run,
            kernel_bench.KernelBenchConfig,
            KERNEL_HELP,
            "paged-attention kernels on a CUDA GPU: bandwidth, TFLOP/s against SDPA",
        ),
        (
            "ttft",
            engine_bench.run_ttft,
            engine_bench.TTFTBenchConfig,
            TTFT_HELP,
            "worker time to first token, prompt mostly cached against cold",
        ),
        (
            "score",
            score_bench.run,
            score_bench.ScoreBenchConfig,
            SCORE_HELP,
            "worker prompt scoring and embeddings, prompt mostly cached against cold",
        ),
        (
            "decode",
            engine_bench.run_decode,
            engine_bench.DecodeBenchConfig,
            DECODE_HELP,
            "worker decode tokens per second at several batch sizes",
        ),
        (
            "index",
            index_bench.run,
            index_bench.IndexBenchConfig,
            INDEX_HELP,
            "block-hash index: lookup latency, event ingestion, bytes per entry",
        ),
        (
            "router",
            router_bench.run,
            router_bench.RouterBenchConfig,
            ROUTER_BENCH_HELP,
            "router overhead against going straight to a worker, and decisions per second",
        ),
        (
            "relay",
            relay_bench.run,
            relay_bench.RelayBenchConfig,
            RELAY_HELP,
            "streamed tokens a router relays a second, per core of its own, against direct",
        ),
        (
            "routers",
            routers_bench.run,
            routers_bench.RoutersBenchConfig,
            ROUTERS_HELP,
            "kvswitch's router beside sglang-router and vllm-router, before the same stub "
            "engines: added latency, CPU per relayed token",
        ),
        (
            "polls",
            polls_bench.run,
            polls_bench.PollsBenchConfig,
            POLLS_HELP,
            "what following a fleet of engines or workers costs a router at rest: its CPU on "
            "their load polls",
        ),
        (
            "hops",
            hops_bench.run,
            hops_bench.HopsBenchConfig,
            HOPS_HELP,
            "the floor under a router's added latency: a message's delay across one process "
            "hop, over TCP and gRPC",
        ),
        (
            "lookup",
            lookup_bench.run,
            lookup_bench.LookupBenchConfig,
            LOOKUP_HELP,
            "a router's per-request loop work at scale: pending guesses, embedded index, "
            "tokenizing",
        ),
        (
            "serve",
            serve_bench.run,
            serve_bench.ServeBenchConfig,
            SERVE_HELP,
            "a local cluster's greedy output against the torch reference path, cold and cached",
        ),
        (
            "step",
            step_bench.run,
            step_bench.StepBenchConfig,
            STEP_HELP,
            "host time of one engine step (all but the forward): N decodes at a long context",
        ),
        (
            "admission",
            admission_bench.run,
            admission_bench.AdmissionBenchConfig,
            ADMISSION_HELP,
            "what a 128K-token prompt's arrival costs the requests decoding on a worker",
        ),
        (
            "transfer",
            transfer_bench.run,
            transfer_bench.TransferBenchConfig,
            TRANSFER_HELP,
            "cached KV blocks pulled from one worker process into another, GB/s over gRPC and "
            "through shared memory, or read over NIXL (--transport nixl)",
        ),
        (
            "holder",
            holder_bench.run,
            holder_bench.HolderBenchConfig,
            HOLDER_HELP,
            "what serving pulls of its cached KV costs a worker's own decodes, per transport: "
            "their ITL while another worker pulls",
        ),
        (
            "pd",
            pd_bench.run,
            pd_bench.PDBenchConfig,
            PD_HELP,
            "disaggregated prefill against one-worker serving: decode ITL and TTFT while long "
            "prompts arrive",
        ),
        (
            "overload",
            overload_bench.run,
            overload_bench.OverloadBenchConfig,
            OVERLOAD_HELP,
            "a fleet at ten times its capacity: what it refuses, how fast, and the latency of "
            "what it admits",
        ),
        (
            "routing",
            routing_study.run,
            routing_study.RoutingStudyConfig,
            ROUTING_STUDY_HELP,
            "every routing policy on the fleet simulator at several fleet sizes, against goals",
        ),
        (
            "http",
            http_bench.run,
            http_bench.HttpBenchConfig,
            HTTP_BENCH_HELP,
            "the router's OpenAI-compatible HTTP API against its gRPC API: latency of the same "
            "requests through each",
        ),
        (
            "engines",
            engines_bench.run,
            engines_bench.EnginesBenchConfig,
            ENGINES_HELP,
            "a fleet of OpenAI-API engines routed by their KV events against the same fleet as "
            "gRPC workers: cache hit rate and TTFT per policy",
        ),
        (
            "startup",
            startup_bench.run,
            startup_bench.StartupBenchConfig,
            STARTUP_HELP,
            "how long each kvswitch command takes to start, and a worker until the router routes "
            "to it (fresh, and restarted after a kill)",
        ),
        (
            "hash",
            hash_bench.run,
            hash_bench.HashBenchConfig,
            HASH_HELP,
            "tokens per second of block hashing on one long prompt",
        ),
    ]:
        sub = benches.add_parser(
            bench_name,
            help=bench_summary,
            description=plain_doc(sys.modules[run.__module__].__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_config_args(sub, config_cls, helps)
        sub.add_argument("--json", type=Path, metavar="OUT", help="also write the figures here")
        sub.set_defaults(func=_bench_command(run, config_cls))
