"""Engines for tests: a fake of vLLM's AsyncLLM and a tiny async engine."""
