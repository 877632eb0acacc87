"""Reserved for the cache-aware routing load tests and the trace-driven fleet simulator; empty so
far."""
