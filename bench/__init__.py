"""Benchmarks (not tests). Run them from the repository root, e.g. ``.venv/bin/python -m bench.kafka_bench``."""
