"""Benchmark scripts behind ``kvswitch bench``; each returns the figures it measured as a dict."""
