"""Benchmarks: one scenario per module (`python -m benchmarks.<scenario>`), `run_all.py` for all."""
