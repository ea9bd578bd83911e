"""Benchmarks of ringllm: ``python -m bench serve | sweep | throughput`` (see bench/README.md)."""
