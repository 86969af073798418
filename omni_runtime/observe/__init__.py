"""Observability of one process: the metrics registry (`metrics.py`) and its export,
stats, timings, tracers and their exporters.

`start.Observability` is the one object a process shell builds, hands to its parts and
starts from the settings.
"""
