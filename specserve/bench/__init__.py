"""Benchmarks run by `specserve bench decode` and benchmarks/bench_gpu.py."""
