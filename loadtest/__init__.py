"""Cache-aware routing load tests and the trace-driven simulator."""
