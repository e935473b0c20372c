"""``qwenserve bench``: serving, offline-throughput and latency benchmarks with vLLM's figures."""
