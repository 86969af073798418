"""Child processes of the scenarios, each run as `python -m benchmarks.roles.<role>`."""
