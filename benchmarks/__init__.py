"""Benchmarks as suites: `python -m benchmarks run SUITE` (README.md lists them)."""
