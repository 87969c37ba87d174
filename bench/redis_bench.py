"""
The Redis Streams broker of the real-triggerer benchmark (``bench/triggerer_bench.py``), over the
Redis test kit (``devkit.kits.redis``): a real ``redis-server`` for the run (or ``REDIS_URL``), one
stream per case, published with pipelined ``XADD`` (one paced ``XADD`` per message in the steady
phase).
"""

from __future__ import annotations

from bench.triggerer_bench import BenchBroker


class RedisBroker(BenchBroker):
    name = "redis"
    conn_id = "bench_redis"
