"""A GPU worker: block pool, KV cache manager and (later) the paged-KV engine and gRPC server."""
