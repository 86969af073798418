"""Engine adapters' own tests, and engines for tests: a fake of vLLM's AsyncLLM, a tiny async
engine."""
