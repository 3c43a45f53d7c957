"""Benchmark drivers behind `decodekit bench`; each returns a JSON-ready dict."""
