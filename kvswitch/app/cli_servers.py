"""The commands that run servers: ``kvswitch router``, ``worker``, ``up`` and ``demo``."""

from __future__ import annotations

import argparse
import functools
import sys

from kvswitch.app.cli_args import (
    add_config_args,
    config_from_args,
    configure_process_logging,
    plain_doc,
    tokens_from_env,
)

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
    "stream_interval": "tokens a streamed chunk carries at least (the first token and a "
    "stream's end go at once): N cuts the messages the router relays N-fold, each token "
    "reaching the client up to N-1 decode steps later",
    "max_waiting_requests": "requests that may wait for a place in the batch (beyond "
    "--max-num-seqs); past them the worker answers RESOURCE_EXHAUSTED and the router tries "
    "another worker",
    "max_num_batched_tokens": "most tokens computed in one step; longer prompts are "
    "prefilled in chunks",
    "cuda_graphs": "GPU workers: capture the model's forward as CUDA graphs at start and replay "
    "them: decode steps whole (a graph per batch size up to --max-num-seqs), one sequence's "
    "steps of up to 512 tokens whole, others of up to 512 tokens all but attention "
    "(docs/WORKER.md). Default: on with --device cuda; --no-cuda-graphs turns them off",
    "lora": "serve a LoRA adapter beside the base model: NAME=PATH, PATH a PEFT adapter's "
    "folder (adapter_config.json, adapter_model.safetensors); repeat for more. A request names "
    "it in its lora field (docs/LORA.md)",
    "enable_lora": "make the LoRA slots without a --lora too, for adapters loaded at run time "
    "(the LoadLoraAdapter call; a router's POST /v1/load_lora_adapter)",
    "max_loras": "adapters one step may use (device slots for them); requests of another "
    "adapter wait for a slot",
    "max_lora_rank": "the largest adapter rank served (the slots are sized for it)",
    "max_cpu_loras": "adapters kept read in host memory, least recently used dropped first; "
    "0 = every adapter served",
    "cache_hidden_states": "keep every full block's final hidden states in host memory beside "
    "its KV, so that prompt logprobs (echo) and embeddings of a cached prefix are not computed "
    "again (docs/WORKER.md); every step then runs without CUDA graphs",
    "offload_gb": "GiB of host memory for a second tier of KV blocks: blocks the device's cache "
    "evicts are copied there (off the step path) and loaded back when a prompt needs them, "
    "instead of computed (docs/WORKER.md); 0 = none",
    "hidden_cache_bytes": "cap the hidden-state cache at this many bytes; 0 = a row for every "
    "KV block (the memory per block is logged at start)",
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
    "kv_events_config": "publish the cache's events as a vLLM engine does, for routers that "
    "read vLLM's KV events (llm-d, Dynamo): vLLM's JSON and rules (a tcp endpoint binds with * "
    'or ::, else connects), e.g. \'{"enable_kv_cache_events": true, "endpoint": '
    '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'; binding beyond loopback needs '
    "--insecure (events carry prompts' tokens in the clear): on one machine use ipc:// or "
    "tcp://[::1]:PORT",
    "http_port": "TCP port for the worker's own OpenAI-compatible HTTP API, as a vLLM server's: "
    "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics at "
    "http://HOST:PORT; 0 picks a free one, -1 = none. Needs no router nor index "
    "(docs/ENGINES.md)",
    "api_key": "HTTP API: keys clients must send as 'Authorization: Bearer KEY', "
    "comma-separated; or set KVSWITCH_API_KEYS; empty = the fleet token, if any; beyond "
    "loopback, refused without a key or mutual TLS unless --insecure",
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
    "lora_load_tokens": "cost policy: what loading a request's LoRA adapter into a device slot "
    "costs a worker, in prompt tokens (docs/LORA.md)",
    "lora_loaded_weight": "cost policy: the share of --lora-load-tokens a worker with the "
    "adapter in a slot is spared (its affinity, 0 to 1)",
    "lora_free_slot_weight": "cost policy: the share of --lora-load-tokens a worker with a free "
    "slot is spared (its affinity, 0 to 1); a worker that must evict an adapter is spared none",
    "lora_updates": "the HTTP API loads and unloads LoRA adapters on every worker: POST "
    "/v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name}; the "
    "path must be readable on each worker's host (docs/LORA.md). Whoever holds an API key may "
    "make the workers read a folder of their disks",
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
    "kv_transport": "disaggregated prefill: how KV blocks travel: nixl (a one-sided NIXL read by "
    "the decode worker, any host; kvswitch[nixl] on both workers), mapped (one host, copied "
    "straight out of a --kv-cache-shm worker's cache), shm (one host, through a file), grpc, or "
    "auto = the first of those that works",
    "token": "if set, clients must send 'authorization: Bearer TOKEN'; or set KVSWITCH_TOKEN",
    "max_prompt_tokens": "longest prompt a client may send, in tokens (INVALID_ARGUMENT past "
    "it); 0 = no limit",
    "max_output_tokens": "most tokens a request may ask for (sampling.max_tokens); 0 = no limit",
    "max_stop_token_ids": "most stop token ids a request may list; 0 = no limit",
    "max_streams_per_client": "most streams one client address may hold open at once "
    "(RESOURCE_EXHAUSTED past it); 0 = no limit",
    "tenant_header": "a request's tenant is the value of this header (gRPC metadata, or the same "
    "HTTP header on the OpenAI API; lowercase), else the API key an HTTP client presented, else "
    "the client's address (docs/ROUTER.md)",
    "max_streams_per_tenant": "most streams one tenant may hold open at once "
    "(RESOURCE_EXHAUSTED, HTTP 429, with a retry-after, past it); 0 = no limit",
    "max_requests_per_tenant_per_s": "the rate a tenant's requests may start at, in bursts of "
    "--tenant-burst (RESOURCE_EXHAUSTED, HTTP 429, with how long to wait, past it); 0 = no limit",
    "tenant_burst": "requests a tenant may start at once before its rate applies; 0 = the rate, "
    "rounded up",
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
    "embedding_pooling": "HTTP API: how /v1/embeddings pools a prompt's final hidden states "
    "when a request does not say: last (the last token's) or mean; empty = as the checkpoint's "
    "sentence-transformers config (modules.json) says, else last",
    "grace_s": "seconds running requests get to finish on Ctrl-C / SIGTERM",
    "processes": "run this many router processes on the one --port and --http-port (the kernel "
    "spreads clients' connections over them), routing as one through the shared --index (a "
    "Redis); process i serves metrics on --metrics-port + i (docs/ROUTER.md)",
    "reuse_port": "share --port and --http-port with other routers on this host (SO_REUSEPORT); "
    "--processes sets it for its own",
    "replica_sync": "routers sharing a Redis index tell each other what they route (requests in "
    "flight per worker, blocks about to be cached) on its pub/sub, so that they route as one: "
    "auto = whenever the index is a Redis, off = never (docs/ROUTER.md)",
    **SECURITY_HELP,
    "block_hash": BLOCK_HASH_HELP,
    "engine": "an OpenAI-API engine to route to, NAME=http://HOST:8000 (a vLLM server, or a "
    "kvswitch worker with --http-port); repeat for each. Needs --engine-events for it, "
    "--namespace (the model name it serves) and --http-port (docs/ENGINES.md)",
    "engine_events": "an engine's KV events, NAME=tcp://HOST:5557: the endpoint of its "
    "--kv-events-config; repeat for each engine",
    "engine_replay": "an engine's replay socket, NAME=tcp://HOST:5558 (its replay_endpoint), to "
    "ask again for lost events; without it a lost event clears the engine's entries",
    "engine_topic": "the topic the engines publish their KV events under (vLLM's topic)",
    "engine_fleet": "a JSON file of more engines: a list of objects with the fields name, url, "
    'events and replay (optional), as the options give them, e.g. [{"name": "a", "url": '
    '"http://10.0.0.5:8000", "events": "tcp://10.0.0.5:5557"}]',
    "gpu_block_weight": "what a matched block of a worker or an engine counts for where its "
    "device (GPU) holds it, once it has told of another tier (a worker's --offload-gb, vLLM's "
    "CPU offloading)",
    "cpu_block_weight": "what a matched block of a worker or an engine counts for where only a "
    "lower tier (host memory, CPU) holds it: below a device one, above none",
    "engine_api_key": "the key the engines take (vLLM's --api-key), sent as 'Authorization: "
    "Bearer KEY' with each forwarded request and poll; or set KVSWITCH_ENGINE_API_KEY",
    "block_size": "tokens per KV block of the engines (vLLM's --block-size); kvswitch workers "
    "say their own",
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
    "max_num_seqs": "most requests each worker computes together in one step",
    "cuda_graphs": WORKER_HELP["cuda_graphs"],
    "lora": "a LoRA adapter every worker serves, NAME=PATH (each worker's --lora); repeat for more",
    "max_loras": WORKER_HELP["max_loras"],
    "enable_lora": WORKER_HELP["enable_lora"],
    "lora_updates": ROUTER_HELP["lora_updates"] + " (needs --http-port)",
    "cache_hidden_states": WORKER_HELP["cache_hidden_states"],
    "policy": ROUTER_HELP["policy"],
    "kv_transport": ROUTER_HELP["kv_transport"],
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


def _worker_command(args: argparse.Namespace) -> None:
    from kvswitch.worker import server as worker_server

    config = config_from_args(worker_server.WorkerConfig, tokens_from_env(args))
    # NOTE: workers that share a terminal (kvswitch up) tell their lines apart by it.
    configure_process_logging({"worker_id": config.worker_id} if config.worker_id else {})
    try:
        start_http = None
        if config.http_port >= 0:
            from kvswitch.app.worker_http import start_worker_http

            start_http = functools.partial(start_worker_http, config)
        worker_server.run(config, start_http)
    except (worker_server.WorkerStartError, worker_server.WorkerFailed) as e:
        sys.exit(f"kvswitch worker: {e}")


def _router_command(args: argparse.Namespace) -> None:
    from kvswitch.router import server as router_server

    config = config_from_args(router_server.RouterConfig, tokens_from_env(args))
    configure_process_logging()
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


def import_servers() -> None:
    """For the commands that start routers and workers as processes: those must import here,
    and the modules of the worker's engine core be found."""
    import kvswitch.router.server
    import kvswitch.worker.server

    kvswitch.worker.server.check_engine_modules()


def add_demo(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.app import demo

    import_servers()

    sub = commands.add_parser(
        name,
        help=summary,
        description=plain_doc(demo.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, demo.DemoConfig, DEMO_HELP)
    sub.set_defaults(func=lambda args: demo.run(config_from_args(demo.DemoConfig, args)))


def add_router(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.router import server as router_server

    sub = commands.add_parser(
        name,
        help=summary,
        description=ROUTER_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, router_server.RouterConfig, ROUTER_HELP)
    sub.set_defaults(func=_router_command)


def add_up(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
    from kvswitch.deploy import local as cluster

    import_servers()

    sub = commands.add_parser(
        name,
        help=summary,
        description=plain_doc(cluster.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(sub, cluster.ClusterConfig, UP_HELP)
    sub.set_defaults(func=_up_command)


def add_worker(commands: argparse._SubParsersAction, name: str, summary: str) -> None:
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
