"""The stage worker: the process shell around a stage's engine, and its I/O threads."""
