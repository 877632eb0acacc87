"""kvswitch: cache-aware routing for LLM fleets."""

__version__ = "0.1.0"
