"""Observability of one process: metrics export, stats, timings, tracers and their exporters.

`start_observability` starts, from the settings, what a process shell needs; the
registry itself (`omni_runtime.metrics`) stays at the top level because every component
uses it.
"""
