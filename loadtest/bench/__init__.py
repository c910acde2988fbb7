"""Benchmarks of single parts: the gateway's overhead, admission, tokenizing, the simulator."""
