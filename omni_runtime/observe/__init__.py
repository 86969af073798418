"""Observability of one process: metrics export, stats, timings, tracers' exporters.

`start_observability` starts, from the settings, what a process shell needs;
the registry itself (`omni_runtime.metrics`) and the tracers (`omni_runtime.tracing`)
stay at the top level because every component uses them.
"""
