"""Observability of one process: the metrics registry (`metrics.py`) and its export,
stats, timings, tracers and their exporters.

`start_observability` starts, from the settings, what a process shell needs.
"""
