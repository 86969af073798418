"""Stage code the scenarios deploy (pipelines of their own, next to these modules)."""
