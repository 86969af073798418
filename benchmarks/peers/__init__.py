"""omni-runtime beside a peer on the same work: `python -m benchmarks.peers` (Ray Serve)."""
