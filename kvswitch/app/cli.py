"""The ``kvswitch`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvswitch import __version__
from kvswitch.app.cli_args import ConfigError, add_config_args, config_from_args, with_flags
from kvswitch.benchmarks.timing import BenchmarkUnavailable
from kvswitch.logs import configure_logging, log_format_from_env, log_level_from_env

DESCRIPTION = """\
kvswitch routes LLM requests to the GPU worker that already holds the KV cache of their prompt.

A prompt is cut into blocks of tokens; each block is named by a hash chained over everything
before it, so two prompts with the same prefix share block names. Workers cache computed blocks
and report them to a global block-hash index; the router sends each request where the longest
prefix of its prompt is already cached, weighing load.
"""

EPILOG = """\
examples:
  kvswitch demo                       cache-aware routing on a local two-worker cluster
  kvswitch up --workers 2 --port 50051
                                      a local cluster: a router and two CPU workers
  kvswitch generate --target 127.0.0.1:50051 --prompt 'Hello'
                                      one request through the router, streamed
  kvswitch router --port 50051        the router, with the embedded index
  kvswitch worker --port 50061        serve the built-in model on CPU over gRPC
  kvswitch worker --model DIR --device cuda --port 50062
                                      serve a Hugging Face checkpoint on a GPU
  kvswitch bench pool --json out.json block operations per second of the block pool
  kvswitch bench hash                 block-hashing throughput
  kvswitch index audit --index redis://127.0.0.1:6380
                                      the index against the workers' own caches
  kvswitch bench kernels              paged-attention kernels (needs a CUDA GPU)
  kvswitch kernels compile --arch 90  compile the kernels for H100 here: registers, spills, ...
  kvswitch loadtest --target 127.0.0.1:50051 --policies cost,round_robin
                                      the same prompts under two routing policies: TTFT, hit rate
  kvswitch sim --trace trace.jsonl --workers 16 --capacity-blocks 4096 --target-utilization 0.8
                                      replay a trace through every policy on a simulated fleet
  kvswitch bench routing              every policy on simulated fleets of 4, 8, 16 workers, goals

run 'kvswitch COMMAND --help' for the options of a command.
"""

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
    "dtype": "bfloat16, float16 or float32",
    "device": "cuda; or cpu, through Triton's interpreter (TRITON_INTERPRET=1, tiny shapes): "
    "checks the benchmark's steps, times nothing worth reading",
    "seed": "random seed of the data",
    "sweep": "also time decode and prefill under other tile sizes, warps, stages and splits",
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
    "seed": "random seed of the prompts",
}
DECODE_HELP = {
    "model": TTFT_HELP["model"],
    "device": TTFT_HELP["device"],
    "dtype": TTFT_HELP["dtype"],
    "batch_sizes": "comma-separated batch sizes to measure",
    "num_prompt_tokens": "prompt length of every request",
    "num_output_tokens": "tokens each request decodes",
    "cuda_graphs": "GPU: decode steps replayed from CUDA graphs (the worker's --cuda-graphs)",
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
SECURITY_HELP = {
    "tls_cert": "PEM certificate chain this process presents; turns TLS on for every gRPC hop "
    "it serves and calls (docs/SECURITY.md)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_ca": "PEM CA bundle that verifies the routers and workers this process calls (and, "
    "with --tls-client-auth, its callers); empty = the system's roots",
    "tls_client_auth": "mutual TLS: callers must present a certificate signed by --tls-ca, and "
    "this process presents its own when it calls",
    "fleet_token": "bearer token routers and workers present to each other; workers (and the "
    "router's embedded index) refuse calls without it; or set KVSWITCH_FLEET_TOKEN",
}
BLOCK_HASH_HELP = (
    "how blocks are named: xxh3 (fast, unkeyed: prompts whose blocks collide can be built), "
    "blake2b-keyed (keyed with a key derived from the fleet token; refused without one), or "
    "empty = blake2b-keyed when a fleet token is set, else xxh3. Every router and worker of a "
    "fleet must agree; a router refuses workers that do not (docs/HASHING.md)"
)
INDEX_TOOL_HELP = {
    "index": "the index: redis://HOST:PORT, rediss://... (TLS), redis+cluster://HOST:PORT, or "
    "grpc://ROUTER_HOST:PORT for a router's embedded index",
    "prefix": "key prefix of the deployment (several may share one Redis)",
    **SECURITY_HELP,
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
    "seed": "random seed of the prompts",
}
HASH_HELP = {
    "num_tokens": "prompt length in tokens",
    "block_size": "tokens per block",
    "duration_s": "seconds to measure each input kind for",
    "seed": "random seed of the prompt",
}
WORKER_DESCRIPTION = """\
Run one worker: a model with its paged KV cache, behind a gRPC server (kvswitch.v1.Worker and the
standard grpc.health.v1 health service; see docs/PROTOCOL.md).

The router sends it tokenized prompts; the worker streams the generated tokens back, reports its
load, and can list the KV blocks it holds, so that requests whose prompt prefix is cached here are
sent here. It runs until Ctrl-C or SIGTERM, then gives running requests --grace-s seconds to finish.
"""
WORKER_HELP = {
    "host": "address to listen on; 0.0.0.0 listens on every network interface",
    "port": "TCP port to listen on; 0 picks a free one (the address is printed at start)",
    "worker_id": "name the worker reports in its replies; empty = HOST:PORT",
    "model": "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json); "
    "empty = the built-in tiny model, which needs no files",
    "device": "where the model runs: cpu, cuda or cuda:N",
    "dtype": "number type of the weights and the KV cache: float32, float16 or bfloat16",
    "block_size": "tokens per KV cache block; the router and cache index must use the same",
    "kv_cache_bytes": "memory for the KV cache in bytes; divided into blocks, it sets how many "
    "tokens the worker can hold",
    "gpu_memory_fraction": "on a GPU, a fraction in (0, 1) of the memory left free after "
    "loading the model to use for the KV cache, instead of --kv-cache-bytes; 0 = off",
    "enable_prefix_caching": "reuse the KV blocks of earlier prompts that share a prefix",
    "kv_cache_shm": "CPU workers: keep the KV cache in a file in /dev/shm (as large as "
    "--kv-cache-bytes), where workers on the same host copy blocks straight out of it, the "
    "fastest way blocks move between two workers (docs/DISAGGREGATION.md)",
    "max_num_seqs": "most requests computed together in one step",
    "max_waiting_requests": "requests that may wait for a place in the batch (beyond "
    "--max-num-seqs); past them the worker answers RESOURCE_EXHAUSTED and the router tries "
    "another worker",
    "max_num_batched_tokens": "most tokens computed in one step; longer prompts are "
    "prefilled in chunks",
    "cuda_graphs": "GPU workers: capture the model's forward as CUDA graphs at start, one per "
    "batch size up to --max-num-seqs, and replay them for decode steps (docs/WORKER.md)",
    "cpu_threads": "CPU workers: threads torch computes a step with; 0 = one per core. Give "
    "several CPU workers on one host a share of the cores each (kvswitch up does): each taking "
    "them all, they slow each other many times over",
    "check_integrity": "check the KV cache's invariants each time the engine falls idle; a "
    "broken one stops the worker with the traceback (for tests and fault drills: it walks every "
    "block)",
    "max_hashes_per_chunk": "block hashes per message of a cache snapshot, when the "
    "client asks for none",
    "grace_s": "seconds running requests get to finish on Ctrl-C / SIGTERM before they are "
    "cancelled",
    "index": "block-hash index to publish this worker's cache to: grpc://ROUTER_HOST:PORT (a "
    "router's embedded index), redis://HOST:PORT, rediss://... (TLS), redis+cluster://HOST:PORT; "
    "empty = publish nothing",
    "index_prefix": "a Redis index: the prefix of every key it writes; fleets with different "
    "prefixes share one Redis without seeing each other (docs/SECURITY.md)",
    "role": "what the router sends here: both = whole requests; prefill = prompts to compute "
    "for a decode worker, which takes their KV blocks from here; decode = requests whose prompt "
    "a prefill worker computed, or short prompts it prefills itself (docs/DISAGGREGATION.md)",
    "served_model_name": "the model's name in the block-hash index: workers of one name share "
    "hashes; empty = derived from the checkpoint's content (docs/HASHING.md)",
    "metrics_port": "TCP port for Prometheus metrics at http://HOST:PORT/metrics; 0 picks a "
    "free one, -1 = no metrics endpoint (docs/OBSERVABILITY.md)",
    "engine_in_process": "run the engine core on a thread of the serving process instead of a "
    "process of its own: one process to debug or profile, sharing one GIL with token streaming",
    "insecure": "listen beyond loopback (a --host other than 127.0.0.1, ::1 or localhost) "
    "without a fleet token or mutual TLS, taking any caller; refused otherwise (docs/SECURITY.md)",
    "allow_pull_blocks": "serve Worker.PullBlocks, which pulls blocks from whatever peer its "
    "caller names: for benchmarks and tests on one machine (with a --host beyond loopback only "
    "with --insecure); off, it answers PERMISSION_DENIED",
    **SECURITY_HELP,
    "block_hash": BLOCK_HASH_HELP,
}
DEMO_HELP = {
    "workers": "CPU workers in the local cluster",
    "num_documents": "long documents (markdown tables) to ask about",
    "rows_per_document": "table rows per document",
    "questions_per_document": "questions per document, interleaved across documents",
    "num_chats": "multi-turn chats",
    "chat_turns": "turns per chat",
    "kv_cache_blocks": "KV cache blocks per worker (16 tokens each); small, so that caches fill",
    "max_tokens": "tokens generated per request",
    "seed": "random seed of the documents",
}
ROUTER_DESCRIPTION = """\
Run the router: clients send it prompts (kvswitch.v1.Router, see docs/PROTOCOL.md); it hashes each
prompt's blocks, asks the block-hash index which worker holds the longest cached prefix, weighs
that against each worker's load and forwards the request there, streaming the output back.

Workers find it through the index. With the default embedded index (memory://) the router serves
that index on its own port: start workers with --index grpc://ROUTER_HOST:PORT. Several routers
share one fleet through a Redis index (--index redis://...). Runs until Ctrl-C or SIGTERM.
"""
ROUTER_HELP = {
    "host": "address to listen on; 0.0.0.0 listens on every network interface",
    "port": "TCP port to listen on; 0 picks a free one (the address is printed at start)",
    "index": "block-hash index: memory:// (embedded, served to workers on this port), "
    "redis://HOST:PORT, rediss://... (TLS), redis+cluster://HOST:PORT",
    "index_prefix": "a Redis index: the prefix of every key it writes; fleets with different "
    "prefixes share one Redis without seeing each other (docs/SECURITY.md)",
    "model": "checkpoint directory whose tokenizer turns text prompts into tokens; empty = the "
    "built-in model's byte tokenizer",
    "namespace": "the model to route for, as the workers name it; empty = the one every live "
    "worker serves",
    "policy": "how to pick a worker: cost, prefix, least_loaded, round_robin or random "
    "(docs/ROUTER.md)",
    "prefill_weight": "cost policy: what one uncached prompt token costs, in tokens of queued work",
    "temperature": "cost policy: 0 = always the cheapest worker; > 0 = sample near-ties, in tokens",
    "decode_weight": "cost policy: what one output token still to decode on a worker costs, in "
    "prompt tokens (docs/ROUTING.md)",
    "min_match": "cost policy: a cached prefix shorter than this fraction of the prompt counts as "
    "none, so a short shared system prompt does not pull new prompts onto one worker",
    "private_weight": "cost policy: what one uncached prompt token past the shared prefix (a "
    "conversation's own history) costs, in tokens of queued work (docs/ROUTING.md)",
    "peer_fetch_tokens_per_s": "peer block fetch (cost policy): tokens of KV moved a second "
    "between two workers, as measured (kvswitch bench transfer: blocks_per_s x block size); with "
    "--prefill-tokens-per-s, a worker may take a cached prefix from its holder instead of "
    "computing it, where that costs less (docs/DISAGGREGATION.md); 0 = off",
    "peer_fetch_latency_ms": "peer block fetch: what one transfer costs besides its bytes, in ms",
    "prefill_tokens_per_s": "peer block fetch: prompt tokens a worker computes a second, as "
    "measured (kvswitch bench ttft); 0 = off",
    "max_failovers": "other workers to try when a worker fails a request",
    "wait_for_worker_s": "seconds a request that finds no routable worker waits for one (never "
    "past its deadline) before it fails with UNAVAILABLE",
    "pending_ttl_s": "seconds a routed prompt counts as cached on its worker before the worker's "
    "own cache events confirm it",
    "refresh_s": "seconds between readings of the live workers from the index",
    "load_poll_s": "seconds between load reports asked of each worker",
    "lost_after_failed_polls": "load polls a worker fails in a row (1 s timeout each) before "
    "the router takes it for lost and fails its streams over; one slow answer only keeps new "
    "requests off it until it answers",
    "min_remote_prefill_tokens": "disaggregated prefill: a prompt with fewer tokens than this "
    "uncached on its decode worker is prefilled there, not on a prefill worker",
    "max_prefill_queue_tokens": "disaggregated prefill: a prefill worker with more prompt tokens "
    "than this queued takes no more; the decode worker prefills instead",
    "kv_lease_s": "disaggregated prefill: seconds a prefill worker holds a prompt's KV blocks "
    "for its decode worker (each fetch restarts it)",
    "on_transfer_failure": "disaggregated prefill: when the KV transfer fails, recompute the "
    "missing blocks on the decode worker, or fail the request (ABORTED)",
    "kv_transport": "disaggregated prefill: how KV blocks travel: mapped (one host, copied "
    "straight out of a --kv-cache-shm worker's cache), shm (one host, through a file), grpc, or "
    "empty = the first of those that works",
    "token": "if set, clients must send 'authorization: Bearer TOKEN'; or set KVSWITCH_TOKEN",
    "max_prompt_tokens": "longest prompt a client may send, in tokens (INVALID_ARGUMENT past "
    "it); 0 = no limit",
    "max_output_tokens": "most tokens a request may ask for (sampling.max_tokens); 0 = no limit",
    "max_stop_token_ids": "most stop token ids a request may list; 0 = no limit",
    "max_streams_per_client": "most streams one client address may hold open at once "
    "(RESOURCE_EXHAUSTED past it); 0 = no limit",
    "max_message_bytes": "largest request message accepted, in bytes (gRPC refuses a larger "
    "one with RESOURCE_EXHAUSTED)",
    "request_overrides": "take a request's own routing policy and weights (routing.policy, "
    "routing.weights); with --no-request-overrides a request that sets them is refused "
    "(INVALID_ARGUMENT)",
    "insecure": "listen beyond loopback (a --host other than 127.0.0.1, ::1 or localhost) "
    "without a fleet token or mutual TLS, and serve the HTTP API there without API keys, "
    "taking any caller; refused otherwise (docs/SECURITY.md)",
    "metrics_port": "TCP port for Prometheus metrics at http://HOST:PORT/metrics; 0 picks a "
    "free one, -1 = no metrics endpoint (docs/OBSERVABILITY.md)",
    "http_port": "TCP port for the OpenAI-compatible HTTP API at http://HOST:PORT/v1 "
    "(completions, chat, models; https with --tls-cert); 0 picks a free one, -1 = none "
    "(docs/OPENAI.md)",
    "api_key": "HTTP API: keys clients must send as 'Authorization: Bearer KEY', "
    "comma-separated; or set KVSWITCH_API_KEYS; empty = the client token (--token), if set",
    "max_body_bytes": "HTTP API: largest request body, in bytes (413 past it)",
    "grace_s": "seconds running requests get to finish on Ctrl-C / SIGTERM",
    **SECURITY_HELP,
    "block_hash": BLOCK_HASH_HELP,
}
UP_HELP = {
    "workers": "number of workers that prefill and decode (role both); -1 = 2, or 0 when "
    "--prefill-workers or --decode-workers is given",
    "prefill_workers": "number of prefill workers: they compute long prompts, and decode "
    "workers take the KV blocks from them (docs/DISAGGREGATION.md)",
    "decode_workers": "number of decode workers",
    "port": "the router's port (0 picks a free one)",
    "redis": "empty = the router's embedded index; 'local' = start a redis-server for the "
    "cluster; or a redis:// URL to use",
    "model": WORKER_HELP["model"],
    "device": "cpu, or cuda (worker i on GPU i mod the number of GPUs)",
    "dtype": WORKER_HELP["dtype"],
    "block_size": WORKER_HELP["block_size"],
    "kv_cache_bytes": "KV cache memory per worker, in bytes",
    "kv_cache_shm": WORKER_HELP["kv_cache_shm"],
    "cuda_graphs": WORKER_HELP["cuda_graphs"],
    "policy": ROUTER_HELP["policy"],
    "host": "address every process listens on",
    "http_port": "the router's OpenAI-compatible HTTP API at http://HOST:PORT/v1; 0 picks a "
    "free one, -1 = none (docs/OPENAI.md)",
    "metrics_port": "Prometheus /metrics of the router on this port and of worker i on the "
    "i+1-th after it (workers, then prefill, then decode workers); 0 = a free port each (in "
    "their logs), -1 = none",
    "grace_s": "seconds running requests get to finish when the cluster stops",
    "insecure": "let every process listen on a --host beyond loopback without a fleet token "
    "or mutual TLS (passed on as --insecure); on 127.0.0.1 nothing is needed, elsewhere set "
    "KVSWITCH_FLEET_TOKEN (and KVSWITCH_API_KEYS for --http-port) instead",
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
    "cuda_graphs": "GPU: decode steps replayed from CUDA graphs (the worker's --cuda-graphs); "
    "the replay is then the forward taken out",
    "parts": "also time each part of the host work on its own (parts_ms)",
    "seed": "random seed of the prompts",
}
TRANSFER_HELP = {
    "num_prompts": "prompts the holder computes; the taker pulls each one's blocks in one call",
    "prompt_tokens": "tokens per prompt (16 a block)",
    "seed": "random seed of the prompts",
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
SIM_HELP = {
    "trace": "JSON-lines trace to replay (Mooncake format: timestamp ms, input_length, "
    "output_length, hash_ids)",
    "workers": "simulated workers",
    "capacity_blocks": "KV cache blocks per worker",
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
    "pending_ttl_s": "seconds a routed prompt counts as cached on its worker before the index "
    "confirms it",
    "cost_weights": "the cost policy's weights, 'key=value,...' (prefill_weight, decode_weight, "
    "min_match, private_weight, temperature, fetch_token_cost, fetch_latency_tokens); empty = "
    "its defaults",
    "fetch_tokens_per_s": "peer block fetch: tokens of KV moved a second between two workers; "
    "the cost policy weighs moving a cached prefix against computing it at the profile's "
    "prefill speed; 0 = no peer fetch",
    "fetch_latency_s": "peer block fetch: what one transfer costs besides its bytes, in seconds",
    "seed": "random seed of the policies that sample",
}
LOADTEST_HELP = {
    "target": "the router, HOST:PORT; several routers of one fleet comma-separated (session i "
    "goes through router i mod their number)",
    "workload": "shared_prefix, long_document_qa, multi_turn_chat, no_sharing or trace",
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


def _plain(doc: str | None) -> str:
    """A module's docstring as a command's description: ``code`` marks read as noise there."""
    return (doc or "").replace("``", "")


def _write_json(result: dict[str, Any], path: Path | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if path is not None:
        path.write_text(text + "\n")
        print(f"wrote {path}", file=sys.stderr)


def _bench_command(run: Callable[[Any], dict[str, Any]], config_cls: type) -> Callable:
    def command(args: argparse.Namespace) -> None:
        config = config_from_args(config_cls, args)
        result = run(config)
        _write_json(result, args.json)
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


def _worker_command(args: argparse.Namespace) -> None:
    from kvswitch.worker import server as worker_server

    config = config_from_args(worker_server.WorkerConfig, _tokens_from_env(args))
    # NOTE: workers that share a terminal (kvswitch up) tell their lines apart by it.
    _configure_logging({"worker_id": config.worker_id} if config.worker_id else {})
    try:
        worker_server.run(config)
    except (worker_server.WorkerStartError, worker_server.WorkerFailed) as e:
        sys.exit(f"kvswitch worker: {e}")


def _tokens_from_env(args: argparse.Namespace) -> argparse.Namespace:
    """Tokens not given as options, from the environment (a command line shows in ps)."""
    from kvswitch.security import API_KEYS_ENV, FLEET_TOKEN_ENV, TOKEN_ENV

    for name, env in (("token", TOKEN_ENV), ("fleet_token", FLEET_TOKEN_ENV)):
        if hasattr(args, name) and not getattr(args, name):
            setattr(args, name, os.environ.get(env, ""))
    # NOTE: API keys only for a router that serves HTTP: a router without --http-port refuses
    # --api-key, and an environment set for the whole fleet must not make it fail.
    if hasattr(args, "api_key") and not args.api_key and args.http_port >= 0:
        args.api_key = os.environ.get(API_KEYS_ENV, "")
    return args


def _configure_logging(process_fields: dict[str, str] | None = None) -> None:
    try:
        log_format, log_level = log_format_from_env(), log_level_from_env()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    configure_logging(log_level, json=log_format == "json", process_fields=process_fields or {})


def _router_command(args: argparse.Namespace) -> None:
    from kvswitch.router import server as router_server

    config = config_from_args(router_server.RouterConfig, _tokens_from_env(args))
    _configure_logging()
    try:
        router_server.run(config)
    except router_server.RouterStartError as e:
        sys.exit(f"kvswitch router: {e}")


def _up_command(args: argparse.Namespace) -> None:
    from kvswitch.deploy import local as cluster

    config = config_from_args(cluster.ClusterConfig, args)
    try:
        cluster.run(config)
    except cluster.ClusterError as e:
        sys.exit(f"kvswitch up: {e}")


def _exit_with(code: int) -> None:
    if code:
        sys.exit(code)


def _add_report_command(
    commands: argparse._SubParsersAction,
    name: str,
    summary: str,
    description: str,
    config_cls: type,
    helps: dict[str, str],
    run: Callable[[Any], dict[str, Any]],
) -> None:
    """A command that builds ``config_cls`` from its options, runs it and prints the JSON it
    returns; a file it cannot read or a value it refuses (ValueError) is a one-line message."""

    def command(args: argparse.Namespace) -> None:
        config = config_from_args(config_cls, args)
        try:
            result = run(config)
        except (OSError, ValueError) as e:
            fields = [field.name for field in dataclasses.fields(config_cls)]
            sys.exit(f"kvswitch {name}: {with_flags(str(e), fields)}")
        _write_json(result, args.json)

    sub = commands.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, config_cls, helps)
    sub.add_argument("--json", type=Path, metavar="OUT", help="also write the figures here")
    sub.set_defaults(func=command)


def _index_command(report: Callable) -> Callable:
    def command(args: argparse.Namespace) -> None:
        import asyncio

        from kvswitch.cache_index.audit import IndexToolConfig

        config = config_from_args(IndexToolConfig, _tokens_from_env(args))
        try:
            result = asyncio.run(report(config))
        except (ValueError, ConnectionError) as e:
            sys.exit(f"kvswitch index {args.index_tool}: {e}")
        _write_json(result, None)

    return command


def build_parser(command: str | None = None, *, summaries: bool = False) -> argparse.ArgumentParser:
    """The whole CLI; or, given a ``command`` it knows, that command alone; or, with
    ``summaries``, each command's name and summary only (``kvswitch --help``). Building a
    command imports what it runs, so a router or worker started by name does not load (say) the
    kernels' torch for commands it will never run, and ``kvswitch --help`` loads none of them."""
    if command not in {name for name, *_ in COMMANDS}:
        command = None
    parser = argparse.ArgumentParser(
        prog="kvswitch",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvswitch {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, help="what to run"
    )
    for name, extra, summary, add in COMMANDS:
        if command is not None and name != command:
            continue
        if summaries:
            # NOTE: never run: a command named on the command line is built in full instead.
            missing = _missing_module(extra)
            if missing is None:
                commands.add_parser(name, help=summary, add_help=False)
            else:
                _add_unavailable(commands, name, summary, str(extra), missing)
            continue
        try:
            add(commands, name, summary)
        except ModuleNotFoundError as e:
            if extra is None or not e.name or e.name.partition(".")[0] == "kvswitch":
                raise
            _add_unavailable(commands, name, summary, extra, e.name)
    return parser


# Modules each extra brings, looked for (not imported) to mark the command list.
EXTRA_MODULES = {
    "router": ("grpc_health", "redis", "numpy"),
    "worker": ("grpc_health", "torch", "zmq"),
    "loadtest": ("numpy", "tqdm"),
    "all": ("grpc_health", "torch", "zmq", "tqdm"),
}


def _missing_module(extra: str | None) -> str | None:
    """A module of ``extra`` that this installation lacks, or None."""
    for module in EXTRA_MODULES.get(extra or "", ()):
        try:
            found = importlib.util.find_spec(module) is not None
        except ValueError:  # in sys.modules without a spec
            found = True
        if not found:
            return module
    return None


class _Unavailable:
    """A command whose extra is not installed: it says what to install, whatever its arguments."""

    def __init__(self, name: str, extra: str, missing: str) -> None:
        self.message = (
            f"kvswitch {name} needs kvswitch[{extra}], and this installation lacks the "
            f"{missing!r} module: pip install 'kvswitch[{extra}]'"
        )

    def __call__(self, args: argparse.Namespace) -> None:
        sys.exit(self.message)


def _add_unavailable(
    commands: argparse._SubParsersAction, name: str, summary: str, extra: str, missing: str
) -> None:
    sub = commands.add_parser(name, help=f"{summary} [needs kvswitch[{extra}]]", add_help=False)
    sub.set_defaults(func=_Unavailable(name, extra, missing))


def _import_servers() -> None:
    """For the commands that start routers and workers as processes: those must import here,
    and the modules of the worker's engine core be found."""
    import kvswitch.router.server
    import kvswitch.worker.server

    kvswitch.worker.server.check_engine_modules()


def _add_demo(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.app import demo

    _import_servers()

    sub = commands.add_parser(
        name,
        help=summary,
        description=_plain(demo.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, demo.DemoConfig, DEMO_HELP)
    sub.set_defaults(func=lambda args: demo.run(config_from_args(demo.DemoConfig, args)))


def _add_router(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.router import server as router_server

    sub = commands.add_parser(
        name,
        help=summary,
        description=ROUTER_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, router_server.RouterConfig, ROUTER_HELP)
    sub.set_defaults(func=_router_command)


def _add_up(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.deploy import local as cluster

    _import_servers()

    sub = commands.add_parser(
        name,
        help=summary,
        description=_plain(cluster.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, cluster.ClusterConfig, UP_HELP)
    sub.set_defaults(func=_up_command)


def _add_exit_status_command(
    commands: argparse._SubParsersAction, name: str, summary: str, module, config_cls, helps
) -> None:
    """A command whose ``module.run(config)`` returns the process's exit status."""
    sub = commands.add_parser(
        name,
        help=summary,
        description=_plain(module.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, config_cls, helps)
    sub.set_defaults(
        func=lambda args: _exit_with(
            module.run(config_from_args(config_cls, _tokens_from_env(args)))
        )
    )


def _add_generate(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.app import generate

    _add_exit_status_command(
        commands, name, summary, generate, generate.GenerateConfig, GENERATE_HELP
    )


def _add_health(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.app import health

    _add_exit_status_command(commands, name, summary, health, health.HealthConfig, HEALTH_HELP)


def _add_worker(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.worker import server as worker_server

    worker_server.check_engine_modules()
    sub = commands.add_parser(
        name,
        help=summary,
        description=WORKER_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, worker_server.WorkerConfig, WORKER_HELP)
    sub.set_defaults(func=_worker_command)


def _add_index(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
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
            description=_plain(index_audit.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_config_args(sub, index_audit.IndexToolConfig, INDEX_TOOL_HELP)
        sub.set_defaults(func=_index_command(report))


def _add_kernels(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
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
        description=_plain(aot.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(compile_parser, aot.CompileReportConfig, KERNEL_COMPILE_HELP)
    compile_parser.add_argument(
        "--json", type=Path, metavar="OUT", help="also write the report here"
    )
    compile_parser.set_defaults(func=_kernels_compile_command)


def _add_sim(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.loadtest import sim, sim_report

    description = _plain(sim_report.__doc__) + "\n" + _plain(sim.__doc__)
    _add_report_command(
        commands, name, summary, description, sim.SimConfig, SIM_HELP, sim_report.run
    )


def _add_loadtest(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.loadtest import live, workloads

    description = _plain(live.__doc__) + "\n" + _plain(workloads.__doc__)
    _add_report_command(
        commands, name, summary, description, live.LoadTestConfig, LOADTEST_HELP, live.run
    )


def _add_bench(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.benchmarks import admission as admission_bench
    from kvswitch.benchmarks import engine as engine_bench
    from kvswitch.benchmarks import hashing as hash_bench
    from kvswitch.benchmarks import http_front as http_bench
    from kvswitch.benchmarks import index as index_bench
    from kvswitch.benchmarks import kernels as kernel_bench
    from kvswitch.benchmarks import lookup as lookup_bench
    from kvswitch.benchmarks import overload as overload_bench
    from kvswitch.benchmarks import pd as pd_bench
    from kvswitch.benchmarks import pool as pool_bench
    from kvswitch.benchmarks import router as router_bench
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
            "through shared memory",
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
            "startup",
            startup_bench.run,
            startup_bench.StartupBenchConfig,
            {"num_runs": "fresh processes per command; the median is reported"},
            "how long each kvswitch command takes to start (its help, as a fresh process)",
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
            description=_plain(sys.modules[run.__module__].__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_config_args(sub, config_cls, helps)
        sub.add_argument("--json", type=Path, metavar="OUT", help="also write the figures here")
        sub.set_defaults(func=_bench_command(run, config_cls))


# (name, the extra it needs, summary, adder), in the order `kvswitch --help` lists them. A
# command whose extra is not installed is listed still, and says what to install when run; one
# that needs no extra (None) runs on the client's dependencies alone.
COMMANDS: list[
    tuple[str, str | None, str, Callable[[argparse._SubParsersAction, str, str], None]]
] = [
    (
        "demo",
        "all",
        "cache-aware routing on a local cluster of two CPU workers, cost vs round_robin",
        _add_demo,
    ),
    (
        "router",
        "router",
        "run the router: sends each request where its prompt's KV cache is",
        _add_router,
    ),
    ("up", "all", "run a local cluster in the foreground: N workers and a router", _add_up),
    ("generate", None, "send one prompt to a router and stream the output", _add_generate),
    ("worker", "worker", "run a GPU (or CPU) worker: the model behind a gRPC server", _add_worker),
    (
        "health",
        "router",
        "ask a router or worker whether it serves (gRPC health check): exit 0 if it does",
        _add_health,
    ),
    (
        "index",
        "router",
        "inspect a block-hash index: its size, and whether it agrees with the workers",
        _add_index,
    ),
    ("kernels", "worker", "the Triton kernels: compile them for a GPU without one", _add_kernels),
    ("bench", "all", "measure a component; prints JSON and can write it to a file", _add_bench),
    (
        "loadtest",
        "loadtest",
        "load-test a live router: a workload under several routing policies, vllm-style figures",
        _add_loadtest,
    ),
    (
        "sim",
        "router",
        "replay a request trace through the routing policies on a simulated fleet",
        _add_sim,
    ),
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    parser = build_parser(command, summaries=command not in {name for name, *_ in COMMANDS})
    args, unknown = parser.parse_known_args(argv)
    if unknown and not isinstance(args.func, _Unavailable):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        args.func(args)
    except ModuleNotFoundError as e:
        # A dependency imported only once the command runs (torch, inside the worker's engine).
        extra = next((extra for name, extra, *_ in COMMANDS if name == args.command), None)
        if extra is None or not e.name or e.name.partition(".")[0] == "kvswitch":
            raise
        _Unavailable(args.command, extra, e.name)(args)
    except KeyboardInterrupt:
        # Ctrl-C: what was running (a stream, a benchmark) is given up, without a traceback;
        # a stream's call is cancelled as its channel closes, so the worker stops it too.
        print(f"\nkvswitch {args.command}: interrupted", file=sys.stderr)
        return 130
    except ConfigError as e:
        parser.error(str(e))
    except BenchmarkUnavailable as e:
        print(f"kvswitch: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
