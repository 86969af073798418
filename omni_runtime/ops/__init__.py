"""Operator commands over a running deployment: `status`, `dead-letters`, `trace`."""
