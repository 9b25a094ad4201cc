"""Benchmarks: `serval bench offline` (bench/offline.py); bench_scheduler.py is a script."""
